"""The continuity state machine: any order and any duplication give the same prefix and
horizon, and no horizon passes a watermark whose events are not all applied."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.continuity import (
    PENDING_MAX,
    Admission,
    Domain,
    Watermark,
    admit,
    break_domain,
    certify,
    gaps,
    horizon,
    slot_clock,
    tick_time,
)
from sim.strategies import ClockReading, clock_traces

INC = "i1"


@dataclass(frozen=True)
class Ev:
    seq: int


@dataclass(frozen=True)
class Wm:
    seq: int
    tick: int


Step = Ev | Wm


def run(steps: list[Step], d: Domain | None = None) -> Domain:
    d = d or Domain()
    for s in steps:
        if isinstance(s, Ev):
            d, _ = admit(d, INC, s.seq)
        else:
            d = certify(d, INC, Watermark(s.seq, s.tick))
    return d


@st.composite
def histories(draw: st.DrawFn) -> list[Step]:
    """A service history: n events, and watermarks answering increasing ticks, each with M =
    the events committed before its tick (the promise). Delivery order is drawn later."""
    n = draw(st.integers(0, 12))
    steps: list[Step] = [Ev(s) for s in range(1, n + 1)]
    ticks = sorted(draw(st.lists(st.integers(1, 1000), max_size=6, unique=True)))
    for t in ticks:
        steps.append(Wm(draw(st.integers(0, n)), t))
    return steps


@given(histories(), st.randoms(use_true_random=False), st.data())
@settings(max_examples=300)
def test_any_order_and_duplication_give_the_same_prefix_and_horizon(
    h: list[Step], rnd: object, data: st.DataObject
) -> None:
    in_order = run(sorted(h, key=lambda s: (isinstance(s, Wm), s.seq)))
    dupes = data.draw(st.lists(st.sampled_from(h), max_size=5)) if h else []
    shuffled = h + dupes
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    d = run(shuffled)
    assert d.prefix == in_order.prefix
    n = max((s.seq for s in h if isinstance(s, Ev)), default=0)
    assert d.prefix == n and not d.above
    # every watermark is covered once all events are in, whatever the order:
    best = max((s.tick for s in h if isinstance(s, Wm)), default=None)
    assert d.horizon_ms == in_order.horizon_ms == best
    assert d.pending == ()


@given(st.lists(st.one_of(st.builds(Ev, st.integers(1, 10)),
                          st.builds(Wm, st.integers(0, 10), st.integers(1, 100))),
                max_size=40))
@settings(max_examples=500)
def test_no_horizon_passes_a_watermark_whose_events_are_not_all_applied(steps: list[Step]) -> None:
    d = Domain()
    applied: set[int] = set()
    certified: list[Wm] = []
    for s in steps:
        if isinstance(s, Ev):
            d, verdict = admit(d, INC, s.seq)
            assert verdict is (Admission.DUPLICATE if s.seq in applied else Admission.APPLY)
            applied.add(s.seq)
        else:
            d = certify(d, INC, Watermark(s.seq, s.tick))
            certified.append(s)
        prefix = 0
        while prefix + 1 in applied:
            prefix += 1
        assert d.prefix == prefix
        assert d.above == frozenset(x for x in applied if x > prefix)
        # the horizon is the R of some watermark all of whose events are applied ...
        if d.horizon_ms is not None:
            assert any(w.tick == d.horizon_ms and w.seq <= prefix for w in certified)
        # ... and the largest such R (nothing certifiable is lost while under PENDING_MAX)
        covered = [w.tick for w in certified if w.seq <= prefix]
        if len(certified) < PENDING_MAX:
            assert d.horizon_ms == (max(covered) if covered else None)
        for w in d.pending:
            assert w.seq > prefix


def test_the_horizon_never_goes_back() -> None:
    d = run([Ev(1), Wm(1, 50), Wm(0, 40), Wm(1, 30)])
    assert d.horizon_ms == 50


def test_a_gap_holds_the_horizon_back_until_it_is_filled() -> None:
    d = run([Ev(1), Ev(3), Wm(3, 10), Wm(1, 5)])
    assert d.horizon_ms == 5 and d.prefix == 1 and d.above == {3}
    assert gaps(d) == [(2, 2)]
    d, verdict = admit(d, INC, 2)
    assert verdict is Admission.APPLY and d.horizon_ms == 10 and gaps(d) == []


def test_gaps_reach_the_highest_watermark() -> None:
    d = run([Ev(2), Ev(5), Wm(8, 10)])
    assert gaps(d) == [(1, 1), (3, 4), (6, 8)]
    assert gaps(d, limit=2) == [(1, 1), (3, 4)]
    assert gaps(d, limit=1) == [(1, 1)]
    assert gaps(d, limit=0) == gaps(d, limit=-1) == []


def test_an_empty_domain_is_certified_by_a_watermark_of_zero() -> None:
    assert run([Wm(0, 7)]).horizon_ms == 7
    assert run([]).horizon_ms is None


def test_a_second_incarnation_breaks_the_domain() -> None:
    d = run([Ev(1), Wm(1, 10)])
    d2, verdict = admit(d, "i2", 2)
    assert verdict is Admission.REFUSED and d2.broken and d2.horizon_ms is None
    assert certify(d2, INC, Watermark(1, 20)).horizon_ms is None
    assert admit(d2, INC, 2)[1] is Admission.REFUSED
    d3 = certify(d, "i2", Watermark(0, 30))
    assert d3.broken and d3.horizon_ms is None
    assert gaps(d3) == []


def test_a_watermark_below_what_was_applied_at_its_tick_breaks_the_domain() -> None:
    """Seq 5 was applied before the tick was read, so it committed before the relay read M:
    M = 3 comes from a store that lags (a standby's relay on a replica). Certifying it would
    pass the missing seq 4; the domain breaks instead."""
    d = run([Ev(1), Ev(2), Ev(3), Ev(5)])
    lagging = certify(d, INC, Watermark(3, 50, applied=5))
    assert lagging.broken and "lags" in lagging.broken and lagging.horizon_ms is None
    assert certify(d, INC, Watermark(5, 50, applied=5)).broken is None  # the truth: pending
    assert certify(d, INC, Watermark(3, 50, applied=3)).horizon_ms == 50  # seq 5 came later


@given(st.integers(0, 20), st.integers(0, 20), st.integers(1, 99))
def test_no_horizon_comes_from_a_watermark_below_its_ticks_applied_seq(
        m: int, applied: int, tick: int) -> None:
    d = Domain()
    for s in range(1, 21):
        d, _ = admit(d, INC, s)
    after = certify(d, INC, Watermark(m, tick, applied))
    assert (after.horizon_ms == tick) == (m >= applied)
    assert (after.broken is not None) == (m < applied)


def test_a_broken_domain_stays_broken_with_its_first_reason() -> None:
    d = break_domain(Domain(), "range 3-9 gone")
    assert break_domain(d, "other").broken == "range 3-9 gone"


def test_pending_watermarks_are_bounded_and_keep_the_newest() -> None:
    d = Domain()
    d, _ = admit(d, INC, 1)
    for i in range(100):
        d = certify(d, INC, Watermark(10 + i, 100 + i))
    assert len(d.pending) <= PENDING_MAX
    for s in range(2, 110):
        d, _ = admit(d, INC, s)
    assert d.horizon_ms == 199


def test_the_repository_horizon_is_the_least_of_its_stripes() -> None:
    a, b = run([Wm(0, 10)]), run([Wm(0, 20)])
    assert horizon([a, b]) == 10
    assert horizon([a, Domain()]) is None
    assert horizon([]) is None


@pytest.mark.parametrize("bad", [-1, 2**53, True, 1.5])
def test_seq_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        admit(Domain(), INC, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        admit(Domain(), INC, 0)
    with pytest.raises(ValueError):
        admit(Domain(), "", 1)


def test_a_rebuild_starts_the_domain_at_the_exports_counter_and_retires_the_old_incarnation(
) -> None:
    from core.continuity import RETIRED_MAX, rebuilt

    d = run([Ev(1), Ev(2), Ev(5), Wm(2, 10)])
    d = break_domain(d, "an event without a seq")
    d2 = rebuilt(d, "i2", 7)
    assert d2 == Domain(incarnation="i2", prefix=7, retired=frozenset({INC}), epoch=1)
    # a late event of the retired incarnation is stale: refused, and nothing breaks
    d3, verdict = admit(d2, INC, 8)
    assert verdict is Admission.REFUSED and d3 == d2
    assert certify(d2, INC, Watermark(0, 50)) == d2
    # the new incarnation goes on from the counter; a third one still breaks
    d4, verdict = admit(d2, "i2", 8)
    assert verdict is Admission.APPLY and d4.prefix == 8
    assert admit(d4, "i3", 9)[0].broken
    # a rebuild in the same incarnation retires nothing; the list is bounded (newest names)
    assert rebuilt(d2, "i2", 9).retired == frozenset({INC})
    many = Domain(incarnation="z", retired=frozenset(f"r{i:02d}" for i in range(20)))
    assert rebuilt(many, "n", 0).retired == frozenset(
        sorted({*many.retired, "z"})[-RETIRED_MAX:])
    with pytest.raises(ValueError):
        rebuilt(d, "", 1)


# --- A7: the slot clock and the tick's time -------------------------------------------------

@given(clock_traces(), st.integers(1, 30_000))  # (grace > 0)
@settings(max_examples=200, deadline=None)
def test_a_tick_certifies_a_since_plus_grace_only_after_grace_of_real_time(
        trace: tuple[int, list[ClockReading]], grace: int) -> None:
    """The proof's first step (schemas/README.md, "Proof"): a since stamped at reading i and a
    tick read at reading j with ``tick_time(c_j) >= c_i + grace`` are at least grace apart in
    real time, the tick last."""
    skew, readings = trace
    high, clocks = 0, []
    for _, node, _ in readings:
        high = slot_clock(high, node)
        clocks.append(high)
    for i, (t_since, _, _) in enumerate(readings):
        for j, (t_tick, _, _) in enumerate(readings):
            if tick_time(clocks[j], skew) >= clocks[i] + grace:
                assert t_tick - t_since >= grace, (i, j, clocks)


def test_the_slot_clock_never_goes_back_and_a_tick_carries_the_skew_less() -> None:
    assert slot_clock(10_000, 4_000) == 10_000
    assert slot_clock(10_000, 12_000) == 12_000
    assert tick_time(12_000, 1_000) == 11_000
    assert tick_time(500, 1_000) == 0
