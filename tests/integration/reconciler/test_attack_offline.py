"""Adversarial review of the offline delete path (MinIO + Redis + the tracker's apply script +
local Spark). Each test asserts the SAFE outcome: it fails while the hole it names is open."""

from __future__ import annotations

import io
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reconciler.job import RunOptions, reconcile
from reconciler.s3io import Namespace, get_json, put_json, put_parquet
from sim.model import Model as M
from sim.worlds import BUCKET, DAY, boundary, call, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def test_delete_expired_refs_keeps_the_data_of_the_default_branch_head(
        spark, rsettings, s3, redis_client):
    """main's head is ten days old; `--expire-older-than-days 7 --delete-expired-refs` drops
    main from retention (the service still serves it: its refs are not touched) and its one
    object is swept as committed_expired. SPEC: branch heads are never expired (rule 1, a
    retained commit); Icechunk never deletes main either."""
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/atk-head/r/"
    call(w, M.create_repository, "r", ns, default_retention_days=1.0)
    addr = call(w, M.write, "r", "main", "p", 10).address
    call(w, M.commit, "r", "main", at=time.time() - 10 * DAY)
    w.track(None)
    past_grace(w.settings)
    cutoff = boundary()
    assert addr in w.data("r")
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                 expire_older_than_days=7.0,
                                                 delete_expired_refs=True))
    assert res["success"], res["error"]
    assert addr in w.data("r"), ("main's head object was deleted", res["mark"]["categories"])


def test_sweep_only_sweeps_nothing_its_mark_did_not_write(spark, rsettings, s3, redis_client):
    """A dry-run mark keeps a committed object; a part is added under the run's mark/ and named
    in its summary.json (a doctored or mixed-up report). `--sweep-only` trusts summary and parts
    unread: retention is unchanged (same fingerprint), the gate lets a committed record through
    ("retention decides"), and the object of main's head is deleted. SPEC rules 1 and 12 (an
    earlier summary is evidence, read by a strict reader that proves it)."""
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/atk-parts/r/"
    call(w, M.create_repository, "r", ns, default_retention_days=1.0)
    addr = call(w, M.write, "r", "main", "p", 10).address
    call(w, M.commit, "r", "main")
    w.track(None)
    past_grace(w.settings)
    cutoff = boundary()
    dry = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=cutoff))
    assert dry["success"], dry["error"]
    assert dry["mark"]["marked"] == 0
    rel = addr[len(ns):]
    digest = None
    for part in dry["uncommitted"]["part_keys"]:
        body = s3.get_object(Bucket=BUCKET, Key=part)["Body"].read()
        rows = pq.read_table(io.BytesIO(body)).to_pydict()
        for key, d in zip(rows["key"], rows["digest"], strict=True):
            if key == rel:
                digest = d
    assert digest is not None  # the tracker's committed record, as the mark saw it
    nso = Namespace(ns)
    forged = nso.report_prefix(dry["run_id"]) + "mark/part-99999-0-000-forged.parquet"
    put_parquet(s3, BUCKET, forged,
                {"key": [rel], "size": [10], "last_modified": [cutoff - 1000],
                 "category": ["committed_expired"], "digest": [digest]},
                schema=pa.schema([("key", pa.string()), ("size", pa.int64()),
                                  ("last_modified", pa.int64()), ("category", pa.string()),
                                  ("digest", pa.string())]))
    skey = nso.report_prefix(dry["run_id"]) + "summary.json"
    summary = get_json(s3, BUCKET, skey)
    summary["mark"]["parts"] = [*summary["mark"]["parts"], forged]
    put_json(s3, BUCKET, skey, summary)
    from reconciler.errors import SweepRefused

    # the mark's seal (in the tracker's Redis, written with the mark) no longer matches
    with pytest.raises(SweepRefused, match="not the one the run wrote"):
        reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"]))
    assert addr in w.data("r")
    # the report as the run wrote it is swept (nothing marked: nothing deleted)
    summary["mark"]["parts"] = summary["mark"]["parts"][:-1]
    put_json(s3, BUCKET, skey, summary)
    ok = reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"]))
    assert ok["sweep"]["status"] == "done" and ok["sweep"]["confirmed"] == 0, ok["sweep"]
    assert addr in w.data("r")
