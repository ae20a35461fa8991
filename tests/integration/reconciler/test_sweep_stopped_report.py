"""A sweep that stops part-way reports the deletes it confirmed, all of them (SPEC safety 6).

The sweep's tasks delete in batches of at most 1,000 keys; one that finds the lease lost (or the
refs moved) at its next batch stops. Before, the task's exception failed the Spark job and the
run's summary said ``failed`` with no counts at all, though the store had confirmed the deletes
of the batches before it (and a task Spark killed meanwhile could lose its outcome rows).

Real stack: MinIO behind the fault proxy (the first ``DeleteObjects`` is held while the lease is
taken away, then let through), Redis with the tracker's apply script, local Spark.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hardelete.reports import run_rows
from reconciler.job import RunOptions, reconcile
from reconciler.metrics import figures
from reconciler.report import read_summary
from reconciler.s3io import Namespace, list_keys, read_parquet_rows
from reconciler.sweep import BATCHES_IN_FLIGHT, CONFIRMED, written_outcomes
from schemas.layout import RECONCILER_LEASE
from sim.faultproxy import FaultProxy
from sim.model import Model as M
from sim.worlds import BUCKET, boundary, call, make

pytestmark = [pytest.mark.spark]

# More than four full batches: two tasks, each with two batches in flight
# (reconciler.sweep.BATCHES_IN_FLIGHT), have at most four requests (<= 4,000 keys) in flight
# when the lease goes, so some batch always comes after it, whatever the mark's parts.
LEAKED = 2 * BATCHES_IN_FLIGHT * 1_000 + 500


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def _leak(s3: Any, ns: Namespace, n: int) -> dict[str, int]:
    """``n`` objects the tracker never heard of (``leaked``), of sizes 1..7: rel -> size."""
    sizes = {f"data/leak/obj-{i:05d}": i % 7 + 1 for i in range(n)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket=ns.bucket, Key=ns.key(kv[0]),
                                               Body=b"x" * kv[1]), sizes.items()))
    return sizes


def _rows(s3: Any, ns: Namespace, prefix: str) -> list[tuple[Any, ...]]:
    return [row for key in list_keys(s3, ns.bucket, prefix) if key.endswith(".parquet")
            for row in read_parquet_rows(s3, ns.bucket, key,
                                         ["key", "size", "outcome", "error"])]


def test_a_sweep_stopped_by_a_lost_lease_reports_exactly_the_deletes_it_confirmed(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    ns = Namespace(f"s3://{BUCKET}/stopped/r/")
    call(w, M.create_repository, "r", ns.uri)
    w.track(None)
    sizes = _leak(s3, ns, LEAKED)
    cutoff = boundary()
    before = w.data("r")
    assert len(before) == LEAKED

    with FaultProxy(rsettings.s3_endpoint_url) as proxy:
        hold = threading.Event()
        proxy.faults.hold_deletes = hold
        errors: list[BaseException] = []

        def take_the_lease() -> None:
            # Another reconciler's lease while the first request is in flight: that request
            # (and any other already sent) is answered, every later one is stopped.
            try:
                assert proxy.faults.deletes_waiting.wait(120), "no delete request came"
                redis_client.set(RECONCILER_LEASE + "r", "another-run")
            except BaseException as exc:
                errors.append(exc)
            finally:
                hold.set()

        t = threading.Thread(target=take_the_lease, daemon=True)
        t.start()
        via = rsettings.replace(s3_endpoint_url=proxy.url)
        res = reconcile(spark, via, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
        t.join(60)
        assert not errors, errors
    assert res["mark"]["marked"] == LEAKED, res["mark"]
    sweep = res["sweep"]
    assert sweep["status"] == "failed", sweep
    assert "lease lost" in sweep["error"], sweep["error"]
    gone = {a[len(ns.uri):] for a in before - w.data("r")}
    assert 0 < len(gone) < LEAKED  # stopped part-way, after confirmed deletes
    # the report counts exactly what the store confirmed: what is gone from MinIO
    assert sweep.get("confirmed") == len(gone), sweep
    assert sweep["confirmed_bytes"] == sum(sizes[k] for k in gone)
    assert sweep["failed"] == 0
    # the per-key rows say the same, key by key
    prefix = ns.report_prefix(res["run_id"]) + "sweep/"
    rows = _rows(s3, ns, prefix)
    assert {row[0] for row in rows if row[2] == CONFIRMED} == gone
    # had a task died, the driver would have counted these rows: the same figures
    (token,) = {k[len(prefix):].split("-")[2] for k in list_keys(s3, ns.bucket, prefix)}
    back = written_outcomes(rsettings, ns, prefix, token).as_dict()
    assert back.pop("requests") == 0  # (no row holds it)
    assert back == {k: sweep[k] for k in back}
    # stored, shown by `hardelete reports` and in the metrics
    stored = read_summary(s3, ns, res["run_id"])
    assert stored is not None and stored["sweep"]["confirmed"] == len(gone)
    (row,) = run_rows(redis_client, s3, "r", 1)
    assert row["sweep"] == "failed" and row["confirmed"] == len(gone)
    assert row["confirmed_bytes"] == sweep["confirmed_bytes"]
    f = figures(stored)
    assert f["deleted_objects"] == len(gone) and f["success"] == 0.0
