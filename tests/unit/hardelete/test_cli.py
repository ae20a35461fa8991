"""The CLI shows one clear line, never a traceback, for a user's mistake."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson


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
    assert "s3cr3t" not in proc.stdout
    rows = {row["setting"]: row for row in orjson.loads(proc.stdout)}
    assert rows["upload_token_secret"]["value"] == "***"
    assert "default upload" not in proc.stderr and "built-in default" not in proc.stderr


def test_config_names_each_variable_and_where_its_value_came_from(tmp_path: Path) -> None:
    toml = tmp_path / "h.toml"
    toml.write_text("reaper_concurrency = 3\n")
    proc = _run("--config", str(toml), "config", "--json",
                env={"HARDELETE_TRACKER_POLL_MS": "7"})
    assert proc.returncode == 0, proc.stderr
    rows = {row["setting"]: row for row in orjson.loads(proc.stdout)}
    assert rows["reaper_concurrency"] == {"setting": "reaper_concurrency",
                                          "env": "HARDELETE_REAPER_CONCURRENCY",
                                          "value": 3, "source": f"file {toml}"}
    assert rows["tracker_poll_ms"]["source"] == "env HARDELETE_TRACKER_POLL_MS"
    assert rows["grace_seconds"]["source"] == "default"
    # the built-in upload-token secret is named as a warning
    assert "HARDELETE_UPLOAD_TOKEN_SECRET is the built-in default" in proc.stderr


def test_version() -> None:
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("hardelete ")


def test_a_negative_limit_is_a_usage_error() -> None:
    for cmd in (("dlq", "list"), ("reports", "list")):
        proc = _run(*cmd, "--limit", "-1")
        assert proc.returncode == 2
        assert "expected an integer >= 0, got -1" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_unknown_command_is_usage_error() -> None:
    proc = _run("frobnicate")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
