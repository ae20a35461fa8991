"""apply.lua's continuity accounting against the pure machine (core/continuity.py), on one
Redis and on Redis Cluster: a sequenced event is one entry (its op negated, its stripe,
incarnation and seq appended) and each stripe's prefix is written once per call, after the
events (``C.defer_prefix``). Any delivery order, duplicates and cut into calls anywhere gives
the pure machine's state and verdicts; what the script reads within a call (a ``range_gone``
after the seqs it names) sees the seqs admitted earlier in the same call."""

from __future__ import annotations

import uuid
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from core.continuity import Admission, Domain, admit
from core.continuity_store import ContinuityStore
from schemas import events as ev
from schemas.layout import RepoKeys
from tracker import codec
from tracker.state import ApplyScript

pytestmark = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)
HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def _ns(repo: str) -> str:
    return f"s3://bucket/{repo}/"


def _issued(repo: str, seq: int, inc: str = "i1") -> ev.Event:
    return ev.AddressIssued(repository=repo, address=f"{_ns(repo)}a{seq}", ttl_seconds=60.0,
                            seq=seq, incarnation=inc)


def _entries(events: list[ev.Event], first_offset: int = 0) -> list[list[Any]]:
    """The daemon's chunk: each event as codec.compact_sequenced gives it."""
    return [codec.compact_sequenced(codec.parse(ev.encode(e)), first_offset + i)
            for i, e in enumerate(events)]


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Seqs 1..n in any order, some twice (a redelivery, a re-send), and where the tracker
    cuts them into calls."""
    n = draw(st.integers(1, 40))
    seqs = list(draw(st.permutations(range(1, n + 1))))
    for seq in draw(st.lists(st.integers(1, n), max_size=10)):
        seqs.insert(draw(st.integers(0, len(seqs))), seq)
    cuts = sorted(set(draw(st.lists(st.integers(1, len(seqs)), max_size=4))))
    return seqs, cuts


@hsettings(max_examples=30, deadline=None, suppress_health_check=HC)
@given(delivery=deliveries())
def test_any_order_and_any_cut_into_calls_gives_the_pure_state(settings, redis_client,
                                                               delivery):
    seqs, cuts = delivery
    repo = f"s{uuid.uuid4().hex[:8]}"
    entries = _entries([_issued(repo, s) for s in seqs])
    bounds = [0, *cuts, len(entries)]
    for a, b in pairwise(bounds):
        if a < b:
            ApplyScript.apply_sync(redis_client, repo, 0, entries[a:b])
    pure, dups = Domain(), 0
    for s in seqs:
        pure, verdict = admit(pure, "i1", s)
        dups += verdict is Admission.DUPLICATE
    # the stripe's hash as a fresh script reads it: the deferred prefix was written
    assert ContinuityStore(redis_client).read(repo, 0) == pure
    keys = RepoKeys(repo)
    stats = redis_client.hgetall(keys.stats)
    assert int(stats.get("seq_duplicates", 0)) == dups
    assert int(stats["events"]) == len(set(seqs))  # each seq applied once
    assert redis_client.hget(keys.applied, "0") == str(len(seqs) - 1)


def test_a_range_gone_sees_the_seqs_admitted_earlier_in_its_call(redis_client):
    """The prefix of this call's seqs is in the script's cache until its end: a range_gone
    must read it there (the stored prefix still says 0), or it breaks a stripe whose range
    is applied."""
    repo = f"g{uuid.uuid4().hex[:8]}"
    applied = [_issued(repo, s) for s in (1, 2, 3)]
    gone = ev.RangeGone(repository=repo, stripe=0, incarnation="i1", from_seq=1, to_seq=3,
                        reason="trimmed")
    ApplyScript.apply_sync(redis_client, repo, 0, _entries([*applied, gone]))
    d = ContinuityStore(redis_client).read(repo, 0)
    assert d.broken is None and d.prefix == 3
    # a range past the prefix breaks the stripe, in the same call as its seqs too
    later = [_issued(repo, 4)]
    lost = ev.RangeGone(repository=repo, stripe=0, incarnation="i1", from_seq=5, to_seq=6,
                        reason="trimmed")
    ApplyScript.apply_sync(redis_client, repo, 0, _entries([*later, lost], first_offset=4))
    d = ContinuityStore(redis_client).read(repo, 0)
    assert d.prefix == 4 and d.broken == "the service lost seqs 5..6 of incarnation i1: trimmed"


def test_a_sequenced_op_is_one_of_the_events_ops(redis_client):
    """Only an event's op (1..11) may come negated, and only on a partition's call."""
    repo = f"o{uuid.uuid4().hex[:8]}"
    for entry in ([0, -12, ["a"], "e", 0, "i1", 1], [0, -15, 0, "i1", 1, 2, 0, "", 0],
                  [0, -3, 1], [0, 14, 0, "i1", 1]):
        with pytest.raises(Exception, match="unknown op"):
            ApplyScript.apply_sync(redis_client, repo, 0, [entry])
    assert not redis_client.exists(RepoKeys(repo).continuity(0))
