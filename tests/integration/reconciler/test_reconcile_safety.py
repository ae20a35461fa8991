"""Safety II, end to end (MinIO + Redis + the tracker's apply script + local Spark): the sweep
re-validates what changed since the mark, grace binds the mark, the service's own export is a
second witness, addresses are compared in one canonical form, and a retired repository is
refused. (The blast-radius guard and the cross-check gate:
tests/integration/reconciler/test_reconcile.py.)"""

from __future__ import annotations

import asyncio
import csv
import io
from typing import Any
from urllib.parse import quote, quote_plus

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.clients import split_s3_uri
from core.errors import UserError
from reconciler.job import Run, RunOptions, reconcile
from reconciler.s3io import Namespace
from schemas.layout import NAMESPACES, REPOS, RETIRED, RepoKeys
from sim.model import Model as M
from sim.worlds import BUCKET, World, boundary, call, history, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def adversary(w: World, h: dict[str, Any]) -> None:
    """After the mark: a branch at C1, a tag at C2, and P3 copied (through a short-lived branch
    at C3) and committed on main."""
    c1, c2, c3, _ = h["commits"]
    call(w, M.create_branch, "r", "late", c1)
    call(w, M.create_tag, "r", "t", c2)
    call(w, M.create_branch, "r", "tmp", c3)
    call(w, M.copy, "r", "tmp", "p3", "main", "copied")
    call(w, M.commit, "r", "main")
    call(w, M.delete_branch, "r", "tmp")
    w.track(None)


def check_kept(w: World, h: dict[str, Any], res: dict[str, Any], data_before: set[str]) -> None:
    assert res["sweep"]["status"] == "done", res["sweep"]
    assert res["revalidation"]["retention_changed"]
    assert w.data("r") == data_before  # nothing of P1..P4 went
    assert res["sweep"]["confirmed"] == 0
    assert res["sweep"]["skipped_retained"] == 3  # P1 (branch), P2 (tag), P3 (new commit)


def test_branch_tag_and_commit_after_a_dry_run_mark_keep_their_data_in_sweep_only(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    h = history(w, f"s3://{BUCKET}/adv1/r/")
    cutoff = boundary()
    data_before = w.data("r")
    dry = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=cutoff))
    assert dry["success"], dry["error"]
    ns = w.model.repository("r").storage_namespace
    assert dry["mark"]["categories"]["committed_expired"]["count"] == 3
    assert dry["mark"]["marked"] == 3
    adversary(w, h)
    res = reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"],
                                                 allow_large_sweep=True))
    check_kept(w, h, res, data_before)
    samples = set(res["sweep"]["samples"]["skipped_retained"])
    assert samples == {a[len(ns):] for a in h["addrs"][:3]}


class Between(Run):
    """A mark and sweep run with something happening between its mark and its sweep."""

    def __init__(self, *args: Any, between: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.between = between

    def _do_sweep(self, lease_id: str, parts: list[str], lease: Any) -> None:
        self.between()
        super()._do_sweep(lease_id, parts, lease)


def test_branch_tag_and_commit_between_mark_and_sweep_of_one_run_keep_their_data(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    h = history(w, f"s3://{BUCKET}/adv2/r/")
    cutoff = boundary()
    data_before = w.data("r")
    job = Between(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True),
                  between=lambda: adversary(w, h))
    try:
        summary = job.run()  # the typed record; summary.json is its to_dict()
    finally:
        job.close()
    assert summary.success, summary.error
    assert summary.marked == 3
    check_kept(w, h, summary.to_dict(), data_before)
    # without anything in between, the same history's garbage goes (the test can fail)
    again = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                   allow_large_sweep=True))
    assert again["sweep"]["status"] == "done" and again["sweep"]["confirmed"] == 0


