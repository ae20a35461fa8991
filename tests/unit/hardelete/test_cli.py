"""The CLI shows one clear line, never a traceback, for a user's mistake."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hardelete.cli", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120,
    )


def test_bad_config_names_key_without_traceback() -> None:
    proc = _run("config", env={"HARDELETE_REAPER_CONCURRENCY": "lots"})
    assert proc.returncode == 2
    assert "HARDELETE_REAPER_CONCURRENCY" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_config_file() -> None:
    proc = _run("--config", "/nonexistent.toml", "config")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_config_masks_secrets() -> None:
    proc = _run("config", "--json", env={"HARDELETE_UPLOAD_TOKEN_SECRET": "s3cr3t"})
    assert proc.returncode == 0, proc.stderr
    assert "s3cr3t" not in proc.stdout and '"upload_token_secret": "***"' in proc.stdout


def test_unknown_command_is_usage_error() -> None:
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
