"""deploy/k8s/ (the base) and deploy/k8s-spark-standalone/ (the optional Spark cluster) are
validated against the official Kubernetes JSON schemas shipped in the kubernetes-validate wheel
(strict: unknown fields are errors): every document of every manifest file, and what
`kubectl kustomize` renders of each kustomization, which is what `kubectl apply -k` applies.
Then what an SRE relies on: a disruption budget per daemon, every secret setting from the
Secret, resources and the restricted Pod Security Standard on every container, and the
reconciler as a CronJob running Spark in local mode (no Spark cluster in the base); the probes
are in test_k8s.py. deploy/k8s/monitoring/ holds Prometheus Operator objects, which have no
schema here: tests/unit/project/test_alerts.py checks its rules."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from core.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy/k8s"
SPARK = ROOT / "deploy/k8s-spark-standalone"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SECRET = "hardelete-secrets"
DAEMONS = ("tracker", "reaper")
# core/settings.py's credentials and signing keys: what must never sit in a ConfigMap
SECRET_SETTINGS = sorted(f.name for f in fields(Settings)
                         if "secret" in f.name or f.name.endswith("_key"))

Doc = dict[str, Any]


def _files() -> list[Path]:
    """Every manifest file: the base's and the Spark cluster's (not the overlay's patch)."""
    listed = yaml.safe_load((SPARK / "kustomization.yaml").read_text())
    return [*(BASE / name for name in _listed(BASE)),
            *(SPARK / name for name in listed["resources"] if name.endswith(".yaml"))]


def _listed(directory: Path) -> list[str]:
    return list(yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"])


def _render(directory: Path) -> list[Doc]:
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl:
        argv = [kubectl, "kustomize", str(directory)]
    elif kustomize:
        argv = [kustomize, "build", str(directory)]
    else:  # (the files themselves are validated one by one all the same)
        pytest.skip("neither kubectl nor kustomize is installed: the renders of the "
                    "kustomizations (what `kubectl apply -k` applies) are not checked")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def base() -> list[Doc]:
    return _render(BASE)


@pytest.fixture(scope="module")
def cluster() -> list[Doc]:
    return _render(SPARK)


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _pod(doc: Doc) -> Doc:
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"]["spec"])


def _workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "CronJob")]


def _env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def _hardelete_containers(docs: list[Doc]) -> list[Doc]:
    """The containers that run the hardelete CLI (the image's entrypoint, given args)."""
    return [c for d in _workloads(docs) for c in _pod(d)["containers"] if "args" in c]


def _problems(doc: Doc) -> list[str]:
    out = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            out.append(f"{doc['kind']} {doc['metadata']['name']}: no schema in {version}")
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path)) or "(top)"
            out.append(f"{doc['kind']} {doc['metadata']['name']} ({version}): {where}: "
                       f"{exc.message}")
    return out


def test_every_manifest_and_each_rendering_validates_strictly(base: list[Doc],
                                                             cluster: list[Doc]) -> None:
    present = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(_listed(BASE)) == present
    problems = []
    for path in _files():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs, path
        problems += [f"{path.name}: {p}" for d in docs for p in _problems(d)]
    problems += [f"rendered {p}" for d in (*base, *cluster) for p in _problems(d)]
    assert not problems, "\n".join(problems)
    assert len(cluster) > len(base) >= 10


def test_the_validator_catches_a_broken_manifest() -> None:
    doc = yaml.safe_load((BASE / "reconciler.yaml").read_text())
    assert not _problems(doc)
    bad_type = yaml.safe_load(yaml.safe_dump(doc))
    bad_type["spec"]["jobTemplate"]["spec"]["template"]["spec"]["restartPolicy"] = 7
    assert "restartPolicy: 7 is not of type" in _problems(bad_type)[0]
    unknown = {**doc, "spec": {**doc["spec"], "schedul": "typo"}}
    assert "'schedul' was unexpected" in _problems(unknown)[0]
    assert "no schema" in _problems({**doc, "kind": "CronJobb"})[0]