def test_unchanged_retention_inputs_sweep_the_mark(spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    h = history(w, f"s3://{BUCKET}/adv3/r/")
    cutoff = boundary()
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["sweep"]["status"] == "done", res["sweep"]
    assert not res["revalidation"]["retention_changed"]
    assert w.data("r") == {h["addrs"][3]}


def test_an_address_unreferenced_inside_the_grace_window_is_not_marked(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/grace/r/")
    gone = call(w, M.write, "r", "main", "g", 10).address
    keep = call(w, M.write, "r", "main", "k", 10).address
    w.track(None)
    # the object is older than the cutoff, and so is its upload's expiry (50 ms after the
    # apply: a cutoff at the next whole second kept g as issued when the apply came less than
    # that before it, tests/integration/sim/test_worlds.py) ...
    cutoff = boundary(w)
    call(w, M.delete, "r", "main", "g")  # ... but unreferenced only now
    w.track(None)
    hour = rsettings.replace(grace_seconds=3600.0)
    res = reconcile(spark, hour, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["success"], res["error"]
    assert res["mark"]["marked"] == 0
    # kept as young (its last reference ended inside the window) or, when its upload's expiry
    # is also less than the grace before the horizon, as issued: the one judgment names the
    # first protection it finds
    assert res["uncommitted"]["live_by_reason"] in ({"staged": 1, "young": 1},
                                                    {"staged": 1, "issued": 1})
    assert w.data("r") == {gone, keep}
    # the model's oracle knows the same rule (on the model's clock: a second after the delete)
    now = w.clock.now + 1.0
    assert gone not in w.model.reconciler_garbage([], repository="r", grace_seconds=3600.0,
                                                  horizon=now, now=now)
    assert gone in w.model.reconciler_garbage([], repository="r", grace_seconds=0.0,
                                              horizon=now, now=now)
    # once the grace window has passed (short grace), it goes
    past_grace(rsettings)
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True))
    assert res["sweep"]["status"] == "done" and res["sweep"]["confirmed"] == 1
    assert w.data("r") == {keep}


def test_a_staged_object_without_a_tracker_record_is_kept_through_the_service_export(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/svc/r/")
    keep = call(w, M.write, "r", "main", "k", 10).address
    w.track(None)
    # the service staged this one, but its events were lost (never reached the tracker)
    lost = call(w, M.write, "r", "main", "lost", 10).address
    w.applied = len(w.model.events)
    leak = call(w, M.leak, "r", 10).address
    past_grace(rsettings)
    cutoff = boundary()
    asyncio.run(w.svc.write_uncommitted_export("r"))  # after the cutoff: it witnesses all before
    ns = Namespace(w.model.repository("r").storage_namespace)

    # without the export: the staged object is a "leak" (the bug)
    blind = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=cutoff))
    assert blind["mark"]["categories"]["leaked"]["count"] == 2

    # with the service's export (in the namespace): kept, the true leak goes
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                 uncommitted_export="namespace",
                                                 allow_large_sweep=True))
    assert res["success"], res["error"]
    assert res["service_export"]["found"] and res["service_export"]["fresh"]
    assert res["mark"]["categories"]["leaked"]["count"] == 1
    assert res["sweep"]["confirmed"] == 1
    assert w.data("r") == {keep, lost}

    # fail-closed: leaks and unreferenced are withheld, whatever export there is
    leak2 = call(w, M.leak, "r", 10).address
    past_grace(rsettings)
    cutoff2 = boundary()
    redis_client.hset(RepoKeys("r").fail_closed, mapping={"reason": "redis went back in time"})
    held = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff2,
                                                  allow_large_sweep=True))
    assert held["success"], held["error"]
    assert held["fail_closed"]["withheld"] and "redis went back" in held["fail_closed"]["reason"]
    # the new leak, and the staged object whose events were lost (no export names it here)
    assert held["mark"]["categories"]["withheld"]["count"] == 2
    assert held["mark"]["marked"] == 0 and leak2 in w.data("r")
    # A fresh export does not vouch either: it lists the uncommitted side only, and a commit
    # lost in the gap would make its objects look leaked
    # (tests/integration/reconciler/test_failclosed_no_vouch.py).
    fresh = asyncio.run(w.svc.write_uncommitted_export("r"))
    still = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff2,
                                                   uncommitted_export=fresh,
                                                   allow_large_sweep=True))
    assert still["success"] and still["fail_closed"]["fresh_export"]
    assert still["fail_closed"]["withheld"] and still["mark"]["marked"] == 0
    assert leak2 in w.data("r")
    # once the mirror is trusted again, the leak goes
    redis_client.delete(RepoKeys("r").fail_closed)
    ok = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff2,
                                                uncommitted_export=fresh,
                                                allow_large_sweep=True))
    assert ok["success"] and "fail_closed" not in ok
    assert ok["sweep"]["confirmed"] == 1 and w.data("r") == {keep, lost}
    assert leak not in w.data("r") and ns.uri


