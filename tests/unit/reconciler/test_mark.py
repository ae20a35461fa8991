"""The mark decisions, pure (no servers): classify/compute_mark, the tracker-record verdict,
the cutoff, the retention plan, and the sweep's guard and bulk delete logic."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.errors import UserError
from reconciler.committed import plan_retention
from reconciler.errors import ReconcileError
from reconciler.job import decide_cutoff, parse_cutoff
from reconciler.mark import (
    COMMITTED,
    COMMITTED_EXPIRED,
    EXPIRED_UPLOAD,
    LEAKED,
    MARKED_CATEGORIES,
    REAPED,
    RECENT,
    RESERVED,
    UNCOMMITTED,
    UNREFERENCED,
    Listed,
    Tally,
    classify,
    compute_mark,
    is_plain_key,
)
from reconciler.records import verdict
from reconciler.retention import RetentionPolicy
from reconciler.s3io import Namespace
from reconciler.state import CommittedState
from reconciler.sweep import guard
from schemas.records import CommitRecord

CUTOFF = 1_000_000
NS = Namespace("s3://bucket/repo/")


def L(key: str, age: int = 10, size: int = 1) -> Listed:
    return Listed(key, size, CUTOFF - age)


# ------------------------------------------------------------------------------ classify

def test_classify_order_and_categories():
    known = {"data/s/unref": "unreferenced", "data/s/issued": "issued",
             "data/s/comm": "committed", "data/s/reaped": "reaped", "data/s/odd": "whatever"}
    kw = {"cutoff_ms": CUTOFF, "committed": {"data/s/c", "_hardelete/m"},
          "uncommitted": {"data/s/u", "data/s/c"}, "known": known}
    assert classify(L("_hardelete/m"), **kw) == RESERVED  # reserved wins over committed
    assert classify(L("_lakefs/x"), **kw) == RESERVED
    assert classify(L("data/../_hardelete/x"), **kw) == RESERVED
    assert classify(L("data//x"), **kw) == RESERVED
    assert classify(L("data/s/c"), **kw) == COMMITTED
    assert classify(L("data/s/u"), **kw) == UNCOMMITTED
    assert classify(L("data/s/u", age=-5), **kw) == UNCOMMITTED
    assert classify(L("data/s/new", age=0), **kw) == RECENT  # at the cutoff: not older
    assert classify(L("data/s/new", age=-1), **kw) == RECENT
    assert classify(L("data/s/leak"), **kw) == LEAKED
    assert classify(L("data/s/unref"), **kw) == UNREFERENCED
    assert classify(L("data/s/issued"), **kw) == EXPIRED_UPLOAD
    assert classify(L("data/s/comm"), **kw) == COMMITTED_EXPIRED
    assert classify(L("data/s/reaped"), **kw) == REAPED
    assert classify(L("data/s/odd"), **kw) == UNREFERENCED


def test_compute_mark_tally():
    listing = [L("a", size=5), L("b", size=7), L("c", size=11), L("d", age=-1, size=13),
               L("_hardelete/reports/x", size=17)]
    res = compute_mark(listing, cutoff_ms=CUTOFF, committed={"a"}, uncommitted={"b"},
                       known={})
    assert res.marked_keys == {"c"}
    assert res.tally.counts[COMMITTED] == 1 and res.tally.bytes[COMMITTED] == 5
    assert res.tally.counts[UNCOMMITTED] == 1 and res.tally.bytes[UNCOMMITTED] == 7
    assert res.tally.counts[LEAKED] == 1 and res.tally.bytes[LEAKED] == 11
    assert res.tally.counts[RECENT] == 1 and res.tally.counts[RESERVED] == 1
    assert res.tally.listed == 5 and res.tally.marked == 1 and res.tally.marked_bytes == 11
    assert Tally.from_dict(res.tally.as_dict()).as_dict() == res.tally.as_dict()


keys = st.one_of(
    st.builds(lambda s, n: f"data/{s}/{n}", st.sampled_from(["s1", "s2", "s3"]),
              st.text("abcxyz", min_size=1, max_size=3)),
    st.builds(lambda p, n: f"{p}{n}", st.sampled_from(["_hardelete/", "_lakefs/", "other/",
                                                       "", "data/", "_hardelete/reports/"]),
              st.text("abc./", min_size=1, max_size=4)),
)


@hsettings(max_examples=300, deadline=None)
@given(
    listing=st.lists(st.tuples(keys, st.integers(0, 100), st.integers(-50, 50)), max_size=40,
                     unique_by=lambda t: t[0]),
    committed=st.sets(keys, max_size=10),
    uncommitted=st.sets(keys, max_size=10),
    known=st.dictionaries(keys, st.sampled_from(["unreferenced", "issued", "committed",
                                                 "reaped", "x"]), max_size=10),
    live_fraction=st.floats(0, 1),
    seed=st.integers(0, 1000),
)
def test_nothing_live_reserved_or_recent_is_ever_marked(listing, committed, uncommitted, known,
                                                        live_fraction, seed):
    rng = random.Random(seed)
    objs = [Listed(k, size, CUTOFF + age) for k, size, age in listing]
    # make a share of the listed keys live, so the property is not vacuous
    for o in objs:
        if rng.random() < live_fraction:
            (committed if rng.random() < 0.5 else uncommitted).add(o.key)
    res = compute_mark(objs, cutoff_ms=CUTOFF, committed=committed, uncommitted=uncommitted,
                       known=known)
    for o, cat in res.marked:
        assert cat in MARKED_CATEGORIES
        assert o.key not in committed and o.key not in uncommitted
        assert o.last_modified_ms < CUTOFF
        assert is_plain_key(o.key)
        assert not o.key.startswith(("_hardelete/", "_lakefs/"))
    # and complete: every plain, unreferenced, old object is marked
    expected = {o.key for o in objs if is_plain_key(o.key) and o.key not in committed
                and o.key not in uncommitted and o.last_modified_ms < CUTOFF}
    assert res.marked_keys == expected
    assert res.tally.listed == len(objs)
    assert res.tally.marked == len(expected)


# -------------------------------------------------------------------------- the verdict

def V(fields, tokens=None, **kw):
    args = {"token_states": tokens or {}, "cutoff_ms": CUTOFF, "now_ms": CUTOFF + 100}
    args.update(kw)
    return verdict(fields, **args)


def test_verdict_live_references():
    assert V({"+r1": "t1", "state": "staged"}, {"t1": "open"}).reason == "staged"
    assert V({"+r1": "t1", "state": "staged"}, {"t1": "sealed"}).live
    # a token the tracker has no state for: kept
    assert V({"+r1": "t9", "state": "unreferenced"}, {}).live
    # removed (even if the remove arrived first: it is a set), dropped token: not live
    v = V({"+r1": "t1", "-r1": "t1", "state": "unreferenced"}, {"t1": "open"})
    assert not v.live and v.kind == "unreferenced"
    v = V({"+r1": "t1", "state": "unreferenced"}, {"t1": "dropped"})
    assert not v.live and v.kind == "unreferenced"
    # one live among several
    assert V({"+r1": "t1", "+r2": "t2", "-r1": "t1"}, {"t1": "open", "t2": "open"}).live


def test_verdict_issued_claimed_and_doubt():
    v = V({"iu": str(CUTOFF + 1), "state": "issued"})
    assert v.live and v.reason == "issued"
    v = V({"iu": str(CUTOFF), "state": "issued"})
    assert not v.live and v.kind == "issued"
    assert V({"state": "reaping", "lease_until": "5"}).reason == "claimed"
    assert V({"state": "unreferenced"}, claimed=True).reason == "claimed"
    assert V({"state": "unreferenced", "lease_until": str(CUTOFF + 500)}).reason == "claimed"
    assert V({"state": "staged"}).reason == "doubt"  # says staged, no live ref visible
    assert V({"state": "martian"}).reason == "doubt"
    assert V({"state": "issued"}).reason == "doubt"  # issued without an expiry
    assert V({"size": "3"}).reason == "doubt"  # no state, no reference
    assert V({"+r": "t", "state": "staged"}, {"t": "weird"}).reason == "doubt"


def test_verdict_committed_and_reaped():
    v = V({"+r1": "t1", "committed": "1", "state": "committed"}, {"t1": "committed"})
    assert not v.live and v.kind == "committed" and v.commit is None
    v = V({"+r1": "t1", "committed": "c7", "state": "committed"}, {"t1": "committed"},
          commit_ids={"c7"})
    assert v.commit == "c7"
    # a committed address with a live ref in an open token (a shallow copy): live
    v = V({"+r1": "t1", "+r2": "t2", "committed": "1"}, {"t1": "committed", "t2": "open"})
    assert v.live
    v = V({"+r1": "t1", "-r1": "t1", "state": "reaped", "reaped_at": "9"}, {"t1": "open"})
    assert not v.live and v.kind == "reaped"


# ------------------------------------------------------------------------------- cutoff

def test_cutoff_is_held_back_by_the_tracker_and_only_moves_earlier():
    hour = 3_600_000
    assert decide_cutoff(10 * hour, 20 * hour, 3600, None) == (9 * hour, "min_age")
    assert decide_cutoff(10 * hour, 5 * hour, 3600, None) == (4 * hour, "tracker_watermark")
    assert decide_cutoff(10 * hour, 20 * hour, 3600, 2 * hour) == (2 * hour, "requested")
    # requested but later than what the tracker allows: held back
    assert decide_cutoff(10 * hour, 5 * hour, 3600, 8 * hour)[0] == 4 * hour
    with pytest.raises(UserError):
        decide_cutoff(10 * hour, 20 * hour, 3600, int(9.5 * hour))
    with pytest.raises(ReconcileError, match="tracker progress"):
        decide_cutoff(10 * hour, None, 3600, None)
    assert decide_cutoff(10 * hour, None, 3600, None, ignore_tracker=True)[0] == 9 * hour
    assert parse_cutoff("1700000000") == 1_700_000_000_000
    assert parse_cutoff("2023-11-14T22:13:20Z") == 1_700_000_000_000
    with pytest.raises(UserError):
        parse_cutoff("yesterday")


# ------------------------------------------------------------------------ retention plan

def commit(cid, parents, time, branch, manifest):
    return cid, CommitRecord(parents, time, branch, manifest)


def repo_state(commits, heads, tags=None, default_days=7.0):
    return CommittedState("r", NS, "main", RetentionPolicy(default_days), None,
                     dict(commits), heads, tags or {})


DAY = 86400.0
NOW = 1_700_000_000.0


def test_plan_retention_reads_distinct_manifests_of_retained_commits():
    commits = [commit("a", (), NOW - 30 * DAY, "main", "_hardelete/manifests/a.parquet"),
               commit("b", ("a",), NOW - 20 * DAY, "main", "s3://bucket/repo/m/b"),
               commit("c", ("b",), NOW - 1 * DAY, "main", "s3://bucket/repo/m/b")]
    plan = plan_retention(repo_state(commits, {"main": "c"}), NOW)
    assert plan.retained == {"b", "c"}  # b: the head 7 days ago
    assert plan.manifests == [("bucket", "repo/m/b")]
    plan = plan_retention(repo_state(commits, {"main": "c"}, default_days=math.inf), NOW)
    assert plan.retained == {"a", "b", "c"}
    assert ("bucket", "repo/_hardelete/manifests/a.parquet") in plan.manifests
    # seed 001 expiration first: a and b expire out of main's ancestry
    plan = plan_retention(repo_state(commits, {"main": "c"}, default_days=0), NOW,
                          expire_older_than_days=10)
    assert "c" in plan.retained and "b" not in plan.retained


def test_plan_retention_fails_on_unknown_retained_commit_or_missing_manifest():
    commits = [commit("b", (), NOW - 1 * DAY, "main", "")]
    with pytest.raises(ReconcileError, match="no manifest"):
        plan_retention(repo_state(commits, {"main": "b"}), NOW)
    commits = [commit("b", (), NOW - 1 * DAY, "main", "m/b")]
    with pytest.raises(ReconcileError, match="unknown to the tracker"):
        plan_retention(repo_state(commits, {"main": "b", "dev": "zz"}), NOW)
    # a parent inside the retention window that the tracker never heard of
    commits = [commit("b", ("a",), NOW - 1 * DAY, "main", "m/b")]
    with pytest.raises(ReconcileError, match="'a' is unknown"):
        plan_retention(repo_state(commits, {"main": "b"}), NOW)


# -------------------------------------------------------------------- guard and deletes

def test_guard_refuses_outside_reserved_and_odd_keys():
    ok, refused = guard(NS, ["data/s/a", "_hardelete/reports/x", "_lakefs/y", "../x",
                             "data/./a", "", "data//b"])
    assert ok == ["repo/data/s/a"]
    assert len(refused) == 6


# ------------------------------------------------------------- the same decision on Spark



def test_plan_retention_expiration_modes_on_seed001():
    # seed 001's history (commit k is k hours after the first), expiring older than 7.5 h;
    # retention keeps branch ancestries forever and nothing dangling
    from sim.retention_examples import BRANCHES_001, PARENTS_001, TAGS_001

    t0 = NOW - 15 * 3600
    commits = {k: CommitRecord(ps, t0 + 3600 * int(k), "main", f"m/{k}")
               for k, ps in PARENTS_001.items()}
    policy = RetentionPolicy(0.0, {b: math.inf for b in BRANCHES_001})
    state = CommittedState("r", NS, "main", policy, None, commits,
                      dict(BRANCHES_001), dict(TAGS_001))
    days = 7.5 / 24
    branch_side = {"0", "8", "9", "10", "11", "12", "13", "14"}
    for mode in ("seed", "icechunk"):
        plan = plan_retention(state, NOW, expire_older_than_days=days, mode=mode)
        assert plan.retained == branch_side | {"3", "5"}  # tags keep their own commit
        assert plan.expired_refs == [("tag", "tag1"), ("tag", "tag2")]
        assert plan.refs_to_delete is None  # not asked for
        # --delete-expired-refs lists the tags for the service to delete; they retain until
        # it has (issue 33: the run never drops a ref the mirror has)
        plan = plan_retention(state, NOW, expire_older_than_days=days, mode=mode,
                              delete_expired_refs=True)
        assert plan.retained == branch_side | {"3", "5"}
        assert [(r.kind, r.name, r.commit) for r in plan.refs_to_delete or ()] == [
            ("tag", "tag1", "3"), ("tag", "tag2", "5")]
        assert plan.as_dict()["refs_to_delete"] == ["tag:tag1", "tag:tag2"]
    assert plan_retention(state, NOW, expire_older_than_days=days).expired_commits == 2
    assert plan_retention(state, NOW, expire_older_than_days=days,
                          mode="icechunk").expired_commits == 5


def test_reconcile_cli_takes_the_expiration_mode():
    import argparse

    from reconciler.job import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--repo", "r", "--expire-older-than-days", "3",
                              "--expiration-mode", "icechunk", "--delete-expired-refs"])
    assert args.expiration_mode == "icechunk" and args.delete_expired_refs
    args = parser.parse_args(["--repo", "r"])
    assert args.expiration_mode == "seed" and not args.delete_expired_refs
    with pytest.raises(SystemExit):
        parser.parse_args(["--repo", "r", "--expiration-mode", "bogus"])


@pytest.mark.parametrize("days", ["0", "-0", "-1", "nan"])
def test_reconcile_cli_refuses_an_expiration_that_would_expire_every_head(days):
    # issue 33: 0 days counts every branch and tag head as expired (NaN compares false with
    # every commit time); refused in one line before Spark starts
    import argparse

    from reconciler.job import _check_args, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--repo", "r", "--expire-older-than-days", days])
    with pytest.raises(UserError, match="--expire-older-than-days must be > 0"):
        _check_args(args)
    _check_args(parser.parse_args(["--repo", "r", "--expire-older-than-days", "0.5"]))


# ------------------------------------------------------------------- grace binds the mark

def test_verdict_keeps_an_address_unreferenced_less_than_grace_before_the_horizon():
    unref = {"+r1": "t1", "-r1": "t1", "state": "unreferenced", "since": "1000"}
    g = {"grace_ms": 500}
    v = V(unref, {"t1": "open"}, horizon_ms=1499, **g)
    assert v.live and v.reason == "young" and v.kind == "unreferenced"
    assert not V(unref, {"t1": "open"}, horizon_ms=1500, **g).live
    assert not V(unref, {"t1": "open"}).live  # no grace given: the old reading
    # no `since`: when the last reference ended is unknown, doubt keeps
    assert V({"+r1": "t1", "-r1": "t1", "state": "unreferenced"}, {"t1": "open"},
             horizon_ms=10**9, **g).live
    # an expired upload: its grace runs from the expiry
    issued = {"iu": "900", "state": "issued", "since": "900"}  # (the tracker's shape)
    assert V(issued, cutoff_ms=950, horizon_ms=1399, **g).reason == "issued"
    assert not V(issued, cutoff_ms=950, horizon_ms=1400, **g).live
    # committed data is judged by retention, not by grace
    assert not V({"+r1": "t1", "committed": "1", "state": "committed"}, {"t1": "committed"},
                 horizon_ms=0, **g).live


# ---------------------------------------------------------------- one canonical address

def test_canonical_address_forms():
    from schemas.address import address_forms, canonical_address
    from schemas.layout import OutsideNamespace

    ns = "s3://bucket/repo/"
    want = "s3://bucket/repo/data/s/x"
    for raw in ("s3://bucket/repo/data/s/x", "S3://bucket/repo/data/s/x",
                "s3a://bucket/repo/data/s/x", "S3N://BUCKET/repo/data/s/x", "data/s/x"):
        assert canonical_address(ns, raw) == want, raw
    assert canonical_address(ns, "s3://bucket/repo/data%2Fs%2Fx", decode=True) == want
    # a key with % may be literal or encoded: both forms are protected
    assert address_forms(ns, "s3://bucket/repo/data/a%20b") == (
        "s3://bucket/repo/data/a%20b", "s3://bucket/repo/data/a b")
    assert address_forms(ns, "data/100%") == ("s3://bucket/repo/data/100%",)
    assert address_forms(ns, "s3://bucket/repo%2Fdata%2Fx") == ("s3://bucket/repo/data/x",)
    for bad in ("s3://other/repo/x", "s3://bucket/repo2/x", "/abs/x", "http://bucket/repo/x",
                "s3://bucket/repo/", "", "s3://"):
        with pytest.raises(OutsideNamespace):
            address_forms(ns, bad)


def test_inventory_csv_keys_are_url_decoded_parquet_keys_are_not():
    from reconciler.listing import inventory_key

    assert inventory_key("ns/data/a+b%2Bc%25d", "inv/x.csv") == "ns/data/a b+c%d"
    assert inventory_key("ns/data/a+b%2Bc", "inv/x.csv.gz") == "ns/data/a b+c"
    assert inventory_key("ns/data/a+b%2Bc", "inv/x.parquet") == "ns/data/a+b%2Bc"


def test_withhold_keeps_what_only_the_mirrors_silence_makes_garbage():
    from reconciler.mark import WITHHELD

    known = {"data/s/unref": "unreferenced", "data/s/issued": "issued",
             "data/s/comm": "committed"}
    kw = {"cutoff_ms": CUTOFF, "committed": set(), "uncommitted": set(), "known": known,
          "withhold": True}
    assert classify(L("data/s/leak"), **kw) == WITHHELD
    assert classify(L("data/s/unref"), **kw) == WITHHELD
    assert classify(L("data/s/issued"), **kw) == EXPIRED_UPLOAD
    assert classify(L("data/s/comm"), **kw) == COMMITTED_EXPIRED


def test_record_digest_sees_references_and_token_states():
    from reconciler.state import record_digest

    rec = {"+r1": "t1", "-r1": "t1", "state": "unreferenced", "since": "5"}
    d = record_digest(rec, {"t1": "dropped"})
    assert d == record_digest(dict(reversed(list(rec.items()))), {"t1": "dropped", "x": "o"})
    assert d != record_digest(rec, {"t1": "committed"})  # a token moved
    assert d != record_digest({**rec, "+r2": "t2"}, {"t1": "dropped"})  # a new reference
    assert d != record_digest({**rec, "since": "6"}, {"t1": "dropped"})  # grace restarted
    assert record_digest({}, {}) is None and record_digest(None, {}) is None


def _meta(folder, **fields) -> None:
    import orjson

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "export.json").write_bytes(orjson.dumps(fields))


def test_service_export_newest_of_the_repository_csv_and_parquet(tmp_path):
    from reconciler.errors import ReconcileError
    from reconciler.evidence import export_keys
    from reconciler.service_export import find_export, write_export

    old = tmp_path / "e1"
    _meta(old, format=2, exported_at="2026-01-01T00:00:00Z", repository="r",
          namespace="s3://b/r/", files=[{"name": "a.csv", "rows": 2}])
    (old / "a.csv").write_text("address,repository\ns3://b/r/data/x,r\ndata/y,r\n")
    write_export(None, str(tmp_path / "e2"), ["s3://b/r/data/z"], exported_at_ms=10**11,
                 repository="r", namespace="s3://b/r/")
    write_export(None, str(tmp_path / "e3"), ["s3://b/q/data/w"], exported_at_ms=2 * 10**12,
                 repository="q", namespace="s3://b/q/")  # newer, but another repository's
    found, _ = find_export(None, str(tmp_path), "r")
    assert found is not None and found.location.endswith("/e1/")
    assert found.exported_at_ms == 1_767_225_600_000 and found.as_dict(0)["fresh"]
    data = (old / "a.csv").read_bytes()
    assert list(export_keys(data, "a.csv", 2, repo="r", ns_uri="s3://b/r/", where="a")) == [
        "data/x", "data/y"]
    assert find_export(None, str(tmp_path / "e3"), "r")[0] is None
    _meta(old, format=2, repository="r", namespace="s3://b/r/",
          files=[{"name": "a.csv", "rows": 2}])
    with pytest.raises(ReconcileError, match="exported_at"):
        find_export(None, str(tmp_path), "r")


def test_a_named_export_that_cannot_be_used_refuses_with_one_line(tmp_path):
    from reconciler.errors import ReconcileError
    from reconciler.service_export import named_export, write_export

    now = 2 * 10**12
    day = 86_400_000.0
    ns = Namespace("s3://b/r/")

    def refused(location: object, match: str, repo: str = "r") -> None:
        with pytest.raises(ReconcileError, match=match) as info:
            named_export(None, str(location), repo, ns, now_ms=now, cutoff_ms=now - day / 4,
                         max_age_ms=day)
        assert "\n" not in str(info.value)

    refused(tmp_path / "missing", "cannot be read")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "nothing there")
    lone = tmp_path / "addresses.csv"
    lone.write_text("address\ns3://b/r/data/x\n")
    refused(lone, "no export.json")
    write_export(None, str(tmp_path / "q"), ["s3://b/q/data/w"], exported_at_ms=now,
                 repository="q", namespace="s3://b/q/")
    refused(tmp_path / "q", "none of 'r'")
    write_export(None, str(tmp_path / "old"), [], exported_at_ms=int(now - day / 2),
                 repository="r", namespace="s3://b/r/")
    refused(tmp_path / "old", "not after the run's cutoff")
    write_export(None, str(tmp_path / "future"), [], exported_at_ms=int(now + day),
                 repository="r", namespace="s3://b/r/")
    refused(tmp_path / "future", "in the future")
    write_export(None, str(tmp_path / "elsewhere"), [], exported_at_ms=now,
                 repository="r", namespace="s3://b/other/")
    refused(tmp_path / "elsewhere", "namespace s3://b/other/")
    shape = tmp_path / "shape"
    _meta(shape, format=1, exported_at=now)
    refused(shape, "format 1")
    _meta(shape, format=2, exported_at=now, namespace="s3://b/r/",
          files=[{"name": "part.csv", "rows": 1}])
    refused(shape, "names no repository")
    _meta(shape, format=2, exported_at=now, repository="r", namespace="s3://b/r/",
          files=[{"name": "part.csv", "rows": 1}])
    refused(shape, "declared file.s. missing: part.csv")
    (shape / "part.csv").write_text("address\ndata/x\n")
    (shape / "more.csv").write_text("address\ndata/y\n")
    refused(shape, "not declared: more.csv")
    (shape / "more.csv").unlink()
    found = named_export(None, str(shape), "r", ns, now_ms=now, cutoff_ms=now - 1,
                         max_age_ms=day)
    assert found.meta.rows == 1 and found.exported_at_ms == now


def test_a_named_inventory_that_cannot_be_used_refuses_with_one_line(tmp_path):
    from reconciler.errors import ReconcileError
    from reconciler.listing import named_inventory

    with pytest.raises(ReconcileError, match="cannot be read"):
        named_inventory(None, str(tmp_path / "missing"))
    with pytest.raises(ReconcileError, match=r"no \.parquet or \.csv files"):
        named_inventory(None, str(tmp_path))
    (tmp_path / "inv.csv").write_text("name,size\nx,1\n")
    with pytest.raises(ReconcileError, match="no column 'key'"):
        named_inventory(None, str(tmp_path))
    (tmp_path / "inv.csv").write_text("key,size,last_modified\nx,1,2026-01-01T00:00:00Z\n")
    assert [f.path for f in named_inventory(None, str(tmp_path))] == [
        str((tmp_path / "inv.csv").resolve())]


def test_changed_since_mark_judges_the_records_of_the_one_evidence_read():
    """The sweep's digest comparison reads the records and token states the judgment read
    (``core.gate.Evidence.fields``), not a second reading of another moment."""
    from core.gate import Evidence, Gate
    from reconciler.state import record_digest
    from reconciler.sweep import changed_since_mark
    from schemas.records import decode_address

    ended = {"+r1": "t1", "-r1": "t1", "state": "unreferenced", "since": "5"}
    raw = {"s3://b/r/same": ended, "s3://b/r/moved": ended,
           "s3://b/r/new": {"+r9": "t9", "state": "staged"}}
    evidence = Evidence(Gate(), {**{a: decode_address(h) for a, h in raw.items()},
                                 "s3://b/r/gone": None, "s3://b/r/none": None},
                        {}, {"t1": "dropped:7", "t9": "open:8"}, 10, fields=raw)
    at_mark = record_digest(ended, {"t1": "dropped"})
    addresses = {rel: f"s3://b/r/{rel}" for rel in ("same", "moved", "new", "gone", "none")}
    digests = {"same": at_mark, "moved": record_digest(ended, {"t1": "open"}),
               "new": None, "gone": at_mark, "none": None}
    # a token that moved, a record that appeared, a record that is gone: changed
    assert changed_since_mark(evidence, addresses, digests) == {"moved", "new", "gone"}
