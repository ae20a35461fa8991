"""The control topic's messages (pure): round trips, one clear error per bad field, and the
tick's signature (a tick is the tracker's alone)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import control, reaper_auth
from schemas.control import Broken, ControlError, Resend, Tick

KEY = b"k" * 32
TICK = {"type": "tick", "v": 1, "repository": "r", "tick_ms": 5, "applied": [3], "tick_id": "t1",
        "sig": "ab"}
RESEND = {"type": "resend", "v": 1, "repository": "r", "stripe": 2, "incarnation": "i1",
          "from_seq": 3, "to_seq": 9}
BROKEN = {"type": "broken", "v": 1, "repository": "r", "stripe": 1, "incarnation": "i1",
          "reason": "an event without a seq"}


@given(repo=st.text(min_size=1, max_size=8), tick_ms=st.integers(0, 2**53 - 1),
       stripe=st.integers(0, 63), a=st.integers(1, 2**53 - 1), b=st.integers(1, 2**53 - 1))
@settings(max_examples=100, deadline=None)
def test_round_trip(repo: str, tick_ms: int, stripe: int, a: int, b: int) -> None:
    tick = control.signed_tick(KEY, repo, tick_ms)
    assert control.decode(control.encode(tick)) == tick
    assert tick.key == repo.encode()
    resend = Resend(repository=repo, stripe=stripe, incarnation="i", from_seq=min(a, b),
                    to_seq=max(a, b))
    assert control.decode(control.encode(resend)) == resend


@pytest.mark.parametrize(("body", "culprit"), [
    ({**TICK, "tick_ms": -1}, "tick_ms"),
    ({**TICK, "tick_ms": 2**53}, "tick_ms"),
    ({**TICK, "tick_ms": True}, "tick_ms"),
    ({**TICK, "tick_id": ""}, "tick_id"),
    ({**TICK, "sig": "s" * 129}, "sig"),
    ({k: v for k, v in TICK.items() if k != "sig"}, "sig"),
    ({**TICK, "extra": 1}, "extra"),
    ({**TICK, "v": 2}, "v"),
    ({**TICK, "type": "watermark"}, "type"),
    ({**RESEND, "stripe": 64}, "stripe"),
    ({**RESEND, "from_seq": 0}, "from_seq"),
    ({**RESEND, "from_seq": 10}, "from_seq"),
    ({**RESEND, "incarnation": "i" * 129}, "incarnation"),
    ({**RESEND, "repository": None}, "repository"),
    ({**BROKEN, "reason": ""}, "reason"),
    ({**BROKEN, "reason": "r" * 1001}, "reason"),
    ({k: v for k, v in BROKEN.items() if k != "reason"}, "reason"),
    ({k: v for k, v in BROKEN.items() if k != "incarnation"}, "incarnation"),
    ({**BROKEN, "stripe": -1}, "stripe"),
    ({**BROKEN, "seq": 1}, "seq"),
])
def test_bad_fields_are_named(body: dict[str, Any], culprit: str) -> None:
    with pytest.raises(ControlError) as info:
        control.decode(orjson.dumps(body))
    assert info.value.field == culprit
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [b"", b"[]", b"{", b"null", b"\xff"])
def test_garbage_is_refused(data: bytes) -> None:
    with pytest.raises(ControlError):
        control.decode(data)


def test_only_the_trackers_key_signs_a_tick() -> None:
    tick = control.signed_tick(KEY, "r", 1000, tick_id="t1")
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", tick.sig, [0]) is None
    # any field changed, another key, another domain's signature, none: refused
    assert reaper_auth.tick_problem(KEY, "r", 1001, "t1", tick.sig)
    assert reaper_auth.tick_problem(KEY, "r2", 1000, "t1", tick.sig)
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t2", tick.sig)
    assert reaper_auth.tick_problem(b"other", "r", 1000, "t1", tick.sig)
    assert reaper_auth.tick_problem(None, "r", 1000, "t1", tick.sig)
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", "")
    reaped = reaper_auth.sign(KEY, "r", "1000", "t1", [])
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", reaped)
    # the applied seqs are signed: a lower figure would hide a relay that lags
    two = control.signed_tick(KEY, "r", 1000, [5, 2], tick_id="t1")
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", two.sig, [5, 2]) is None
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", two.sig, [3, 2])
    assert reaper_auth.tick_problem(KEY, "r", 1000, "t1", two.sig, [52])
    # length-prefixed fields: ("r1", 0) and ("r", 10) are different messages
    assert reaper_auth.tick_message("r1", 0, "t") != reaper_auth.tick_message("r", 10, "t")
    assert isinstance(tick, Tick)


@given(repo=st.text(min_size=1, max_size=8), stripe=st.integers(0, 63),
       reason=st.text(max_size=3000))
@settings(max_examples=100, deadline=None)
def test_a_break_round_trips_with_its_reason_cut_to_what_a_watermark_carries(
        repo: str, stripe: int, reason: str) -> None:
    msg = control.broken(repo, stripe, "i", reason)
    assert isinstance(msg, Broken) and msg.key == repo.encode()
    assert control.decode(control.encode(msg)) == msg
    assert 1 <= len(msg.reason) <= control.MAX_REASON
    if 0 < len(reason) <= control.MAX_REASON:
        assert msg.reason == reason
    assert control.decode(orjson.dumps(BROKEN)) == Broken(
        repository="r", stripe=1, incarnation="i1", reason="an event without a seq")
