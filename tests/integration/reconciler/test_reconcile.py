"""End to end: the model service writes real objects and manifests to the S3 server, its events
go through the tracker's own apply script into the real Redis, and the reconciler runs on the
session's local Spark. Checked against the model's ground truth."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from core.clients import split_s3_uri
from core.errors import UserError
from reconciler.errors import LeaseBusy, SweepRefused
from reconciler.job import RunOptions, reconcile
from reconciler.report import read_summary
from reconciler.retention import RetentionPolicy, retained_commits
from reconciler.s3io import Namespace
from schemas.layout import PROGRESS, RECONCILER_LEASE, RepoKeys
from sim.model import Model, ModelService, Workload, seeded_ids
from sim.worlds import BUCKET, Clock, World, boundary, make_world, past_grace

pytestmark = [pytest.mark.spark]


def expected_garbage(w: World, repo: str, now_ms: int, objects: set[str],
                     horizon_ms: int | None = None) -> set[str]:
    """The model's reconciler garbage, with retention computed at the run's clock and the
    grace window measured against ``horizon_ms`` (default: the run's clock)."""
    m = w.model
    rep = m.repository(repo)
    graph = m.commit_graph(repo)
    heads = {b: br.head for b, br in rep.branches.items() if br.head}
    policy = RetentionPolicy(rep.default_retention_days, rep.branch_retention_days)
    retained = retained_commits(graph, heads, dict(rep.tags), policy, now_ms / 1000)
    garbage = m.reconciler_garbage(retained, repository=repo, now=w.clock.now,
                                   grace_seconds=w.settings.grace_for(repo),
                                   horizon=(now_ms if horizon_ms is None else horizon_ms) / 1000)
    return set(garbage) & objects


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def workload_world(rsettings, s3, redis_client, ops1=160, ops2=40):
    w = make_world(rsettings, s3, redis_client)
    wl = Workload(seed=11, ops=ops1, span_days=30, retention_days=7, bucket=BUCKET, name="e2e",
                  branches=3, paths=25)
    repo = wl.repo_ids()[0]
    w.run(wl)
    w.track(int(w.clock.now * 1000))  # the tracker applied these two hours ago
    old = w.data(repo)
    cutoff = boundary()
    # newer than the cutoff: more of everything, on the real clock
    w.clock.now = time.time()
    w.run(Workload(seed=12, ops=ops2, bucket=BUCKET, name="e2e", branches=3, paths=25))
    w.track(None)
    past_grace(rsettings, repo)
    return w, repo, old, cutoff


async def _stack_phase(settings: Any, svc: ModelService, wl: Workload) -> None:
    """Publish a workload through the real broker and let the real tracker apply it."""
    from schemas.publisher import Publisher, ensure_topics
    from tracker.daemon import Tracker

    await ensure_topics(settings)
    async with Publisher(settings) as pub:
        svc.publisher = pub
        await svc.run_workload(wl)
    svc.publisher = None
    await Tracker(settings).run_until_caught_up(timeout=60)


async def _reconcile_with_tracker(spark: Any, settings: Any, opts: RunOptions) -> Any:
    """A reconcile while the tracker daemon keeps running (its progress moves on), once the
    tracker horizon is past the grace window of everything applied so far."""
    import redis.asyncio as aredis

    from core.clock import await_horizon
    from tracker.daemon import running_tracker

    async with running_tracker(settings):
        r = aredis.Redis.from_url(settings.redis_url, decode_responses=True)
        try:
            sec, usec = await r.time()
            target = int(sec) * 1000 + int(usec) // 1000 + int(settings.grace_for(opts.repo)
                                                               * 1000)
            await await_horizon(r, target, timeout=60)
        finally:
            await r.aclose()
        return await asyncio.to_thread(reconcile, spark, settings, opts)


