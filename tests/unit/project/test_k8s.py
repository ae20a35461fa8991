"""deploy/k8s/ is validated against the official Kubernetes JSON schemas shipped in the
kubernetes-validate wheel (strict: unknown fields are errors), and checked for what issue 11
asks: probes on the daemons, the reconciler as a CronJob submitting to the Spark cluster."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy/k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _validator() -> str:
    candidate = Path(sys.executable).parent / "kubernetes-validate"
    found = str(candidate) if candidate.exists() else shutil.which("kubernetes-validate")
    if not found:
        pytest.fail("kubernetes-validate is missing (dev extra)")
    return found


def _validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_validator(), "--strict", "--kubernetes-version", "1.30.0",
                           *map(str, paths)], capture_output=True, text=True, timeout=120)


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for p in MANIFESTS:
        for doc in yaml.safe_load_all(p.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_manifests_validate_strictly() -> None:
    proc = _validate(*MANIFESTS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout and "WARN" not in proc.stdout, proc.stdout
    assert proc.stdout.count("passed") == sum(len(list(yaml.safe_load_all(p.read_text())))
                                               for p in MANIFESTS)
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in MANIFESTS)


def test_the_validator_catches_a_broken_manifest(tmp_path: Path) -> None:
    doc = yaml.safe_load((K8S / "reconciler.yaml").read_text())
    doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["restartPolicy"] = 7
    doc["spec"]["schedul"] = "typo"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = _validate(bad)
    assert proc.returncode != 0 and "ERROR" in proc.stdout


def test_the_daemons_probes_call_health() -> None:
    """Readiness is the whole `hardelete health` check (for the tracker, its proven progress
    too); startup and liveness judge the daemon's own loop only (`--loop-only`): a tracker
    catching up a backlog proves no progress until it is through, and a restart would only start
    the catch-up again. The rest of what an SRE relies on: test_k8s_invariants.py."""
    from hardelete.health import stall_limit_s

    docs = _docs()
    config = docs[("ConfigMap", "hardelete")]["data"]
    settings = load_settings(env=config)
    for name in ("tracker", "reaper"):
        (c,) = docs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        assert c["args"] == [name, "run"]
        port = int(config["HARDELETE_METRICS_PORT"])
        assert {"name": "metrics", "containerPort": port} in c["ports"]
        health = ["hardelete", "health", name]
        assert c["readinessProbe"]["exec"]["command"] == health
        assert c["startupProbe"]["exec"]["command"] == [*health, "--loop-only"]
        live = c["livenessProbe"]["exec"]["command"]
        assert live[:4] == [*health, "--loop-only"] and live[4] == "--stall-seconds"
        # a restart only well after readiness has said the loop is stuck
        assert float(live[5]) >= 2 * stall_limit_s(settings, name)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["timeoutSeconds"] >= 5  # a Python start takes 1-3 s
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] \
            >= 120
