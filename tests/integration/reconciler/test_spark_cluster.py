"""The reconciler on a real Spark cluster: a standalone master and two workers from the pyspark
distribution on loopback, each worker with its own work directory, and ``hardelete reconcile``
run as its own driver process against ``spark://127.0.0.1:PORT`` (the suite's shared local
session is not touched). The run's metrics go to a textfile and to a Pushgateway-compatible
HTTP endpoint; ``hardelete reports`` reads the run back."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from sim.model import Model, ModelService
from sim.stack import free_port
from sim.worlds import World, boundary

pytestmark = [pytest.mark.spark]

SPARK_CLASS = Path(sys.executable).parent / "spark-class"


def _wait(cond: Any, timeout: float, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode} while {what}"
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.2)


def _alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as resp:
            return int(json.load(resp).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not SPARK_CLASS.exists():
        pytest.fail(f"{SPARK_CLASS} missing: pyspark ships spark-class")
    wd = tmp_path_factory.mktemp("spark-cluster")
    port, ui = free_port(), free_port()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable, "SPARK_LOG_DIR": str(wd)}
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        log = (wd / f"{name}.log").open("wb")
        procs.append(subprocess.Popen([str(SPARK_CLASS), *args], env=env, cwd=wd, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
              "--port", str(port), "--webui-port", str(ui))
        _wait(lambda: _ui_up(ui), 120, "the master starts", procs)
        for i in (1, 2):
            work = wd / f"worker{i}"
            work.mkdir()
            start(f"worker{i}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                  "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()),
                  "--work-dir", str(work), f"spark://127.0.0.1:{port}")
        _wait(lambda: _alive_workers(ui) == 2, 120, "two workers register", procs)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _ui_up(ui: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2).close()
        return True
    except OSError:
        return False


class _Gateway(http.server.BaseHTTPRequestHandler):
    """Receives what the reconciler pushes (the Pushgateway protocol: PUT /metrics/job/NAME)."""

    received: list[tuple[str, str, bytes]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(("PUT", self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        return


@pytest.mark.slow
def test_reconcile_on_a_standalone_cluster(spark_cluster, settings, s3, redis_client,
                                           tmp_path: Path) -> None:
    clock_start = time.time() - 3600
    model = Model(clock=lambda: clock_start, upload_secret=settings.upload_token_secret)
    w = World(settings, s3, redis_client, None, model,  # type: ignore[arg-type]
              ModelService(settings, s3, None, model=model))  # type: ignore[arg-type]
    w.run([(Model.create_repository, ("sc", "s3://clusterb/ns/")),
           (Model.write, ("sc", "main", "a", 3)), (Model.write, ("sc", "main", "b", 3)),
           (Model.leak, ("sc", 5)), (Model.leak, ("sc", 5))])
    w.track(None)
    before = w.data("sc")
    live = {model.lookup("sc", "main", p).address for p in ("a", "b")}
    assert len(before) == 4 and live <= before
    cutoff = boundary() // 1000

    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    textfile = tmp_path / "hardelete_reconcile.prom"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARDELETE_")}
    env.update({
        "HARDELETE_REDIS_URL": settings.redis_url,
        "HARDELETE_S3_ENDPOINT_URL": settings.s3_endpoint_url,
        "HARDELETE_SPARK_MASTER": spark_cluster,
        "HARDELETE_RECONCILE_MIN_AGE_SECONDS": "0",
        "HARDELETE_SPARK_SHUFFLE_PARTITIONS": "4",  # a tiny namespace: not 200 empty tasks
        "HARDELETE_METRICS_TEXTFILE": str(textfile),
        "HARDELETE_PUSHGATEWAY_URL": f"http://127.0.0.1:{gateway.server_address[1]}",
        "HARDELETE_LOG_LEVEL": "error",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",  # the executors connect back to the driver on loopback
    })
    driver_dir = tmp_path / "driver"  # the driver's cwd shares nothing with the executors'
    driver_dir.mkdir()
    try:
        proc = subprocess.run([sys.executable, "-m", "hardelete.cli", "reconcile", "--repo", "sc",
                               "--json", "--cutoff", str(cutoff)], env=env, cwd=driver_dir,
                              capture_output=True, text=True, timeout=300)
    finally:
        gateway.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = orjson.loads(proc.stdout)
    assert summary["success"] and summary["sweep"]["status"] == "done"
    assert summary["mark"]["categories"]["leaked"]["count"] == 2
    assert summary["sweep"]["confirmed"] == 2
    assert w.data("sc") == live  # the leaks went, the live objects stayed

    # the same figures in the summary, the textfile and the push
    m = summary["metrics"]
    assert m["deleted_objects"] == 2 and m["success"] == 1 and m["category_objects"]["leaked"] == 2
    text = textfile.read_text()
    assert 'hardelete_reconcile_deleted_objects{repository="sc"} 2.0' in text
    assert 'hardelete_reconcile_category_objects{category="leaked",repository="sc"} 2.0' in text
    ((method, path, body),) = _Gateway.received
    assert method == "PUT" and path == "/metrics/job/hardelete_reconciler"
    assert b'hardelete_reconcile_success{repository="sc"} 1.0' in body

    # the run is in the reports, with the metrics stored in its summary.json
    env.pop("HARDELETE_SPARK_MASTER")
    rows = orjson.loads(subprocess.run(
        [sys.executable, "-m", "hardelete.cli", "reports", "list", "--repo", "sc", "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert [(r["run_id"], r["confirmed"], r["success"]) for r in rows] == [
        (summary["run_id"], 2, True)]
    shown = subprocess.run(
        [sys.executable, "-m", "hardelete.cli", "reports", "show", summary["run_id"], "--json"],
        env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    assert orjson.loads(shown)["metrics"]["deleted_objects"] == 2
    table = subprocess.run(
        [sys.executable, "-m", "hardelete.cli", "reports", "list"], env=env,
        capture_output=True, text=True, timeout=60, check=True).stdout
    assert summary["run_id"] in table
    missing = subprocess.run(
        [sys.executable, "-m", "hardelete.cli", "reports", "show", "nope"], env=env,
        capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no report of run 'nope'" in missing.stderr