@pytest.mark.slow
def test_one_run_deletes_exactly_the_model_garbage_older_than_the_cutoff(
        spark, rsettings, s3, redis_client):
    """On the real stack: the model service publishes through Kafka, the tracker daemon fills
    Redis, the reconciler runs on local Spark against MinIO."""
    clock = Clock(time.time() - 2 * 3600)
    # upload tokens expire in 50 ms: unlinked uploads are long expired at the cutoff
    model = Model(clock=clock, upload_ttl_seconds=0.05, new_id=seeded_ids(5),
                  upload_secret=rsettings.upload_token_secret)
    svc = ModelService(rsettings, s3, None, model=model)
    w = World(rsettings, s3, redis_client, clock, model, svc)
    wl = Workload(seed=11, ops=160, span_days=30, retention_days=7, bucket=BUCKET, name="e2e",
                  branches=3, paths=25)
    repo = wl.repo_ids()[0]
    asyncio.run(_stack_phase(rsettings, svc, wl))
    old = w.data(repo)
    cutoff = boundary()
    clock.now = time.time()  # newer than the cutoff: more of everything
    asyncio.run(_stack_phase(rsettings, svc, Workload(seed=12, ops=40, bucket=BUCKET,
                                                      name="e2e", branches=3, paths=25)))
    truth = model.truth(now=clock.now)
    before = w.keys(repo)
    data_before = w.data(repo)
    assert truth.leaked and truth.online_garbage and truth.superseded | truth.committed

    dry = asyncio.run(_reconcile_with_tracker(spark, rsettings,
                                              RunOptions(repo, dry_run=True, cutoff_ms=cutoff)))
    assert dry["success"], dry["error"]
    assert dry["sweep"]["status"] == "not_run"
    assert before <= w.keys(repo)  # a dry run deletes nothing (it only adds its report)
    expected = expected_garbage(w, repo, dry["now_ms"], old)
    assert dry["mark"]["marked"] == len(expected)
    cats = dry["mark"]["categories"]
    assert cats["leaked"]["count"] >= 1 and cats["expired_upload"]["count"] >= 1
    assert cats["committed_expired"]["count"] >= 1 and cats["recent"]["count"] >= 1
    assert cats["unreferenced"]["count"] >= 1
    assert dry["crosscheck"]["marked_but_referenced_online"]["count"] == 0
    assert dry["crosscheck"]["committed_missing_from_store"]["count"] == 0

    run = asyncio.run(_reconcile_with_tracker(spark, rsettings,
                                              RunOptions(repo, cutoff_ms=cutoff)))
    assert run["success"], run["error"]
    assert run["sweep"]["status"] == "done", run["sweep"]
    deleted = data_before - w.data(repo)
    assert deleted == expected_garbage(w, repo, run["now_ms"], old)
    assert run["sweep"]["confirmed"] == len(deleted) == run["mark"]["marked"]
    assert run["sweep"]["failed"] == run["sweep"]["refused"] == 0
    # the same counts as the dry run, category by category
    assert run["mark"]["categories"] == dry["mark"]["categories"]
    # nothing newer than the cutoff, nothing live, no metadata went
    assert not deleted & (data_before - old)
    assert not deleted & (truth.live_referenced | truth.issued_unexpired)
    ns = model.repository(repo).storage_namespace
    assert {k for k in before if k.startswith(ns + "_hardelete/")} <= w.keys(repo)
    stored = read_summary(s3, Namespace(ns), run["run_id"])
    assert stored is not None and stored["sweep"]["confirmed"] == len(deleted)
    # a second run finds nothing more to delete
    again = asyncio.run(_reconcile_with_tracker(spark, rsettings,
                                                RunOptions(repo, cutoff_ms=cutoff)))
    assert again["success"] and again["mark"]["marked"] == 0


def _fail_and_check(spark, rsettings, w, repo, cutoff, match):
    data_before = w.data(repo)
    res = reconcile(spark, rsettings, RunOptions(repo, cutoff_ms=cutoff))
    assert not res["success"]
    assert match in res["error"]
    assert res["sweep"]["status"] == "not_run"
    assert w.data(repo) == data_before  # nothing deleted
    with pytest.raises(SweepRefused):
        reconcile(spark, rsettings, RunOptions(repo, sweep_only=res["run_id"]))
    ns = Namespace(w.model.repository(repo).storage_namespace)
    stored = read_summary(w.s3, ns, res["run_id"])
    assert stored is not None and stored["success"] is False
    return res


