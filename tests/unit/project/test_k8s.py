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


def test_daemons_have_probes_and_the_reconciler_submits_to_spark() -> None:
    docs = _docs()
    for name in ("tracker", "reaper"):
        (c,) = docs[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        assert c["args"][:2] == [name, "run"]
        assert c["livenessProbe"]["httpGet"]["path"] == "/metrics"
        assert c["readinessProbe"]["exec"]["command"] == ["hardelete", "health", name]
        assert {"name": "metrics", "containerPort": 9108} in c["ports"]
    cron = docs[("CronJob", "reconciler")]["spec"]
    assert cron["concurrencyPolicy"] == "Forbid" and cron["startingDeadlineSeconds"] >= 3600
    (c,) = cron["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["reconcile", "--all"]
    config = docs[("ConfigMap", "hardelete")]["data"]
    master = config["HARDELETE_SPARK_MASTER"]
    svc = docs[("Service", "spark-master")]
    assert master == f"spark://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:7077"
    worker = docs[("Deployment", "spark-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert master in worker["command"] and "org.apache.spark.deploy.worker.Worker" in \
        worker["command"]
    # every variable is a setting, and the settings validate
    secrets = {e["name"]: "x" for e in c["env"] if e["name"].startswith("HARDELETE_")}
    s = load_settings(env={**config, **secrets})
    assert s.topic_replication_factor == 3 and s.metrics_port == 9108
