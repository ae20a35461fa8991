"""The optimized run (seed 002 flow 2) reads only the manifests of commits new since its
baseline, from the baseline's keep-set stored in the namespace (reconciler/keepset.py): on a
world changed between runs by ordinary writes, merges, resets, retention changes, deleted
branches and expirations, it deletes exactly what a clean run marks on the same world, and it
falls back to a clean run (saying why) whenever the keep-set could shrink or cannot be proven."""

from __future__ import annotations

import time
from typing import Any

import pytest

from reconciler.job import RunOptions, reconcile
from reconciler.s3io import Namespace, get_json, read_parquet_rows
from schemas.layout import RepoKeys
from sim.model import Model as M
from sim.worlds import BUCKET, DAY, World, boundary, call, make, past_grace

pytestmark = [pytest.mark.spark]


@pytest.fixture
def rsettings(settings):
    return settings.replace(reconcile_min_age_seconds=0.0)


def marked(s3: Any, ns: Namespace, summary: dict[str, Any]) -> set[str]:
    return {ns.address(row[0]) for part in summary["mark"]["parts"]
            for row in read_parquet_rows(s3, ns.bucket, part, ("key",))}


def manifests(s3: Any, ns: Namespace, summary: dict[str, Any]) -> set[tuple[str, ...]]:
    return {tuple(m) for m in get_json(s3, ns.bucket,
                                       summary["retention"]["retained_key"])["manifests"]}


class Runs:
    """A clean dry run, then an optimized run with its sweep, on the same world; the
    optimized run's deletes must be the clean run's mark."""

    def __init__(self, w: World, spark: Any, ns: Namespace, baseline: dict[str, Any]):
        self.w, self.spark, self.ns, self.baseline = w, spark, ns, baseline

    def compare(self, **opts: Any) -> tuple[dict[str, Any], set[str]]:
        w, ns = self.w, self.ns
        w.clock.now = time.time()
        w.track(None)
        past_grace(w.settings)
        cutoff = boundary(w)
        clean = reconcile(self.spark, w.settings, RunOptions("r", dry_run=True,
                                                             cutoff_ms=cutoff, **opts))
        assert clean["success"], clean["error"]
        want = marked(w.s3, ns, clean)
        before = w.data("r")
        opt = reconcile(self.spark, w.settings, RunOptions(
            "r", optimized=True, cutoff_ms=cutoff, allow_large_sweep=True, **opts))
        assert opt["success"] and opt["sweep"]["status"] == "done", opt
        assert before - w.data("r") == want
        assert opt["sweep"]["confirmed"] == len(want)
        # The fast path exactly when every manifest the baseline retained is retained now.
        grows = manifests(w.s3, ns, self.baseline) <= manifests(w.s3, ns, opt)
        assert opt["mode"] == ("optimized" if grows else "clean"), opt.get("mode_note")
        if grows:
            assert opt["listing"]["baseline_run"] == self.baseline["run_id"]
            sources = {s["kind"]: s for s in opt["keepset"]["sources"]}
            assert sources["baseline_keepset"]["location"] == self.baseline["run_id"]
            assert sources["manifests"]["files"] == len(manifests(w.s3, ns, opt)
                                                        - manifests(w.s3, ns, self.baseline))
        else:
            assert "not retained now" in opt["mode_note"]
        self.baseline = opt
        return opt, want