def test_a_failure_while_building_a_live_set_deletes_nothing(spark, rsettings, s3,
                                                              redis_client):
    w, repo, _old, cutoff = workload_world(rsettings, s3, redis_client, ops1=80, ops2=10)
    rep = w.model.repository(repo)
    head = w.model.commits[rep.branches[rep.default_branch].head]
    bucket, key = split_s3_uri(head.manifest)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    s3.delete_object(Bucket=bucket, Key=key)  # a retained commit's manifest is missing
    _fail_and_check(spark, rsettings, w, repo, cutoff, "NoSuchKey")
    s3.put_object(Bucket=bucket, Key=key, Body=b"not parquet")  # ... or unreadable
    _fail_and_check(spark, rsettings, w, repo, cutoff, "Parquet")
    s3.put_object(Bucket=bucket, Key=key, Body=body)

    # a Redis error in the middle of the export (a key of the wrong type)
    bad = RepoKeys(repo).address(rep.storage_namespace + "data/zz/broken")
    redis_client.set(bad, "x")
    _fail_and_check(spark, rsettings, w, repo, cutoff, "WRONGTYPE")
    redis_client.delete(bad)

    # Redis unreachable: a user-facing error before anything is listed
    with pytest.raises(UserError, match="cannot reach the tracker's Redis"):
        reconcile(spark, rsettings.replace(redis_url="redis://127.0.0.1:1/0"),
                  RunOptions(repo, cutoff_ms=cutoff))

    # a lagging tracker with unknown progress: refused, nothing deleted
    redis_client.delete(PROGRESS)
    _fail_and_check(spark, rsettings, w, repo, cutoff, "tracker progress")


def _digest_now(r: Any, keys: RepoKeys, address: str) -> str | None:
    from reconciler.records import token_state
    from reconciler.state import record_digest

    rec = r.hgetall(keys.address(address))
    tokens = sorted({v for k, v in rec.items() if k.startswith("+")})
    states = {t: token_state(v) for t, v in zip(tokens, r.hmget(keys.tokens, tokens),
                                                strict=True)} if tokens else {}
    return record_digest(rec, states)