def _rewrite_manifest(s3: Any, uri: str, rewrite: Any) -> None:
    bucket, key = split_s3_uri(uri)
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
    rows = table.to_pydict()
    rows["address"] = [rewrite(i, a) for i, a in enumerate(rows["address"])]
    buf = io.BytesIO()
    pq.write_table(pa.table(rows), buf)
    s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def test_non_canonical_manifest_rows_protect_their_objects_and_a_foreign_row_fails_the_mark(
        spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/canon/r/"
    call(w, M.create_repository, "r", ns, default_retention_days=1.0)
    for i in range(5):
        call(w, M.write, "r", "main", f"p{i}", 10)
    head = call(w, M.commit, "r", "main").commit
    w.track(None)
    past_grace(rsettings)
    cutoff = boundary()
    # forget the tracker's committed records: only the manifest protects these objects
    redis_client.delete(*redis_client.keys(RepoKeys("r").address_prefix + "*"))
    forms = [
        lambda a: "s3a://" + a[len("s3://"):],
        lambda a: "S3://" + BUCKET.upper() + "/" + a[len("s3://" + BUCKET + "/"):],
        lambda a: ns + quote(a[len(ns):], safe=""),  # percent escapes, '/' included
        lambda a: a[len(ns):],  # namespace-relative
        lambda a: a,
    ]
    _rewrite_manifest(s3, head.manifest, lambda i, a: forms[i](a))
    data_before = w.data("r")
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff))
    assert res["success"], res["error"]
    assert res["mark"]["marked"] == 0
    assert res["mark"]["categories"]["committed"]["count"] == 5
    assert w.data("r") == data_before

    _rewrite_manifest(s3, head.manifest,
                      lambda i, a: "s3://another-bucket/x" if i == 0 else a)
    bad = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff))
    assert not bad["success"] and "another-bucket" in bad["error"]
    assert bad["sweep"]["status"] == "not_run" and w.data("r") == data_before


def test_url_encoded_inventory_csv_keys_compare_decoded(spark, rsettings, s3, redis_client,
                                                        tmp_path):
    w = make(rsettings, s3, redis_client)
    ns = f"s3://{BUCKET}/inv/r/"
    call(w, M.create_repository, "r", ns)
    call(w, M.write, "r", "main", "p", 10)
    head = call(w, M.commit, "r", "main").commit
    w.track(None)
    bucket, prefix = split_s3_uri(ns)
    live_key = prefix + "data/s/a b+c%d.txt"  # committed (its manifest lists it)
    dead_key = prefix + "data/s/x y+z.txt"  # leaked
    for k in (live_key, dead_key):
        s3.put_object(Bucket=bucket, Key=k, Body=b"x")
    table = pq.read_table(io.BytesIO(s3.get_object(
        Bucket=bucket, Key=split_s3_uri(head.manifest)[1])["Body"].read())).to_pydict()
    table["address"].append(f"s3://{bucket}/{live_key}")
    for col in ("path", "ref_id"):
        table[col].append("extra")
    table["size"].append(1)
    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf)
    s3.put_object(Bucket=bucket, Key=split_s3_uri(head.manifest)[1], Body=buf.getvalue())
    past_grace(rsettings)
    cutoff = boundary()

    with open(tmp_path / "inventory.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["bucket", "key", "size", "last_modified"])
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", ()):
                out.writerow([bucket, quote_plus(o["Key"], safe="/"), o["Size"],
                              o["LastModified"].isoformat()])
    listed = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=cutoff))
    inv = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff, allow_large_sweep=True,
                                                 inventory=str(tmp_path)))
    assert inv["success"], inv["error"]
    cats = {c: v["count"] for c, v in inv["mark"]["categories"].items() if v["count"]}
    want = {c: v["count"] for c, v in listed["mark"]["categories"].items() if v["count"]}
    cats.pop("reserved", None)
    want.pop("reserved", None)
    assert cats == want == {"committed": 2, "leaked": 1}
    assert inv["sweep"]["confirmed"] == 1
    left = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "data/s/")
            .get("Contents", ())}
    assert left == {live_key}


