"""A batch that reaches a log's anchor offset must hold the anchor there (tracker/verification.py
``_anchor_missed``): else the log was reset under a tracker that lagged behind its anchor."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tracker.logid import ANCHOR_KEY, LogRecord, anchor_value, fingerprint_of
from tracker.verification import LogVerification


def _rec(offset: int, key: bytes, value: bytes, ts: int) -> Any:
    return SimpleNamespace(offset=offset, key=key, value=value, timestamp=ts)


def _tracker(value: str) -> Any:
    t = object.__new__(LogVerification)
    t._logrec = {1: value}
    return t


def test_the_anchor_where_it_was_written_passes_another_record_there_does_not() -> None:
    anchor = _rec(3, ANCHOR_KEY, anchor_value("e1"), 1000)
    fp = fingerprint_of(anchor.key, anchor.value, anchor.timestamp)
    t = _tracker(LogRecord("e1", 1, "", (3, fp)).encode())
    before = [_rec(2, b"r", b"{}", 900)]
    assert not t._anchor_missed(1, [*before, anchor, _rec(4, b"r", b"{}", 1100)])
    assert not t._anchor_missed(1, before)  # not reached yet
    assert t._anchor_missed(1, [*before, _rec(3, b"r", b"{}", 1000)])  # another log
    assert t._anchor_missed(1, [*before, _rec(4, b"r", b"{}", 1100)])  # offset 3 missing
    # a record with a fingerprint (applied since) or none at all: nothing to check here
    assert not _tracker(LogRecord("e1", 3, fp).encode())._anchor_missed(1, [_rec(4, b"r", b"", 1)])
    assert not _tracker(LogRecord("e1", -1, "").encode())._anchor_missed(1, [_rec(0, b"r", b"", 1)])
