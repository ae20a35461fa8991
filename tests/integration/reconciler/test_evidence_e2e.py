"""Evidence, end to end (MinIO + Redis + the tracker's apply script + local Spark): each input of
the mark is read strictly or the run stops; the keep-set carries its proof and a mark without
one is never swept (reconciler/evidence.py)."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.clients import split_s3_uri
from reconciler.job import RunOptions, reconcile
from reconciler.s3io import Namespace
from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.worlds import BUCKET, World, boundary, call, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def _committed_world(w: World, ns: str, n: int = 4) -> Any:
    call(w, M.create_repository, "r", ns, default_retention_days=1.0)
    for i in range(n):
        call(w, M.write, "r", "main", f"p{i}", 10)
    head = call(w, M.commit, "r", "main").commit
    w.track(None)
    past_grace(w.settings)
    return head


def test_a_manifest_with_a_binary_address_column_protects_its_objects(
        spark, rsettings, s3, redis_client):
    """Parquet BYTE_ARRAY without the UTF8 annotation, as Go and Java writers store strings:
    before, ``str(b"data/x")`` protected the key ``b'data/x'`` and the commit's objects were
    swept as committed garbage, with no error."""
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/binary/r/"
    head = _committed_world(w, ns)
    cutoff = boundary()
    # only the manifest protects these objects (the tracker's committed records forgotten)
    redis_client.delete(*redis_client.keys(RepoKeys("r").address_prefix + "*"))
    bucket, key = split_s3_uri(head.manifest)
    rows = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read())) \
        .to_pydict()
    rows["address"] = [a[len(ns):].encode() for a in rows["address"]]  # relative, binary
    buf = io.BytesIO()
    pq.write_table(pa.table({**rows, "address": pa.array(rows["address"], pa.binary())}), buf)
    s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
    before = w.data("r")
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["success"], res["error"]
    assert res["mark"]["marked"] == 0, res["mark"]
    assert res["mark"]["categories"]["committed"]["count"] == len(before)
    assert w.data("r") == before
    proof = res["keepset"]
    assert proof["complete"] and {s["kind"] for s in proof["sources"]} == {
        "tracker_export", "manifests"}

    # a binary row that is not UTF-8 stops the run, naming the manifest
    rows["address"][0] = b"data/\xff"
    buf = io.BytesIO()
    pq.write_table(pa.table({**rows, "address": pa.array(rows["address"], pa.binary())}), buf)
    s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
    bad = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert not bad["success"] and "not UTF-8" in bad["error"] and key in bad["error"]
    assert bad["sweep"]["status"] == "not_run" and w.data("r") == before


def test_a_manifest_in_the_namespace_is_kept_with_its_commit(spark, rsettings, s3,
                                                             redis_client):
    """A retained commit needs its manifest: a service that writes manifests outside the
    reserved prefixes must not see them swept as leaks."""
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/mfloc/r/"
    head = _committed_world(w, ns, 2)
    bucket, key = split_s3_uri(head.manifest)
    moved = f"{ns}meta/{key.rsplit('/', 1)[-1]}"
    s3.copy_object(Bucket=bucket, Key=split_s3_uri(moved)[1],
                   CopySource={"Bucket": bucket, "Key": key})
    redis_client.hset(RepoKeys("r").commits, head.id,
                      redis_client.hget(RepoKeys("r").commits, head.id).replace(
                          head.manifest, moved))
    cutoff = boundary()
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["success"], res["error"]
    assert res["mark"]["categories"]["leaked"]["count"] == 0, res["mark"]
    assert s3.head_object(Bucket=bucket, Key=split_s3_uri(moved)[1])


def _lost_staged(w: World) -> str:
    """A staged object whose events never reached the tracker."""
    lost: str = call(w, M.write, "r", "main", "lost", 10).address
    w.applied = len(w.model.events)
    return lost


def _shared_export(s3: Any, location: str, meta: dict[str, Any], rows: list[str]) -> None:
    bucket, prefix = split_s3_uri(location)
    buf = io.BytesIO()
    pq.write_table(pa.table({"address": pa.array(rows, pa.string())}), buf)
    s3.put_object(Bucket=bucket, Key=prefix + "part-00000.parquet", Body=buf.getvalue())
    s3.put_object(Bucket=bucket, Key=prefix + "export.json", Body=orjson.dumps(meta))


@pytest.mark.parametrize("shape", ["format1", "format2"])
def test_an_export_that_names_no_repository_stops_the_run(spark, rsettings, s3, redis_client,
                                                          shape: str):
    """In a location several repositories share, an export that says nothing of whose it is was
    taken for any of them: another repository's rows fell outside the namespace and were
    dropped without a word, and this repository's staged object (events lost) was swept."""
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/shared/r/")
    call(w, M.create_repository, "q", f"s3://{BUCKET}/shared/q/")
    w.track(None)
    lost = _lost_staged(w)
    past_grace(rsettings)
    cutoff = boundary()
    location = f"s3://{BUCKET}/exports/shared/"
    meta: dict[str, Any] = {"format": 1, "exported_at": cutoff + 1}  # after the cutoff
    if shape == "format2":
        meta = {**meta, "format": 2, "namespace": f"s3://{BUCKET}/shared/q/",
                "files": [{"name": "part-00000.parquet", "rows": 1}]}
    _shared_export(s3, location, meta, [f"s3://{BUCKET}/shared/q/data/other"])
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True,
                                                 uncommitted_export=location))
    assert not res["success"], res.get("sweep")
    assert ("names no repository" if shape == "format2" else "format 1") in res["error"]
    assert res["sweep"]["status"] == "not_run"
    assert lost in w.data("r")


