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