def test_a_retired_or_foreign_repository_is_refused(spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/ret/r/")
    w.track(None)
    redis_client.hset(NAMESPACES, f"s3://{BUCKET}/ret/r/", "someone-else")
    with pytest.raises(UserError, match="not registered to repository 'r'"):
        reconcile(spark, rsettings, RunOptions("r", dry_run=True))
    redis_client.hset(NAMESPACES, f"s3://{BUCKET}/ret/r/", "r")
    redis_client.hset(RETIRED, "r", "{}")
    with pytest.raises(UserError, match="retired"):
        reconcile(spark, rsettings, RunOptions("r", dry_run=True))
    redis_client.hdel(RETIRED, "r")
    redis_client.srem(REPOS, "r")
    with pytest.raises(UserError, match="not a live repository"):
        reconcile(spark, rsettings, RunOptions("r", dry_run=True))


class DuringSweep(Run):
    """Something happens after the sweep's re-validation, before its first delete."""

    def __init__(self, *args: Any, during: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.during = during

    def _sweep(self, lease_id: str, parts: list[str], lease: Any,
               delete: bool = True) -> Any:
        if delete:
            self.during()
        return super()._sweep(lease_id, parts, lease, delete)


def test_a_branch_created_during_the_sweep_stops_it(spark, rsettings, s3, redis_client):
    w = make(rsettings, s3, redis_client)
    h = history(w, f"s3://{BUCKET}/adv4/r/")
    cutoff = boundary()
    data_before = w.data("r")

    def during() -> None:
        call(w, M.create_branch, "r", "late", h["commits"][0])
        w.track(None)

    job = DuringSweep(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                   allow_large_sweep=True), during=during)
    try:
        res = job.run()
    finally:
        job.close()
    assert res.sweep is not None and res.sweep.status == "failed"
    assert "changed during the sweep" in (res.sweep.error or "")
    assert w.data("r") == data_before
    # stopped before its first request: it reports what it confirmed, nothing
    assert res.sweep.stats is not None and res.sweep.stats.confirmed == 0
    # sweeping the same mark again re-validates it: P1 (the new branch's) is kept
    again = reconcile(spark, rsettings, RunOptions("r", sweep_only=res.run_id,
                                                   allow_large_sweep=True))
    assert again["sweep"]["status"] == "done", again["sweep"]
    assert again["sweep"]["skipped_retained"] == 1 and again["sweep"]["confirmed"] == 2
    assert w.data("r") == {h["addrs"][0], h["addrs"][3]}


@pytest.mark.parametrize("hash_, raw, says", [
    ("commits", "{not json", "commit 'c9': record is not JSON"),
    ("commits", '{"parents": ["c1"]}', "commit 'c9': bad or missing time"),
    ("branches", '["main"]', "branch 'c9': record is not an object"),
    ("branches", '{"head": "c1"}', "branch 'c9': missing staging_token"),
])
def test_a_garbled_tracker_record_fails_the_load_naming_it(redis_client, hash_, raw, says):
    """The reconciler reads the tracker's records through the one codec (schemas.records): a
    record it cannot read fails the run (doubt keeps), never silently protects nothing."""
    from reconciler.errors import ReconcileError
    from reconciler.state import load_repo

    k = RepoKeys("garbled")
    redis_client.hset(k.meta, mapping={"namespace": "s3://b/garbled/",
                                       "default_retention_days": "7"})
    redis_client.hset(getattr(k, hash_), "c9", raw)
    with pytest.raises(ReconcileError, match=says.replace("[", r"\[")):
        load_repo(redis_client, "garbled")


def test_a_named_export_that_is_not_an_export_refuses_the_run_and_deletes_nothing(
        spark, rsettings, s3, redis_client, tmp_path):
    w = make(rsettings, s3, redis_client)
    call(w, M.create_repository, "r", f"s3://{BUCKET}/svc/r/")
    w.track(None)
    # the service staged this one, but its events were lost (never reached the tracker)
    lost = call(w, M.write, "r", "main", "lost", 10).address
    w.applied = len(w.model.events)
    past_grace(rsettings)
    cutoff = boundary()
    # the operator names a file of addresses, not an export (no export.json): before, the run
    # went on without the witness and swept the staged object as a leak
    not_an_export = tmp_path / "uncommitted.csv"
    not_an_export.write_text(f"address\n{lost}\n")
    res = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff,
                                                 uncommitted_export=str(not_an_export)))
    assert not res["success"] and "no export.json" in res["error"], res.get("error")
    assert res["sweep"]["status"] == "not_run"
    assert lost in w.data("r")


@pytest.mark.parametrize("shift", [-1, 1], ids=["older", "newer"])
def test_a_mark_of_another_report_format_is_not_swept(spark, rsettings, s3, redis_client,
                                                      shift: int) -> None:
    """--sweep-only judges a mark again with the rules of the version that reads it: a mark of
    an older format lacks what re-validation needs, one of a newer format may hold what this
    version cannot judge. Both are refused; nothing is deleted."""
    from reconciler.errors import SweepRefused
    from reconciler.report import REPORT_FORMAT, read_summary, write_summary

    w = make(rsettings, s3, redis_client)
    history(w, f"s3://{BUCKET}/fmt/r/")
    data_before = w.data("r")
    dry = reconcile(spark, rsettings, RunOptions("r", dry_run=True, cutoff_ms=boundary()))
    assert dry["success"] and dry["mark"]["marked"] == 3, dry
    ns = Namespace(w.model.repository("r").storage_namespace)
    stored = read_summary(s3, ns, dry["run_id"])
    assert stored is not None
    write_summary(s3, ns, {**stored, "format": REPORT_FORMAT + shift})
    with pytest.raises(SweepRefused, match="older" if shift < 0 else "newer"):
        reconcile(spark, rsettings, RunOptions("r", sweep_only=dry["run_id"],
                                               allow_large_sweep=True))
    assert w.data("r") == data_before
