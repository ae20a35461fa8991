"""Differential tests on a real Redis: both Lua scripts against the one judgment
(``schemas.liveness.judge``).

* ``reaper/claims.lua``: random raw address records (contract violations, unreadable fields,
  holds, leases, unknown token states) are claimed in a dry run; every claim decision and every
  reason to keep must be the judgment's (path ``online``).
* ``tracker/apply.lua``: for random event histories (the tracker's chaos generator, which also
  proves the script equals the pure machine), the derived ``state``, the reaper's queue and the
  claim script's decisions must agree with the judgment of the records the script wrote."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.clients import redis_async
from core.clock import redis_time_ms
from reaper.claims import ClaimStore
from schemas.layout import RepoKeys
from schemas.liveness import Keep, judge
from schemas.records import AddressRecord, decode_address, encode_address
from sim.event_chaos import chaos_events, run_both
from sim.strategies import records

REPO = "r0"
NS = "s3://b/r0/"
HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


async def _dry_claim(s: Any, cutoff: int) -> Any:
    r = redis_async(s)
    try:
        return await ClaimStore(r).claim(REPO, grace_ms=0, cutoff_ms=cutoff, limit=10_000,
                                         lease_ms=1000, claimer="t", dry_run=True)
    finally:
        await r.aclose()


def _shift(rec: AddressRecord, base: int) -> AddressRecord:
    """Times of the generator (multiples of 10 s from 0) moved around the Redis clock."""
    def mv(v: int | None) -> int | None:
        return None if v is None else base + v

    return AddressRecord(rec.adds, rec.removes, rec.state, mv(rec.since), rec.committed,
                          rec.committed_value, mv(rec.issued_until), rec.size,
                          mv(rec.lease_until), rec.claimer, mv(rec.reaped_at), rec.malformed,
                          rec.doubt)


GARBAGE = st.sampled_from([None, None, None, ("since", "abc"), ("iu", "x1"),
                           ("lease_until", "?"), ("size", "big"), ("lease_until", "inf"),
                           ("since", "1e3"), ("iu", "0x10"), ("size", "1.0")])
TOKEN_STATES = st.sampled_from([None, "open:1", "sealed:1", "committed:1", "dropped:1",
                                "weird:1", "doubt:1"])


def _compare(s: Any, r: Any, records_fields: list[dict[str, str]],
             tokens: dict[str, str | None], held: list[str], cutoff: int,
             missing: bool = False) -> None:
    """Write the records, dry-claim them all, compare with the judgment (reasons too)."""
    r.flushall()
    k = RepoKeys(REPO)
    for t, v in tokens.items():
        if v is not None:
            r.hset(k.tokens, t, v)
    addresses = []
    for i, fields in enumerate(records_fields):
        address = f"{NS}data/{i}"
        addresses.append(address)
        r.hset(k.address(address), mapping=fields or {"size": "0"})
        r.zadd(k.unreferenced, {address: 0})
        if held[i] == "exact":
            r.hset(k.holds, address, "{}")
        elif held[i] == "prefix":
            r.hset(k.hold_prefixes, f"{NS}data/{i}", "{}")
    if missing:  # a queue entry whose record is gone
        r.zadd(k.unreferenced, {f"{NS}data/missing": 0})
    batch = asyncio.run(_dry_claim(s, cutoff))
    got = {c.address: "" for c in batch.claimed} | dict(batch.kept)
    states = r.hgetall(k.tokens)
    expected = {}
    prefixes = list(r.hkeys(k.hold_prefixes))
    for address in [*addresses, *([f"{NS}data/missing"] if missing else [])]:
        h = r.hgetall(k.address(address))
        rec = decode_address(h) if h else None
        j = judge(rec, states, now_ms=batch.now_ms, horizon_ms=cutoff, grace_ms=0)
        is_held = r.hexists(k.holds, address) or any(address.startswith(p) for p in prefixes)
        expected[address] = Keep.HELD.value if rec is not None and is_held else j.reason
    assert got == expected


def test_claim_script_is_the_judgment_on_every_rule(settings, redis_client):
    now = redis_time_ms(redis_client)
    old, young, future = str(now - 60_000), str(now - 1_000), str(now + 60_000)
    cutoff = now - 30_000
    dropped = {"+r": "td", "-r": "td"}
    cases: list[dict[str, str]] = [
        {**dropped, "state": "unreferenced", "since": old},  # ok
        {**dropped, "state": "unreferenced", "since": old, "doubt": "1"},  # doubt
        {**dropped, "state": "unreferenced", "since": old, "doubt": "0"},  # ok
        {"+r": "td", "-r": "to", "state": "unreferenced", "since": old},  # not ended
        {"+r": "tq", "state": "unreferenced", "since": old},  # contested token: doubt
        {**dropped, "state": "unreferenced", "since": young},  # young
        {**dropped, "state": "unreferenced"},  # no since: doubt
        {**dropped, "state": "unreferenced", "since": "abc"},  # unreadable: doubt
        {**dropped, "state": "unreferenced", "since": old, "lease_until": "?"},
        {**dropped, "state": "unreferenced", "since": old, "lease_until": "inf"},
        {**dropped, "state": "unreferenced", "since": "0x10"},
        {**dropped, "state": "unreferenced", "since": "1e3"},
        {**dropped, "state": "unreferenced", "since": " 12"},
        {**dropped, "state": "unreferenced", "since": old + ".0"},
        {**dropped, "state": "unreferenced", "since": old, "size": "1_000"},
        {"+r": "to", "state": "unreferenced", "since": old},  # open token: staged
        {"+r": "tx", "state": "unreferenced", "since": old},  # unknown token: staged
        {"+r": "tw", "state": "unreferenced", "since": old},  # weird token state: doubt
        {"+r": "tc", "state": "unreferenced", "since": old},  # committed token
        {**dropped, "state": "unreferenced", "since": old, "committed": "c9"},
        {**dropped, "state": "committed", "since": old},
        {**dropped, "state": "reaping", "since": old, "lease_until": future, "claimer": "a"},
        {**dropped, "state": "reaping", "since": old, "lease_until": old, "claimer": "a"},
        {**dropped, "state": "reaped", "since": old},
        {**dropped, "state": "staged", "since": old},
        {**dropped, "state": "martian", "since": old},
        {**dropped, "since": old},  # no state
        {**dropped, "state": "issued", "since": old},  # issued without iu: doubt
        {"state": "issued", "since": future, "iu": future},  # protected
        {"state": "issued", "since": young, "iu": young},  # past now, not past the cutoff
        {"state": "issued", "since": old, "iu": old},  # expired long ago: ok
        {**dropped, "state": "unreferenced", "since": old},  # held exactly
        {**dropped, "state": "unreferenced", "since": old},  # held by prefix
    ]
    held = ["no"] * (len(cases) - 2) + ["exact", "prefix"]
    tokens = {"td": "dropped:1", "to": "open:1", "tw": "weird:1", "tc": "committed:1",
              "tq": "doubt:1"}
    _compare(settings, redis_client, cases, tokens, held, cutoff, missing=True)


@settings(max_examples=60, deadline=None, suppress_health_check=HC)
@given(recs=st.lists(records(), min_size=1, max_size=12),
       tokens=st.fixed_dictionaries({t: TOKEN_STATES for t in ("t0", "t1", "t2")}),
       garbage=st.lists(GARBAGE, min_size=12, max_size=12),
       held=st.lists(st.sampled_from(["no", "no", "exact", "prefix"]), min_size=12,
                     max_size=12),
       cutoff_k=st.integers(0, 20), missing=st.booleans())
def test_claim_script_is_the_judgment(settings, redis_client, recs, tokens, garbage, held,
                                      cutoff_k, missing):
    base = redis_time_ms(redis_client) - 100_000  # generator times 0..200 s: around now
    fields_list = []
    for i, rec in enumerate(recs):
        fields = encode_address(_shift(rec, base))
        if garbage[i] is not None:
            fields[garbage[i][0]] = garbage[i][1]
        fields_list.append(fields)
    _compare(settings, redis_client, fields_list, tokens, held, base + cutoff_k * 10_000,
             missing)


@settings(max_examples=60, deadline=None, suppress_health_check=HC)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 200), step=st.sampled_from([0, 700, 2000]),
       grace=st.sampled_from([0, 500, 3000]), pick=st.floats(0, 1),
       delta=st.sampled_from([-1, 0, 1, 10_000]))
def test_apply_script_state_and_queue_are_the_judgment(settings, redis_client, seed, n, step,
                                                        grace, pick, delta):
    rng = random.Random(seed)
    r = redis_client
    world = run_both(r, chaos_events(rng, n), [rng.randint(1, 12) for _ in range(n)], step=step)
    state = world.repos.get(REPO)
    if state is None:
        return
    k = RepoKeys(REPO)
    tokens = r.hgetall(k.tokens)
    queue = {a for a, _ in r.zscan_iter(k.unreferenced)}
    if state.retired_at is not None:  # retired: its queue and claims are gone for good
        assert not queue and not r.zcard(k.claims)
        return
    scores = sorted(state.unreferenced.values()) or [1_000_000]
    horizon = scores[int(pick * (len(scores) - 1))] + grace + delta
    # the horizon is never ahead of the clock the records were written on
    now = max(horizon, 1_000_000 + step * (n + 2))
    expected_claims = set()
    for address in state.addresses:
        rec = decode_address(r.hgetall(k.address(address)))
        far = judge(rec, tokens, now_ms=0, horizon_ms=2**62, grace_ms=0)
        # the derived state is the judgment's classification of the record (the state puts
        # committed before staged; the judgment names a live reference first, because a
        # staged copy keeps a committed address from the reconciler too)
        # (a doubt, a contradicted reference id or a contested token, keeps on every path)
        if rec.state == "staged":
            assert far.reason in (Keep.STAGED, Keep.DOUBT) and not rec.committed
        elif rec.state == "committed":
            assert rec.committed and far.reason in (Keep.STAGED, Keep.COMMITTED, Keep.DOUBT)
            assert judge(rec, tokens, now_ms=0, horizon_ms=2**62, grace_ms=0,
                         path="reconciler").reason in ("", Keep.STAGED, Keep.DOUBT)
        elif rec.state in ("unreferenced", "issued"):
            assert far.may_delete or far.reason == Keep.ISSUED
        # the reaper's queue holds exactly the addresses the judgment may let go one day
        assert (address in queue) == (rec.state in ("unreferenced", "issued"))
        j = judge(rec, tokens, now_ms=now, horizon_ms=horizon, grace_ms=grace)
        assert j.may_delete == state.reapable(address, horizon, grace), (address, j, rec)
        if j.may_delete:
            expected_claims.add(address)
    batch = asyncio.run(_dry_claim(settings, horizon - grace))
    assert {c.address for c in batch.claimed} == expected_claims
