"""Differential test: the reaper's claim script (``reaper/claims.lua``) re-derives, from the raw
address record, whether an address may go. It must agree exactly with the tracker's pure
specification (``RepoState.reapable``) on every state the tracker can produce, contract
violations, reorderings and duplicates included."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from core.clients import redis_async
from reaper.claims import ClaimStore
from sim.event_chaos import chaos_events, run_both

# Every check holds on one Redis and on a real three-node Redis Cluster (issue 19 item 9).
BOTH_TOPOLOGIES = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)


async def _dry_claims(s, cutoff: int) -> set[str]:
    r = redis_async(s)
    try:
        batch = await ClaimStore(r).claim("r0", grace_ms=0, cutoff_ms=cutoff, limit=10_000,
                                          lease_ms=1000, claimer="t", dry_run=True)
        return {c.address for c in batch.claimed}
    finally:
        await r.aclose()


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**32), n=st.integers(1, 200), step=st.sampled_from([0, 700, 2000]),
       grace=st.sampled_from([0, 500, 3000]), pick=st.floats(0, 1),
       delta=st.sampled_from([-1, 0, 1, 10_000]))
@BOTH_TOPOLOGIES
def test_claim_script_agrees_with_the_tracker_spec(settings, redis_client, seed, n, step, grace,
                                                  pick, delta):
    rng = random.Random(seed)
    world = run_both(redis_client, chaos_events(rng, n), [rng.randint(1, 12) for _ in range(n)],
                     step=step)
    state = world.repos.get("r0")
    assume(state is not None and state.unreferenced)
    assert state is not None
    # Put the horizon right at (or just around) the eligibility of some queued address.
    scores = sorted(state.unreferenced.values()) or [1_000_000]
    horizon = scores[int(pick * (len(scores) - 1))] + grace + delta
    expected = {a for a in state.addresses if state.reapable(a, horizon, grace)}
    assert asyncio.run(_dry_claims(settings, horizon - grace)) == expected
