"""``hardelete explain`` speaks the one judgment: guards, grace, and for a committed address
which retained commits hold it and when the reconciler may take it (real Redis and S3)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import orjson

from core.clock import redis_time_ms
from hardelete.status import _when, explain_address
from reconciler.s3io import put_parquet
from schemas.layout import REPOS, RepoKeys
from schemas.records import (
    AddressRecord,
    BranchRecord,
    CommitRecord,
    decode_address,
    encode_address,
    encode_branch,
    encode_commit,
    encode_token,
)
from sim.model import Model
from sim.operations import make_garbage, reap_until, run, stored

DAY_MS = 86_400_000


def _committed_repo(r: Any, s3: Any, bucket: str) -> tuple[str, dict[str, str], int]:
    """main: c0 (10 days ago) <- c1 (3 days ago) <- c2 (now); retention 1 day.
    a is only in c1's manifest, b in c2's, c only in c0's."""
    ns = f"s3://{bucket}/repo/"
    k = RepoKeys("repo")
    now = redis_time_ms(r)
    r.sadd(REPOS, "repo")
    r.hset(k.meta, mapping={"namespace": ns, "default_branch": "main",
                            "default_retention_days": "1", "branch_retention": "{}"})
    addrs = {n: f"{ns}data/1/{n}" for n in ("a", "b", "c")}
    times = {"c0": now - 10 * DAY_MS, "c1": now - 3 * DAY_MS, "c2": now}
    listing = {"c0": ["c"], "c1": ["a"], "c2": ["b"]}
    parents = {"c0": (), "c1": ("c0",), "c2": ("c1",)}
    for cid, t in times.items():
        manifest = f"{ns}_hardelete/manifests/{cid}.parquet"
        put_parquet(s3, bucket, f"repo/_hardelete/manifests/{cid}.parquet",
                    {"address": [addrs[n] for n in listing[cid]]})
        r.hset(k.commits, cid, encode_commit(CommitRecord(parents[cid], t / 1000, "main",
                                                          manifest)))
        r.hset(k.tokens, f"tok-{cid}", encode_token("committed", t))
    r.hset(k.branches, "main", encode_branch(BranchRecord("c2", "tok-open")))
    r.hset(k.tokens, "tok-open", encode_token("open", now))
    for cid, names in listing.items():
        for n in names:
            r.hset(k.address(addrs[n]), mapping=encode_address(AddressRecord(
                adds={f"ref-{n}": f"tok-{cid}"}, state="committed", committed=True,
                committed_value="1", size=1)))
    return ns, addrs, times["c2"]


def test_explain_says_when_the_reconciler_may_take_a_committed_address(
        settings, redis_client, s3, bucket):
    _ns, addrs, c2_ms = _committed_repo(redis_client, s3, bucket)
    ex = explain_address(redis_client, settings, addrs["a"], s3=s3)
    assert ex.verdict.startswith("alive: a commit took it")
    assert "held by retained commits: c1" in ex.lines
    (when,) = [line for line in ex.lines if line.startswith("collectable by the reconciler")]
    at = dt.datetime.fromisoformat(when.split(" from ")[1].split(" if ")[0])
    # c1 leaves main's 1-day window when c2, the head, becomes older than a day
    assert abs(at.timestamp() * 1000 - (c2_ms + DAY_MS)) < 120_000

    ex = explain_address(redis_client, settings, addrs["b"], s3=s3)
    assert "held by retained commits: c2" in ex.lines
    assert any("stay retained as long as nothing changes" in line for line in ex.lines)

    ex = explain_address(redis_client, settings, addrs["c"], s3=s3)
    assert any(line.startswith("no retained commit's manifest lists it") for line in ex.lines)


def test_explain_names_guards_and_grace(settings, redis_client, s3, bucket):
    r = redis_client
    ns = f"s3://{bucket}/repo/"
    k = RepoKeys("repo")
    now = redis_time_ms(r)
    r.sadd(REPOS, "repo")
    r.hset(k.meta, "namespace", ns)
    r.hset(k.tokens, "t", encode_token("dropped", now))
    young = ns + "data/1/young"
    r.hset(k.address(young), mapping=encode_address(AddressRecord(
        adds={"r": "t"}, state="unreferenced", since=now - 100, size=1)))
    r.hset("hd:progress:meta", mapping={"topic": "e", "partitions": "1"})
    r.hset("hd:progress", "0", str(now))
    s = settings.replace(grace_seconds=60.0)
    ex = explain_address(r, s, young, s3=None)
    assert "may be reaped once the tracker's proven progress passes" in ex.verdict
    r.hset(k.holds, young, orjson.dumps({"reason": "legal hold"}))
    ex = explain_address(r, s, young, s3=None)
    assert ex.verdict == "kept (held): legal hold"
    assert "held: legal hold" in ex.lines


def test_explain_says_at_once_who_deleted_an_address(cli, capsys, s3, redis_client,
                                                      monkeypatch):
    """Issue 36 finding 3, on the real tracker and reaper: right after the reaper deleted G,
    inside the grace window counted from the delete, `explain` says deleted, by which reaper,
    when and why (not "protected until" a time already past); with `--repo` naming another
    repository it names G's own instead of "outside every namespace"; and `hold add` refuses
    in one line, since nothing is left to preserve."""
    s = cli.replace(upload_ttl_seconds=1.0, lease_seconds=2.0)
    model = Model.from_settings(s)
    (g,) = asyncio.run(make_garbage(s, s3, model, "repo", ["g"], namespace="s3://explb/repo/"))
    asyncio.run(make_garbage(s, s3, model, "other", [], namespace="s3://otherb/ns/"))
    asyncio.run(reap_until(s, lambda rep: not stored(s3, g)))
    assert g is not None
    rec = decode_address(redis_client.hgetall(RepoKeys("repo").address(g)))
    assert rec.state == "reaped" and rec.claimer and rec.claimer.startswith("reaper-")
    # judged alone, the record is kept for a grace window from the delete: the answer is not
    monkeypatch.setenv("HARDELETE_GRACE_SECONDS", "3600")
    deleted = (f"deleted by reaper {rec.claimer} at {_when(rec.reaped_at)}: every reference "
               f"had ended by {_when(rec.since)} and its grace window had passed")
    code, out, _ = run(capsys, "explain", g, "--json")
    ex = orjson.loads(out)
    assert code == 0 and ex["verdict"].startswith(deleted), ex
    assert ex["repository"] == "repo" and ex["state"] == "reaped"

    code, out, _ = run(capsys, "explain", g, "--repo", "other", "--json")
    ex = orjson.loads(out)
    assert code == 0 and ex["repository"] == "repo" and ex["verdict"].startswith(deleted), ex
    assert "outside every" not in out and "never deletes it" not in out
    assert ex["lines"][0].startswith("not in the namespace of repository 'other' "
                                     "(s3://otherb/ns/): it lies in that of 'repo'")

    code, out, err = run(capsys, "hold", "add", g, "--reason", "legal: case 9")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the reaper deleted it, so a hold would preserve nothing" in err
    assert redis_client.hlen(RepoKeys("repo").holds) == 0
