"""Adversarial review (atk7), held: the proof's first step (schemas/README.md, "Proof") on
clock traces where the repository's slot goes back (a failover to a replica that lags, a restore
from a copy), taking its clock's high-water mark (``hd:{R}:clock``) back with it, while a tick
read on the lost state stays valid (it is out: control topic, relay, watermark).
``tests/unit/core/test_continuity.py``'s property test keeps the high-water mark across every
reading, so it cannot see this; here it is lost, and the step fails."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.continuity import slot_clock, tick_time
from sim.strategies import ClockReading, clock_traces


@given(clock_traces(go_back=True), st.integers(1, 30_000))
@settings(max_examples=300, deadline=None)
def test_a_tick_certifies_a_since_plus_grace_only_after_grace_of_real_time_across_go_backs(
        trace: tuple[int, list[ClockReading]], grace: int) -> None:
    """Held: a watermark certifies only a tick whose reading its slot still holds
    (``C.issue``/``C.issued``, ``hd:{R}:ticks``), so a since and a tick meet in one slot state
    only when both readings are in its history: one chain, on which the high-water mark never
    goes back. (Without that check, every pair of readings could meet: the step fails.)"""
    skew, readings = trace
    high, clocks, highs, parent = 0, list[int](), list[int](), list[int | None]()
    for i, (_, node, back) in enumerate(readings):
        if back is not None:
            high = highs[back]  # the slot as it was just after that reading
        parent.append(back if back is not None else (i - 1 if i else None))
        high = slot_clock(high, node)
        clocks.append(high)
        highs.append(high)

    def history(k: int) -> set[int]:
        out: set[int] = set()
        at: int | None = k
        while at is not None:
            out.add(at)
            at = parent[at]
        return out

    for k in range(len(readings)):
        held = history(k)  # the readings the slot's state after reading k still holds
        for i in held:
            for j in held:
                if tick_time(clocks[j], skew) >= clocks[i] + grace:
                    assert readings[j][0] - readings[i][0] >= grace, (i, j, clocks)
