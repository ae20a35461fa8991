"""``hardelete restore``'s pure decisions (reaper/quarantine.py): when the quarantine copy of a
restored object may go, and the one line of a restore refused under a reaper's claim."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from reaper.quarantine import copy_keep_reason, refusal
from schemas.holds import RestoreClaim

A = "s3://b/r/data/g"


@given(problem=st.sampled_from([None, ("paused", "repository paused: audit"),
                                ("fail_closed", "gap"), ("not_owner", "retired")]),
       in_place=st.booleans(), held=st.booleans(), claimed=st.booleans())
def test_the_copy_goes_only_once_the_object_is_back_held_and_unclaimed(
        problem: tuple[str, str] | None, in_place: bool, held: bool, claimed: bool) -> None:
    why = copy_keep_reason(problem, in_place=in_place, held=held, reaper_claimed=claimed)
    assert (why is None) == (problem is None and in_place and held and not claimed)
    if problem is not None:  # paused, fail-closed, not the owner: no delete path deletes
        assert why is not None and why.startswith(problem[0])


def test_a_refusal_says_why_in_one_line_and_when_to_try_again() -> None:
    live = refusal(A, RestoreClaim("claimed", False, "reaping", 2_000, "reaper-1"), now_ms=1_000)
    assert "being deleted right now" in live and "reaper-1" in live and "\n" not in live
    assert "nothing was restored" in live
    expired = refusal(A, RestoreClaim("claimed", False, "reaping", 500, "reaper-1"),
                      now_ms=1_000)
    assert "lease ran out" in expired and "next reaper pass" in expired and "\n" not in expired
    assert "no lease" in refusal(A, RestoreClaim("claimed", False, "", None, ""), now_ms=1)