@pytest.mark.slow
def test_optimized_runs_delete_exactly_what_clean_runs_mark(spark, rsettings, s3,
                                                            redis_client):
    w = make(rsettings, s3, redis_client)
    ns = Namespace(f"s3://{BUCKET}/incr/r/")
    k = RepoKeys("r")
    # The middle of an hour: the two slices below are whole hours before the real clock's.
    hour = time.time() // 3600 * 3600 + 1800
    w.clock.now = hour - 3 * 3600  # the old slice: not listed by an optimized run
    call(w, M.create_repository, "r", ns.uri, default_retention_days=1.0,
         branch_retention_days={"main": 30.0})
    call(w, M.write, "r", "main", "a1", 10)
    call(w, M.write, "r", "main", "a2", 10)
    call(w, M.commit, "r", "main", at=time.time() - 6 * DAY)
    call(w, M.create_branch, "r", "dev")
    call(w, M.overwrite, "r", "main", "a2", 10)  # a2's second version: only in c1
    a2_v2 = w.model.lookup("r", "main", "a2").address
    c1 = call(w, M.commit, "r", "main", at=time.time() - 5 * DAY).commit.id
    call(w, M.write, "r", "dev", "d1", 10)
    call(w, M.commit, "r", "dev", at=time.time() - 4 * DAY)
    d2 = call(w, M.write, "r", "dev", "d2", 10).address  # staged: dropped by a reset below
    call(w, M.write, "r", "main", "s1", 10)  # committed below, then overwritten
    w.clock.now = hour - 2 * 3600  # the baseline's newest slice
    call(w, M.overwrite, "r", "main", "a2", 10)
    call(w, M.write, "r", "main", "a4", 10)
    call(w, M.commit, "r", "main", at=time.time() - 1 * DAY)
    call(w, M.leak, "r", 10)
    w.track(None)
    past_grace(rsettings)
    base = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=boundary(w),
                                                  allow_large_sweep=True))
    assert base["success"] and base["sweep"]["status"] == "done", base
    runs = Runs(w, spark, ns, base)

    # 1. ordinary writes and commits, a reset (staged data of the old slice dropped), a merge
    w.clock.now = time.time()
    call(w, M.write, "r", "main", "b1", 10)
    call(w, M.overwrite, "r", "main", "b1", 10)
    call(w, M.overwrite, "r", "main", "s1", 10)
    call(w, M.reset_branch, "r", "dev")
    call(w, M.merge, "r", "dev", "main")
    call(w, M.leak, "r", 10)
    opt, deleted = runs.compare()
    assert opt["mode"] == "optimized"
    assert d2 in deleted  # the old slice's, found through the baseline's export

    # 2. snapshot expiration: c1 (five days old, no ref's) leaves main's ancestry and is
    #    older than the default retention; a2's second version (old slice) is garbage now
    opt, deleted = runs.compare(expire_older_than_days=2.0)
    assert opt["mode"] == "clean" and a2_v2 in deleted

    # 3. a commit on top, the same expiration: more is retained, nothing leaves
    w.clock.now = time.time()
    call(w, M.write, "r", "main", "e1", 10)
    call(w, M.commit, "r", "main")
    assert runs.compare(expire_older_than_days=2.0)[0]["mode"] == "optimized"

    # 4. a shorter retention (half a day everywhere): the first commit leaves it
    w.r.hset(k.meta, mapping={"default_retention_days": "0.5", "branch_retention": "{}"})
    w.model.repository("r").default_retention_days = 0.5
    w.model.repository("r").branch_retention_days = {}
    assert runs.compare()[0]["mode"] == "clean"

    # 5. a longer retention again, a hard reset of main back to c1 (its later commits
    #    dangle) and a deleted branch
    w.r.hset(k.meta, mapping={"default_retention_days": "30"})
    w.model.repository("r").default_retention_days = 30.0
    w.clock.now = time.time()
    call(w, M.write, "r", "main", "f1", 10)
    w.model.repository("r").branches["main"].head = c1
    call(w, M.reset_branch, "r", "main")
    call(w, M.delete_branch, "r", "dev")
    runs.compare()

    # 6. ordinary writes on top: the fast path again
    w.clock.now = time.time()
    call(w, M.write, "r", "main", "g1", 10)
    call(w, M.overwrite, "r", "main", "g1", 10)
    call(w, M.leak, "r", 10)
    assert runs.compare()[0]["mode"] == "optimized"


def test_a_keep_set_that_cannot_be_proven_is_not_reused(spark, rsettings, s3, redis_client):
    """A baseline keep-set whose seal is gone (Redis went back) or whose part was rewritten
    (here: a committed key replaced by another, which would have marked a live object of a
    listed slice) is not reused: the optimized run is a clean run and says why."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    w = make(rsettings, s3, redis_client)
    ns = Namespace(f"s3://{BUCKET}/incr2/r/")
    w.clock.now = time.time() // 3600 * 3600 - 1800  # the baseline's newest slice
    call(w, M.create_repository, "r", ns.uri)
    kept = call(w, M.write, "r", "main", "k", 10).address
    call(w, M.commit, "r", "main")
    w.track(None)
    past_grace(rsettings)
    base = reconcile(spark, rsettings, RunOptions("r", cutoff_ms=boundary(w)))
    assert base["success"] and base["sweep"]["status"] == "done", base
    seal_key = RepoKeys("r").keep_seal(base["run_id"])
    desc = get_json(s3, ns.bucket, base["keepset"]["stored"])
    assert desc["keys"] == base["retention"]["committed_keys"]

    def optimized() -> dict[str, Any]:
        w.clock.now = time.time()
        call(w, M.leak, "r", 10)
        w.track(None)
        past_grace(rsettings)
        run = reconcile(spark, rsettings, RunOptions("r", optimized=True, dry_run=True,
                                                     cutoff_ms=boundary(w)))
        assert run["success"], run["error"]
        assert kept not in marked(s3, ns, run)
        return run

    assert optimized()["mode"] == "optimized"
    seal = redis_client.get(seal_key)
    redis_client.delete(seal_key)
    run = optimized()
    assert run["mode"] == "clean" and "seal is gone" in run["mode_note"]
    redis_client.set(seal_key, seal)
    (part,) = [p["key"] for p in desc["parts"]  # the part of kept's slice
               if p["unit"] and ns.rel_of_address(kept).startswith(f"data/{p['unit']}/")]
    keys = pq.read_table(io.BytesIO(s3.get_object(Bucket=ns.bucket, Key=part)["Body"]
                                    .read()))["key"].to_pylist()
    assert ns.rel_of_address(kept) in keys
    buf = io.BytesIO()
    # the same number of rows (the strict reader counts them), one of them another key
    pq.write_table(pa.table({"key": [("data/other" if k == ns.rel_of_address(kept) else k)
                                     for k in keys]}), buf)
    s3.put_object(Bucket=ns.bucket, Key=part, Body=buf.getvalue())
    run = optimized()
    assert run["mode"] == "clean" and "rewritten" in run["mode_note"]