def test_each_daemon_has_a_disruption_budget_that_keeps_one_running(base: list[Doc]) -> None:
    budgets = [d for d in base if d["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == len(DAEMONS)
    for name in DAEMONS:
        deployment = _one(base, "Deployment", name)
        pdb = _one(base, "PodDisruptionBudget", name)["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["selector"] == deployment["spec"]["selector"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items()
        replicas = deployment["spec"]["replicas"]
        assert replicas >= 2 and "minAvailable" not in pdb
        assert 1 <= pdb["maxUnavailable"] < replicas
        # a pod that is not ready (a tracker catching up) never blocks a node drain
        assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        # and the replicas are spread over nodes
        (spread,) = _pod(deployment)["topologySpreadConstraints"]
        assert spread["labelSelector"] == deployment["spec"]["selector"]


def test_every_secret_setting_comes_from_the_secret(base: list[Doc], cluster: list[Doc]) -> None:
    assert {"s3_access_key", "s3_secret_key", "upload_token_secret", "reaper_secret"} <= \
        set(SECRET_SETTINGS)
    names = {"HARDELETE_" + s.upper() for s in SECRET_SETTINGS}
    header = (BASE / "config.yaml").read_text().split("apiVersion:")[0]
    keys = set()
    for docs in (base, cluster):
        config = _one(docs, "ConfigMap", "hardelete")["data"]
        assert not names & set(config), "a secret setting in the ConfigMap"
        containers = _hardelete_containers(docs)
        assert len(containers) == 4  # tracker, reaper, reconciler, reconciler-health
        for c in containers:
            env = _env(c)
            for name in names:
                ref = env[name]["valueFrom"]["secretKeyRef"]
                assert ref["name"] == SECRET and not ref.get("optional"), (c["name"], name)
                keys.add(ref["key"])
        # nothing else in any container (the Spark cluster's too) spells a secret out
        for d in _workloads(docs):
            for c in _pod(d)["containers"]:
                assert not {e["name"] for e in c.get("env", []) if "value" in e} & names
    # the creation command in config.yaml's header names every key the workloads read
    assert keys == set(re.findall(r"--from-literal=([a-z0-9-]+)=", header))


def test_every_container_has_resources_and_meets_the_restricted_standard(
        base: list[Doc], cluster: list[Doc]) -> None:
    namespace = _one(base, "Namespace", "hardelete")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for d in _workloads(cluster):  # the base and the Spark cluster
        pod = _pod(d)
        assert pod["securityContext"]["runAsNonRoot"] is True, d["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        mounts = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in pod["containers"]:
            what = f"{d['metadata']['name']}/{c['name']}"
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], what
            assert _bytes(res["limits"]["memory"]) >= _bytes(res["requests"]["memory"]), what
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, what
            assert sc["capabilities"] == {"drop": ["ALL"]}, what
            assert sc["readOnlyRootFilesystem"] is True, what
            # Spark writes its scratch space and work directory under /tmp: an emptyDir
            if "spark" in what or c["name"] == "reconciler":
                assert {"name": "scratch", "mountPath": "/tmp"} in c["volumeMounts"], what
                assert "scratch" in mounts and c["workingDir"] == "/tmp", what


def _bytes(quantity: str) -> int:
    units = {"Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]]


def test_the_reconciler_is_a_cronjob_on_local_spark_and_no_cluster_runs(
        base: list[Doc], cluster: list[Doc]) -> None:
    def runs_spark(d: Doc) -> bool:
        return any("org.apache.spark.deploy" in " ".join(c.get("command", []))
                   for c in _pod(d)["containers"])

    assert not [d for d in _workloads(base) if runs_spark(d)]
    assert not any(d["kind"] == "Service" and "spark" in d["metadata"]["name"] for d in base)
    config = _one(base, "ConfigMap", "hardelete")["data"]
    assert "HARDELETE_SPARK_MASTER" not in config  # set where the pod is sized

    cron = _one(base, "CronJob", "reconciler")["spec"]
    assert cron["concurrencyPolicy"] == "Forbid" and cron["startingDeadlineSeconds"] >= 3600
    pod = _pod(_one(base, "CronJob", "reconciler"))
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["args"] == ["reconcile", "--all"]
    master = _env(c)["HARDELETE_SPARK_MASTER"]["value"]
    cores = re.fullmatch(r"local\[(\d+)\]", master)
    assert cores and int(cores.group(1)) == int(c["resources"]["requests"]["cpu"])
    # local mode's JVM heap is 2 GiB (reconciler/spark.py); the measured peak at 10^7 objects
    # with its Python workers and driver is 3.4 GiB (BENCHMARKS.md)
    assert _bytes(c["resources"]["limits"]["memory"]) >= 4 * 2**30

    # `hardelete health reconciler` runs from a CronJob of its own, with the same settings
    check = _one(base, "CronJob", "reconciler-health")["spec"]
    assert check["concurrencyPolicy"] == "Forbid"
    (h,) = _pod(_one(base, "CronJob", "reconciler-health"))["containers"]
    assert h["args"] == ["health", "reconciler"]
    assert h["envFrom"] == c["envFrom"] and set(_env(h)) == set(_env(c)) - {
        "HARDELETE_SPARK_MASTER"}
    for container in (c, h):
        env = {k: v.get("value", "x") for k, v in _env(container).items()
               if k.startswith("HARDELETE_")}
        s = load_settings(env={**config, **env})
        assert s.redis_url and s.s3_endpoint_url and s.kafka_bootstrap
    assert s.topic_replication_factor == 3 and s.metrics_port == 9108

    # the optional cluster: the CronJob's pod becomes the driver, submitting to its master
    rendered = _pod(_one(cluster, "CronJob", "reconciler"))["containers"][0]
    env = _env(rendered)
    svc = _one(cluster, "Service", "spark-master")
    url = f"spark://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:7077"
    assert env["HARDELETE_SPARK_MASTER"]["value"] == url
    assert env["SPARK_LOCAL_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    (worker,) = _pod(_one(cluster, "Deployment", "spark-worker"))["containers"]
    assert worker["command"][-1] == url and "org.apache.spark.deploy.worker.Worker" in \
        worker["command"]
    assert worker["command"][worker["command"].index("--work-dir") + 1].startswith("/tmp/")
