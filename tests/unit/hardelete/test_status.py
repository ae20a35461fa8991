"""`hardelete status`'s verdict: what needs a person, in one line of at most 80 columns."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hardelete.health import Operations
from hardelete.status import (
    Attention,
    ContinuityView,
    RepoStatus,
    Status,
    attention,
    verdict_line,
)


def _ops(**kw: object) -> Operations:
    base: dict[str, object] = {"tracker_progress_age_s": 1.0, "tracker_alive": True,
                               "dead_letters": 0, "dead_letters_note": "dlq"}
    return Operations(**{**base, **kw})  # type: ignore[arg-type]


def _status(*repos: RepoStatus, everything: str | None = None) -> Status:
    return Status(0, 0, {}, list(repos), fail_closed_all=everything)


def test_nothing_needs_a_person() -> None:
    items = attention(_status(RepoStatus("a", "s3://b/a/", 0, 0, 0, 3)), _ops(), 60)
    assert items == [] and verdict_line(items) == "OK: nothing needs a person"


def test_each_thing_that_needs_a_person_is_counted_in_the_verdict() -> None:
    closed = RepoStatus("a", "s3://b/a/", 0, 0, 0, 0, fail_closed="log reset", needs="x")
    ops = _ops(tracker_alive=False, tracker_progress_age_s=300.0, dead_letters=None,
               dead_letters_note="Kafka down", frozen={"b": ["unreadable"]},
               dead_letters_holding=2, incidents_new={"*": 1, "a": 2})
    items = attention(_status(closed, everything="redis lost"), ops, 60)
    assert [a.kind for a in items] == ["tracker stale", "fail-closed", "fail-closed", "frozen",
                                       "incident", "incident", "dead letter",
                                       "dead letters unknown"]
    assert verdict_line(items) == ("NEEDS A PERSON: tracker stale, 2 fail-closed, 1 frozen, "
                                   "3 incidents, 2 dead letters, dead letters unknown")[:79] + "…"
    assert items[3].detail.startswith("frozen: b: a dead letter holds its whole namespace")
    never = attention(_status(), _ops(tracker_progress_age_s=None, tracker_alive=False), 60)
    assert verdict_line(never) == "NEEDS A PERSON: no tracker"


@given(st.lists(st.builds(Attention, st.sampled_from(["frozen", "incident", "no tracker"]),
                          st.text(max_size=5), st.integers(1, 10**9)), max_size=30),
       st.integers(20, 200))
def test_the_verdict_is_one_line_within_the_width(items: list[Attention], width: int) -> None:
    line = verdict_line(items, width)
    assert len(line) <= width and "\n" not in line
    assert line.startswith("OK") == (not items)


def test_a_broken_continuity_needs_a_person_and_a_gap_is_shown() -> None:
    from hardelete.status import ContinuityView

    broken = RepoStatus("a", "s3://b/a/", 0, 0, 0, 0, continuity=ContinuityView(
        1, None, broken="stripe 0: the service lost seqs 4..4"))
    waiting = RepoStatus("c", "s3://b/c/", 0, 0, 0, 0, continuity=ContinuityView(
        2, 900, missing=((1, 4, 6), (1, 9, 9))))
    fine = RepoStatus("d", "s3://b/d/", 0, 0, 0, 0, continuity=ContinuityView(1, 1_000))
    items = attention(_status(broken, waiting, fine), _ops(), 60)
    assert [a.kind for a in items] == ["continuity broken"]
    assert items[0].detail.startswith("continuity broken: a (stripe 0: the service lost seqs")
    assert waiting.continuity is not None and fine.continuity is not None
    assert waiting.continuity.text(2_000) == "waiting for seqs 4..6 of stripe 1 and 1 more"
    assert fine.continuity.text(3_000) == "certified to 2.0s ago"
    assert ContinuityView(1, None).text(0) == "no watermark yet"


def test_a_dead_lettered_seq_is_named_before_the_missing_range() -> None:
    from hardelete.status import ContinuityView

    view = ContinuityView(1, None, missing=((0, 4, 4),),
                          dead=((0, 4, "2:17", "field 'x': unknown"),))
    text = view.text(0)
    assert text.startswith("waiting for seq 4 of stripe 0: dead-lettered (2:17: field 'x'")
    assert "dlq replay" in text
    assert ContinuityView(1, None, missing=((0, 4, 4),)).text(0) == \
        "waiting for seqs 4..4 of stripe 0"


def test_a_slot_clock_ahead_of_its_node_is_said() -> None:
    view = ContinuityView(1, 1_000, clock_ahead_ms=3_600_000)
    assert "3600.0s ahead of its node's" in view.text(2_000)
    assert "ahead" not in ContinuityView(1, 1_000, clock_ahead_ms=500).text(2_000)
