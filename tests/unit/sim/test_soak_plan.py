"""The soak's fault scheduler alone: a pure function of the seed (no servers)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.soak_plan import (
    ALL_FAULTS,
    NEEDS_FIX,
    SURVIVED,
    FaultKind,
    ReconcileKind,
    parse_faults,
    plan,
)


def _plan(seed: int, ops: int = 10_000, faults: frozenset[FaultKind] = frozenset(ALL_FAULTS),
          **kw: float) -> list:
    return plan(seed, ops, faults, repos=4, grace_seconds=2.0, **kw)


def test_same_seed_same_schedule_and_different_seeds_differ() -> None:
    assert _plan(7) == _plan(7)
    assert _plan(7) != _plan(8)


@given(seed=st.integers(0, 2**32), ops=st.integers(200, 20_000),
       kinds=st.sets(st.sampled_from(ALL_FAULTS)))
@settings(max_examples=60, deadline=None)
def test_every_selected_kind_happens_and_nothing_else(seed: int, ops: int,
                                                       kinds: set[FaultKind]) -> None:
    steps = _plan(seed, ops, frozenset(kinds))
    faults = [s for s in steps if isinstance(s.action, FaultKind)]
    assert {s.action for s in faults} == kinds
    assert all(0 <= s.at_op < ops for s in steps)
    # Faults stop before the end: the drain needs a quiet tail.
    assert all(s.at_op < int(ops * 0.9) for s in faults)
    assert [s.at_op for s in steps] == sorted(s.at_op for s in steps)


def test_rate_heavy_spacing_and_parameters() -> None:
    steps = _plan(3, 10_000, per_1000_ops=4.0)
    faults = [s for s in steps if isinstance(s.action, FaultKind)]
    assert len(faults) == 40
    heavy = sorted(s.at_op for s in faults if s.action in (
        FaultKind.REDIS_RESTART, FaultKind.REDIS_ROLLBACK, FaultKind.BROKER_RESTART,
        FaultKind.BROKER_KILL, FaultKind.BROKER_LOG_LOST, FaultKind.KILL_RECONCILER))
    assert all(b - a >= 200 for a, b in itertools.pairwise(heavy))
    for s in faults:
        if s.action is FaultKind.DELAY:
            assert 0 < s.delay < 2.0  # within the grace window: the contract
        if s.action is FaultKind.S3_ERRORS:
            assert 0 < s.share < 1 and s.span >= 1
        if s.action in (FaultKind.KILL_TRACKER, FaultKind.KILL_REAPER):
            assert s.target in (0, 1)


def test_reconciler_runs_of_every_kind_and_each_sweep_only_follows_a_dry_run() -> None:
    steps = _plan(11, 10_000, faults=frozenset())
    kinds = [s.action for s in steps]
    assert {ReconcileKind.MARK_SWEEP, ReconcileKind.DRY_RUN, ReconcileKind.SWEEP_ONLY} <= set(kinds)
    for s in steps:
        if s.action is ReconcileKind.SWEEP_ONLY:
            assert any(d.action is ReconcileKind.DRY_RUN and d.target == s.target
                       and d.at_op <= s.at_op for d in steps)


def test_tiny_runs() -> None:
    assert _plan(1, 0) == []
    assert all(isinstance(s.action, FaultKind) for s in _plan(1, 10))
    with pytest.raises(ValueError):
        plan(1, -1, [], repos=1, grace_seconds=1.0)


def test_parse_faults() -> None:
    assert parse_faults("survived") == SURVIVED
    assert parse_faults("all") == frozenset(ALL_FAULTS)
    assert parse_faults("none") == frozenset()
    assert parse_faults("needs-fix") == frozenset(NEEDS_FIX)
    assert parse_faults("kill_tracker, s3_errors") == {FaultKind.KILL_TRACKER,
                                                       FaultKind.S3_ERRORS}
    assert parse_faults("+reorder,-delay") == (SURVIVED | {FaultKind.REORDER}) - {
        FaultKind.DELAY}
    with pytest.raises(ValueError, match="unknown fault kind 'nope'"):
        parse_faults("nope")


def test_groups_cover_every_kind_once() -> None:
    assert SURVIVED.isdisjoint(NEEDS_FIX)
    assert SURVIVED | set(NEEDS_FIX) == set(FaultKind)


def test_cli_prints_the_schedule_of_a_seed_and_refuses_unknown_faults(
        capsys: pytest.CaptureFixture[str]) -> None:
    import orjson

    from hardelete.cli import main

    assert main(["soak", "--plan", "--ops", "2000", "--seed", "4", "--faults", "all"]) == 0
    first = capsys.readouterr().out
    assert main(["soak", "--plan", "--ops", "2000", "--seed", "4", "--faults", "all"]) == 0
    assert capsys.readouterr().out == first
    steps = [orjson.loads(line) for line in first.splitlines()]
    assert {s["action"] for s in steps} >= {k.value for k in FaultKind}
    assert main(["soak", "--plan", "--faults", "bogus"]) == 2
    assert "unknown fault kind 'bogus'" in capsys.readouterr().err
