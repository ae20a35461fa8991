"""deploy/k8s/ is validated against the official Kubernetes JSON schemas shipped in the
kubernetes-validate wheel (strict: unknown fields are errors; sim/deploy_check.py, the README's
check), and checked for what issue 11 asks: probes on the daemons, the reconciler as a CronJob
submitting to the Spark cluster."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.settings import load_settings
from sim.deploy_check import k8s_problems

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy/k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for p in MANIFESTS:
        for doc in yaml.safe_load_all(p.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_manifests_validate_strictly() -> None:
    assert k8s_problems(K8S) == []
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in MANIFESTS)


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    return copy


def _break_reconciler(text: str) -> str:
    doc = yaml.safe_load(text)
    doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["restartPolicy"] = 7
    doc["spec"]["schedul"] = "typo"
    return str(yaml.safe_dump(doc))


# (file, how it is broken): the last four pass kubernetes-validate's command line (exit 0).
_BREAKAGES: dict[str, tuple[str, Callable[[str], str]]] = {
    "unknown field, wrong type": ("reconciler.yaml", _break_reconciler),
    "not yaml": ("tracker.yaml", lambda text: text + "\nkind: [\n"),
    "misspelt kind": ("tracker.yaml",
                      lambda text: text.replace("kind: Deployment", "kind: Deploymnt")),
    "empty manifest": ("reaper.yaml", lambda text: ""),
    "manifest not listed": ("kustomization.yaml",
                            lambda text: text.replace("  - reaper.yaml\n", "")),
    "listed manifest missing": ("kustomization.yaml",
                                lambda text: text + "  - gone.yaml\n"),
}


@pytest.mark.parametrize("breakage", sorted(_BREAKAGES))
def test_the_check_fails_on_a_broken_copy_of_the_manifests(tmp_path: Path, breakage: str) -> None:
    """Finding 2 (issue 36), for Kubernetes: each broken copy fails the check the README gives
    (`./dev deploy-check`), also those kubernetes-validate's command line lets pass."""
    copy = _copy(tmp_path)
    name, breaks = _BREAKAGES[breakage]
    before = (copy / name).read_text()
    (copy / name).write_text(breaks(before))
    assert (copy / name).read_text() != before
    assert k8s_problems(copy), breakage
    proc = subprocess.run([sys.executable, "-m", "sim.deploy_check", "--k8s", str(copy)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr


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
