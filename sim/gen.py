"""Seeded event workloads for tests and the tracker benchmark: the model service's own
(``sim/model.py``: :class:`Workload` applied to a :class:`Model`), cut to a number of events.

One generator: the events follow the publisher contract because the model service emits them
as it changes its state (repositories, branches, staging tokens that get sealed, committed and
dropped, overwrites in the same token, deletes, shallow copies within and across branches,
commits, merges, resets, branch deletes, tags, issued uploads linked or left unlinked), in the
order one service would publish them. The mix, by operation: writes 30%, overwrites 14%,
commits 10%, deletes 8%, copies 9%, the rest branch, tag, seal, merge, reset, unlinked-upload
and leak operations (``DEFAULT_MIX``).
"""

from __future__ import annotations

import random

from schemas import events as ev
from sim.model import ManualClock, Model, Workload, apply_op


def workload(seed: int, n_events: int, repos: int = 4, ttl_seconds: float = 3600.0
             ) -> list[ev.Event]:
    """About ``n_events`` events over ``repos`` repositories (``repo-r0``...), interleaved as
    services would; the same seed gives the same events (but for their fresh event ids)."""
    ids = random.Random(seed)
    model = Model(clock=ManualClock(step=0.001), upload_ttl_seconds=ttl_seconds,
                  new_id=lambda: f"{ids.getrandbits(128):032x}")
    events: list[ev.Event] = []
    for op in Workload(seed=seed, ops=max(n_events, 1), repos=repos, name="repo",
                       bucket="bucket", max_size=1 << 20).operations(model):
        events.extend(apply_op(model, op))
        if len(events) >= n_events:
            break
    return events