def _set_mark_digest(s3: Any, run: dict[str, Any], ns_uri: str, rel: str,
                     digest: str | None, r: Any) -> None:
    """Rewrite the marked row of ``rel`` with ``digest`` in the run's mark parts, and seal the
    mark again (as if the run had written it so: what is tested is the sweep's judgment of
    such a mark, not the seal, tests/integration/reconciler/test_evidence_e2e.py)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = split_s3_uri(ns_uri)[0]
    for key in run["mark"]["parts"]:
        table = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
        rows = table.to_pylist()
        if not any(row["key"] == rel for row in rows):
            continue
        for row in rows:
            if row["key"] == rel:
                row["digest"] = digest
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), buf)
        s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        from reconciler.job import mark_seal
        from reconciler.report import RunSummary, read_summary

        ns = Namespace(ns_uri)
        stored = read_summary(s3, ns, run["run_id"])
        assert stored is not None
        r.set(RepoKeys(run["repository"]).mark_seal(run["run_id"]),
              mark_seal(s3, ns, RunSummary.from_dict(stored)))
        return
    raise AssertionError(f"{rel} is in no mark part")


def test_sweep_only_from_a_dry_run_mark_the_lease_the_guard_and_the_crosscheck(
        spark, rsettings, s3, redis_client):
    w, repo, old, cutoff = workload_world(rsettings, s3, redis_client, ops1=80, ops2=10)
    data_before = w.data(repo)
    dry = reconcile(spark, rsettings, RunOptions(repo, dry_run=True, cutoff_ms=cutoff))
    assert dry["success"] and w.data(repo) == data_before

    # another reconciler holds the repository
    redis_client.set(RECONCILER_LEASE + repo, "someone-else", px=60_000)
    with pytest.raises(LeaseBusy):
        reconcile(spark, rsettings, RunOptions(repo, sweep_only=dry["run_id"]))
    with pytest.raises(LeaseBusy):
        reconcile(spark, rsettings, RunOptions(repo, dry_run=True, cutoff_ms=cutoff))
    redis_client.delete(RECONCILER_LEASE + repo)

    # the repository's first sweep would delete more than sweep_max_share of the listing, and
    # (with the floor lowered: by default a sweep this small is never refused) more than the
    # floor: refused without the flag
    expected = expected_garbage(w, repo, dry["now_ms"], old)
    assert len(expected) > rsettings.sweep_max_share * dry["mark"]["listed"]
    res = reconcile(spark, rsettings.replace(sweep_growth_floor=len(expected) - 1),
                    RunOptions(repo, sweep_only=dry["run_id"]))
    assert res["sweep"]["status"] == "refused"
    assert "sweep_max_share" in res["sweep"]["reason"]
    assert res["blast_radius"]["would_delete"] == len(expected)
    assert w.data(repo) == data_before

    keys = RepoKeys(repo)
    ns_uri = w.model.repository(repo).storage_namespace
    with_since = [a for a in sorted(expected) if redis_client.hget(keys.address(a), "since")]
    victim, wrong = with_since[0], with_since[1]

    def live_again(address: str, ref: str) -> dict[str, str]:
        original = redis_client.hgetall(keys.address(address))
        redis_client.hset(keys.address(address), mapping={f"+{ref}": f"{ref}-token",
                                                          "state": "staged"})
        redis_client.hset(keys.tokens, f"{ref}-token", "open:1")
        return original

    # A mark that judged a record live and marked it anyway (its snapshot held the evidence):
    # the mark is wrong, the cross-check refuses the whole sweep. (The mark's digest is set to
    # the live record's own: as if the snapshot had read it.)
    original_wrong = live_again(wrong, "early-ref")
    _set_mark_digest(s3, dry, ns_uri, wrong[len(ns_uri):], _digest_now(redis_client, keys, wrong),
                     redis_client)
    res = reconcile(spark, rsettings, RunOptions(repo, sweep_only=dry["run_id"],
                                                 allow_large_sweep=True))
    assert res["sweep"]["status"] == "refused" and "cross-check" in res["sweep"]["reason"]
    assert res["crosscheck"]["marked_but_referenced_online"]["sample"] == [
        wrong[len(ns_uri):] + ": staged"]
    assert w.data(repo) == data_before
    redis_client.hset(keys.address(wrong), mapping={"-early-ref": "early-ref-token",
                                                     "state": original_wrong["state"]})

    # After the mark, one marked object gets a live reference again (a copy back into a
    # branch): only that object is skipped (its record changed after the snapshot), the rest
    # is swept; `wrong`'s record is not the one its mark judged either, so it is kept too.
    live_again(victim, "late-ref")
    res = reconcile(spark, rsettings, RunOptions(repo, sweep_only=dry["run_id"],
                                                 allow_large_sweep=True))
    assert res["sweep"]["status"] == "done", res["sweep"]
    deleted = data_before - w.data(repo)
    assert deleted == expected - {victim, wrong}
    assert res["sweep"]["skipped_changed"] == 2 and res["sweep"]["skipped_live"] == 0
    assert victim[len(ns_uri):] + ": staged" in \
        res["revalidation"]["changed_after_mark"]["sample"]
    assert res["crosscheck"]["marked_but_referenced_online"]["count"] == 0
    assert res["blast_radius"]["allowed_by_flag"]

    with pytest.raises(SweepRefused):
        reconcile(spark, rsettings, RunOptions(repo, sweep_only="20000101T000000Z-000000"))
    with pytest.raises(UserError):
        reconcile(spark, rsettings, RunOptions("no-such-repo", dry_run=True))


def test_optimized_run_lists_only_new_slices_plus_the_previous_uncommitted_set(
        spark, rsettings, s3, redis_client):
    from sim.model import Model as M

    w = make_world(rsettings, s3, redis_client)
    # The middle of the hour: "S3 + 60 s" below must stay in S3's slice (an hour-long slice;
    # run within a minute before the hour, the hidden leak fell into S2's, which flow 2 lists).
    now = time.time() // 3600 * 3600 + 1800
    ns = f"s3://{BUCKET}/opt/r/"

    seen: set[str] = set()

    def newest_leak() -> str:
        (leak,) = {a for a, o in w.model.objects.items() if o.kind == "leaked"} - seen
        seen.add(leak)
        return leak

    w.clock.now = now - 3 * 3600  # slice S3 (oldest)
    w.run([(M.create_repository, ("r", ns)), (M.write, ("r", "main", "later-deleted", 10))])
    w.clock.now = now - 2 * 3600  # slice S2: the newest the baseline reads
    w.run([(M.write, ("r", "main", "keep", 10)), (M.leak, ("r", 10))])
    old_leak = newest_leak()
    w.track(int(w.clock.now * 1000))
    keep = w.model.lookup("r", "main", "keep").address
    later_deleted = w.model.lookup("r", "main", "later-deleted").address
    cutoff1 = boundary()
    base = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff1))
    assert base["success"] and base["sweep"]["status"] == "done"
    assert old_leak not in w.data("r") and w.data("r") == {keep, later_deleted}

    # after the baseline, on the real clock (slice S0, newer) ...
    w.clock.now = time.time()
    w.run([(M.delete, ("r", "main", "later-deleted")),  # in S3, uncommitted-live at baseline
           (M.write, ("r", "main", "c", 10)),
           (M.overwrite, ("r", "main", "c", 10)),  # first c: its upload token is still valid
           (M.leak, ("r", 10))])
    new_leak = newest_leak()
    first_c = next(a for a in w.model.issued if a not in (keep, later_deleted)
                   and a != w.model.lookup("r", "main", "c").address)
    # ... and a leak written now into the OLD slice S3: flow 2 does not list S3
    w.clock.now = now - 3 * 3600 + 60
    w.run([(M.leak, ("r", 10))])
    hidden_leak = newest_leak()
    w.clock.now = time.time()
    w.track(None)
    past_grace(rsettings)
    cutoff2 = boundary()

    opt = reconcile(spark, rsettings, RunOptions("r", optimized=True, cutoff_ms=cutoff2))
    assert opt["success"], opt["error"]
    assert opt["mode"] == "optimized"
    assert opt["listing"]["baseline_run"] == base["run_id"]
    assert opt["listing"]["units"] == 2 < opt["listing"]["units_total"]  # S0 and S2
    remaining = w.data("r")
    assert later_deleted not in remaining  # found through the baseline's uncommitted set
    assert new_leak not in remaining
    c = w.model.lookup("r", "main", "c").address
    assert remaining == {keep, hidden_leak, first_c, c}
    assert opt["sweep"]["confirmed"] == 2

    clean = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=cutoff2))
    assert clean["mode"] == "clean" and clean["sweep"]["confirmed"] == 1
    assert w.data("r") == {keep, first_c, c}


def test_inventory_input_gives_the_same_mark_as_listing(spark, rsettings, s3, redis_client,
                                                        tmp_path):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    w, repo, _old, cutoff = workload_world(rsettings, s3, redis_client, ops1=60, ops2=10)
    ns = Namespace(w.model.repository(repo).storage_namespace)
    rows = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ns.bucket):
        rows += [(o["Key"], o["Size"], o["LastModified"]) for o in page.get("Contents", ())]
    rows.append(("someone-else/x", 1, rows[0][2]))  # outside the namespace: ignored
    half = len(rows) // 2
    pq.write_table(pa.table({"bucket": [ns.bucket] * half, "key": [r[0] for r in rows[:half]],
                             "size": [r[1] for r in rows[:half]],
                             "last_modified": [r[2] for r in rows[:half]]}),
                   tmp_path / "a.parquet")
    with open(tmp_path / "b.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["bucket", "key", "size", "last_modified"])
        for k, size, lm in rows[half:]:
            out.writerow([ns.bucket, k, size, lm.isoformat()])

    listed = reconcile(spark, rsettings, RunOptions(repo, dry_run=True, cutoff_ms=cutoff))
    inv = reconcile(spark, rsettings, RunOptions(repo, dry_run=True, cutoff_ms=cutoff,
                                                 inventory=str(tmp_path)))
    assert inv["success"], inv["error"]
    assert inv["listing"]["source"] == "inventory" and inv["listing"]["files"] == 2
    cats = dict(inv["mark"]["categories"])
    # the inventory also holds the metadata prefix, which listing never enters: reserved
    assert cats.pop("reserved")["count"] > 0
    want = dict(listed["mark"]["categories"])
    want.pop("reserved")
    assert cats == want and inv["mark"]["marked"] == listed["mark"]["marked"] > 0