def test_an_export_older_than_the_cutoff_stops_the_run(spark, rsettings, s3, redis_client):
    """An export made before the cutoff cannot witness what was staged after it: an object
    staged since, older than the cutoff and whose events were lost, was swept as a leak."""
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/stale/r/")
    w.track(None)
    asyncio.run(w.svc.write_uncommitted_export("r"))
    boundary()  # the export is strictly older than what follows
    lost = _lost_staged(w)
    past_grace(rsettings)
    cutoff = boundary()
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True,
                                                 uncommitted_export="namespace"))
    assert not res["success"], res.get("sweep")
    assert "not after the run's cutoff" in res["error"], res["error"]
    assert lost in w.data("r")
    # exported again after the cutoff: the run goes on and keeps the staged object
    asyncio.run(w.svc.write_uncommitted_export("r"))
    ok = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True,
                                                uncommitted_export="namespace"))
    assert ok["success"], ok["error"]
    assert ok["mark"]["categories"]["uncommitted"]["count"] >= 1
    assert "service_export" in {s["kind"] for s in ok["keepset"]["sources"]}
    assert lost in w.data("r")


def test_a_mark_without_a_complete_keepset_proof_is_not_swept(spark, rsettings, s3,
                                                              redis_client):
    from reconciler.errors import SweepRefused
    from reconciler.report import read_summary, write_summary

    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/proof/r/")
    call(w, M.leak, "r", 10)
    w.track(None)
    past_grace(rsettings)
    dry = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=boundary()))
    assert dry["success"] and dry["mark"]["marked"] == 1, dry
    ns = Namespace(w.model.repository("r").storage_namespace)
    stored = read_summary(s3, ns, dry["run_id"])
    assert stored is not None and stored["keepset"]["complete"]
    before = w.data("r") | set(w.keys("r"))
    for broken in ({**stored["keepset"], "complete": False},
                   {**stored["keepset"], "sources": stored["keepset"]["sources"][:1]}, None):
        body = {**stored, "keepset": broken} if broken else \
            {k: v for k, v in stored.items() if k != "keepset"}
        write_summary(s3, ns, body)
        with pytest.raises(SweepRefused, match="keep-set proof"):
            reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"],
                                                   allow_large_sweep=True))
        assert w.data("r") | set(w.keys("r")) == before
    # the seal: a retained set or a fingerprint edited since the mark is refused
    from reconciler.s3io import get_json, put_json

    retained_key = stored["retention"]["retained_key"]
    retained = get_json(s3, ns.bucket, retained_key)
    for body, retained_body in (
            ({**stored, "retention": {**stored["retention"], "fingerprint": "x"}}, retained),
            (stored, {**retained, "manifests": [*retained["manifests"], ["b", "k"]]})):
        write_summary(s3, ns, body)
        put_json(s3, ns.bucket, retained_key, retained_body)
        with pytest.raises(SweepRefused, match="not the one the run wrote"):
            reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"],
                                                   allow_large_sweep=True))
        assert w.data("r") | set(w.keys("r")) >= before
    put_json(s3, ns.bucket, retained_key, retained)
    write_summary(s3, ns, stored)  # the proof restored: the mark is swept (the test can fail)
    ok = reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"],
                                                allow_large_sweep=True))
    assert ok["sweep"]["status"] == "done" and ok["sweep"]["confirmed"] == 1, ok["sweep"]
