"""The seq of a dead-lettered record, read leniently for status (tracker/deadletters.py)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracker.deadletters import sequenced_of


@pytest.mark.parametrize(("body", "want"), [
    ({"repository": "r", "seq": 4}, ("r", 0, 4)),
    ({"repository": "r", "seq": 4, "stripe": 3, "x_newer": 1}, ("r", 3, 4)),
    ({"repository": "r"}, None),  # no seq: an unsequenced event
    ({"repository": "r", "seq": 0}, None),
    ({"repository": "r", "seq": "4"}, None),
    ({"repository": "r", "seq": 4, "stripe": 64}, None),
    ({"repository": "", "seq": 4}, None),
    ({"seq": 4}, None),
    ([1, 2], None),
])
def test_only_a_well_formed_repository_stripe_and_seq_are_taken(body: object,
                                                                 want: object) -> None:
    assert sequenced_of(orjson.dumps(body)) == want


@given(st.binary(max_size=64))
def test_any_bytes_give_an_answer_never_an_error(raw: bytes) -> None:
    assert sequenced_of(raw) is None or len(sequenced_of(raw) or ()) == 3
    assert sequenced_of(None) is None
