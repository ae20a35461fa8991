"""Every command facing an unreachable Redis, Kafka or S3, or missing settings: one line naming
the service and its URL, a non-zero exit, no traceback, in under 10 s. Plus the other operator
mistakes of issue 11 (bad port, misspelt variable, a closed pipe, piped width)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from core.settings import Settings
from hardelete.cli import main
from hardelete.services import KAFKA, REDIS, S3, needs
from sim.stack import free_port

ADDRESS = "s3://b/ns/x"
COMMANDS: list[list[str]] = [
    ["tracker", "run"],
    ["reaper", "run", "--once"],
    ["restore", "r", ADDRESS],
    ["reconcile", "--repo", "r", "--dry-run"],
    ["status"],
    ["explain", ADDRESS],
    ["incidents", "list"],
    ["incidents", "ack", "--by", "a", "--reason", "b"],
    ["hold", "add", ADDRESS, "--reason", "x"],
    ["hold", "remove", ADDRESS],
    ["hold", "list"],
    ["dlq", "list"],
    ["dlq", "show", "0:0"],
    ["dlq", "replay", "--file", "/nonexistent.json"],
    ["dlq", "resolve", "0:0"],
    ["quarantine", "list"],
    ["quarantine", "purge"],
    ["reports", "list"],
    ["reports", "show", "run"],
    ["pause", "r", "--reason", "x"],
    ["resume", "r"],
    ["health", "tracker"],
    ["schedule", "--once"],
]
SETTING = {REDIS: "REDIS_URL", KAFKA: "KAFKA_BOOTSTRAP", S3: "S3_ENDPOINT_URL"}
NAME = {REDIS: "Redis", KAFKA: "Kafka", S3: "S3"}


def _path(argv: list[str]) -> tuple[str, ...]:
    return tuple(argv[:2]) if argv[0] in ("tracker", "reaper", "hold", "dlq", "quarantine",
                                          "reports", "incidents") else (argv[0],)


def test_every_command_is_in_the_matrix() -> None:
    from hardelete.cli import COMMANDS as ALL

    covered = {_path(a) for a in COMMANDS}
    facing = {path for path, _t, _h in ALL if needs(path)}
    assert facing <= covered


@pytest.fixture
def live(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    urls = {REDIS: settings.redis_url, KAFKA: settings.kafka_bootstrap,
            S3: settings.s3_endpoint_url}
    for kind, url in urls.items():
        monkeypatch.setenv(f"HARDELETE_{SETTING[kind]}", url)
    monkeypatch.setenv("HARDELETE_LOG_LEVEL", "error")
    monkeypatch.setenv("COLUMNS", "1000")
    return urls


def _dead(kind: str) -> str:
    port = free_port()  # nothing listens there
    return {REDIS: f"redis://127.0.0.1:{port}/0", KAFKA: f"127.0.0.1:{port}",
            S3: f"http://127.0.0.1:{port}"}[kind]


@pytest.mark.parametrize("kind", [REDIS, KAFKA, S3])
def test_each_command_with_a_service_down(kind, live, monkeypatch, capsys) -> None:
    url = _dead(kind)
    monkeypatch.setenv(f"HARDELETE_{SETTING[kind]}", url)
    ran = 0
    for argv in COMMANDS:
        if kind not in needs(_path(argv), _Args(argv)):
            continue
        ran += 1
        capsys.readouterr()
        t0 = time.monotonic()
        code = main(argv)
        took = time.monotonic() - t0
        out, err = capsys.readouterr()
        assert code != 0, argv
        assert took < 10, (argv, took)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert f"{NAME[kind]} at {url} is unreachable" in lines[0], (argv, err)
        assert "Traceback" not in err and not out.strip(), argv
    assert ran >= 3


class _Args:
    def __init__(self, argv: list[str]) -> None:
        self.no_reports = "--no-reports" in argv


def test_each_command_with_no_settings(monkeypatch, capsys) -> None:
    for key in list(os.environ):
        if key.startswith("HARDELETE_") and key != "HARDELETE_LOG_FORMAT":
            monkeypatch.delenv(key)
    for argv in COMMANDS:
        capsys.readouterr()
        code = main(argv)
        _out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code != 0 and len(lines) == 1, (argv, err)
        assert "is not configured: set " in lines[0] and "HARDELETE_" in lines[0], argv


def _cli(*args: str, env: dict[str, str], timeout: float = 30,
         shell: str | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HARDELETE_")}
    argv = ["bash", "-c", shell] if shell else [sys.executable, "-m", "hardelete.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**clean, **env},
                          timeout=timeout)


def test_tracker_with_kafka_down_is_one_line_fast(settings) -> None:
    t0 = time.monotonic()
    proc = _cli("tracker", "run", env={"HARDELETE_KAFKA_BOOTSTRAP": _dead(KAFKA),
                                       "HARDELETE_REDIS_URL": settings.redis_url,
                                       "HARDELETE_LOG_FORMAT": "json"})
    assert time.monotonic() - t0 < 10
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Kafka at 127.0.0.1:" in proc.stderr


def test_reaper_with_redis_down_and_status_without_settings() -> None:
    proc = _cli("reaper", "run", "--once", env={"HARDELETE_REDIS_URL": _dead(REDIS),
                                                "HARDELETE_S3_ENDPOINT_URL": _dead(S3)})
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "Redis at redis://127.0.0.1:" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("status", env={})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("hardelete: error: Redis is not configured: set redis_url "
                                   "(HARDELETE_REDIS_URL); only `hardelete demo` starts "
                                   "embedded servers")


def test_operator_mistakes_without_traceback() -> None:
    proc = _cli("config", env={"HARDELETE_METRICS_PORT": "99999"})
    assert proc.returncode == 2 and "metrics_port" in proc.stderr and "65535" in proc.stderr
    proc = _cli("config", env={"HARDELETE_QUARANTINE_DAY": "3"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "HARDELETE_QUARANTINE_DAY: unknown variable" in proc.stderr
    assert "did you mean HARDELETE_QUARANTINE_DAYS?" in proc.stderr
    # a closed pipe is not an error worth a traceback
    exe = f"{sys.executable} -m hardelete.cli"
    proc = _cli(env={"HARDELETE_UPLOAD_TOKEN_SECRET": "s"},
                shell=f"{exe} config --json | head -1; {exe} config | head -c 10")
    assert proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("[")


def test_piped_output_is_full_width(settings, tmp_path: Path) -> None:
    """A table piped to a file keeps every cell whole (rich would cut it at 80 columns)."""
    from sim.operations import setup_repo

    setup_repo(settings)
    long = "s3://opsb/ns/" + "a-very-long-directory-name/" * 5 + "object"
    env = {"HARDELETE_REDIS_URL": settings.redis_url,
           "HARDELETE_S3_ENDPOINT_URL": settings.s3_endpoint_url}
    proc = _cli("hold", "add", long, "--reason", "legal hold for a long path", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = _cli("hold", "list", env=env)
    assert proc.returncode == 0 and long in proc.stdout and "legal hold for a long path" in \
        proc.stdout
    rows = orjson.loads(_cli("hold", "list", "--json", env=env).stdout)
    assert rows[0]["target"] == long


def test_readme_running_it_covers_every_command() -> None:
    from hardelete.cli import COMMANDS as ALL

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## Running it"):readme.index("## Safety, in one paragraph")]
    missing = [" ".join(p) for p, _t, _h in ALL if p != ("bench",) and " ".join(p) not in section]
    assert not missing


def test_library_log_lines_are_json_when_logs_are_json() -> None:
    code = ("import logging; from core.logs import configure_logging; "
            "configure_logging('json'); "
            "logging.getLogger('aiokafka').error('Unable connect to node %s', 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    (line,) = proc.stderr.splitlines()
    body = orjson.loads(line)
    assert body["event"] == "Unable connect to node 1" and body["logger"] == "aiokafka"
