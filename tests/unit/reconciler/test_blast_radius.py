"""The blast-radius guard (``reconciler/blast_radius.py``): pure, no servers."""

from __future__ import annotations

from statistics import median

from hypothesis import given
from hypothesis import strategies as st

from core.settings import Settings
from reconciler.blast_radius import judge_blast_radius

DEFAULTS = Settings()


def judge(would: int, listed: int, history: list[int], **kw: float):
    opts = dict(max_share=DEFAULTS.sweep_max_share, max_growth=DEFAULTS.sweep_max_growth,
                floor=DEFAULTS.sweep_growth_floor, history_runs=DEFAULTS.sweep_history_runs)
    opts.update(kw)
    return judge_blast_radius(would, listed, history, **opts)  # type: ignore[arg-type]


def test_the_seed_worked_examples_pass_with_default_settings() -> None:
    # seed 003: 2 of 3 objects (67% > 50%), a first sweep; seed 001: a handful of objects
    assert not judge(2, 3, []).refused
    assert not judge(5, 6, [1, 0]).refused


def test_a_first_sweep_above_the_floor_and_the_share_is_refused() -> None:
    v = judge(1_500, 2_000, [])
    assert v.refused and "sweep_max_share" in v.problems[0]
    assert not judge(1_500, 4_000, []).refused  # 37% of the listing


def test_a_sweep_far_above_the_repositorys_usual_is_refused() -> None:
    history = [100, 120, 90, 5_000, 110]  # one unusual night does not move the median
    v = judge(1_300, 1_000_000, history)
    assert v.usual == 110 and v.refused and "median 110" in v.problems[0]
    assert not judge(1_000, 1_000_000, history).refused  # at the floor
    assert not judge(1_100, 1_000_000, history).refused  # 10x the median


def test_only_the_recent_runs_count() -> None:
    old_big = [10] * 7 + [100_000] * 20
    assert judge(5_000, 10**7, old_big).refused
    everything = judge(5_000, 10**7, old_big, history_runs=27)
    assert everything.usual == 100_000 and not everything.refused


@given(would=st.integers(0, 10**7), listed=st.integers(0, 10**7),
       history=st.lists(st.integers(0, 10**6), max_size=12),
       floor=st.integers(0, 10**5), growth=st.floats(1, 100), share=st.floats(0.01, 1),
       runs=st.integers(0, 10))
def test_the_guard_rules(would: int, listed: int, history: list[int], floor: int,
                         growth: float, share: float, runs: int) -> None:
    v = judge(would, listed, history, floor=floor, max_growth=growth, max_share=share,
              history_runs=runs)
    recent = history[:runs]
    if would <= floor:
        assert not v.refused  # small: never refused
    elif recent:
        assert v.refused == (would > growth * median(recent))
    else:
        assert v.refused == bool(listed and would / listed > share)
    # a smaller sweep is never refused where a larger one passes
    if would and not v.refused:
        assert not judge(would - 1, listed, history, floor=floor, max_growth=growth,
                         max_share=share, history_runs=runs).refused
