"""Log identity and continuity, pure parts (tracker/logid.py), the dead-letter message, holds
from dead letters, the verified horizon, and the fail-closed readers and CLI (on the session
Redis)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from hypothesis import given
from hypothesis import strategies as st

from core.clock import horizon_from
from tracker import codec
from tracker.deadletters import dlq_message
from tracker.logid import NOT_FETCHED, LogRecord, decide

E = "fresh"


def test_log_record_round_trip_and_garbage() -> None:
    rec = LogRecord("ab12", 41, "ff00")
    assert LogRecord.decode(rec.encode()) == rec
    assert LogRecord.decode(None) is None
    assert LogRecord.decode("nonsense") is None


def test_same_log_resumes_after_what_redis_applied() -> None:
    rec = LogRecord("e1", 9, "fp")
    d = decide(rec, 0, 20, "fp", E)
    assert (d.seek, d.record, d.reset, d.fail_repos, d.fail_all) == (10, rec, False, None, None)
    # Redis behind the group (went back in time): it still resumes from ITS offset.
    assert decide(LogRecord("e1", 3, "fp3"), 0, 20, "fp3", E).seek == 4


def test_a_shorter_log_is_a_reset_new_epoch_and_fail_closed() -> None:
    d = decide(LogRecord("e1", 9, "fp"), 0, 3, None, E)
    assert d.reset and d.seek == 0 and d.record == LogRecord(E, -1, "")
    assert d.fail_repos and "log reset" in d.fail_repos and d.fail_all is None


def test_another_record_at_the_offset_is_a_reset() -> None:
    d = decide(LogRecord("e1", 9, "fp"), 0, 50, "other", E)
    assert d.reset and d.seek == 0 and d.record.epoch == E and d.fail_repos


def test_retention_gap_fails_closed_but_keeps_the_epoch() -> None:
    d = decide(LogRecord("e1", 9, "fp"), 15, 50, NOT_FETCHED, E)
    assert not d.reset and d.seek == 15 and d.record == LogRecord("e1", 14, "")
    assert d.fail_repos and "retention" in d.fail_repos
    # exactly what was applied removed: nothing lost, nothing to compare
    d = decide(LogRecord("e1", 9, "fp"), 10, 50, NOT_FETCHED, E)
    assert d.seek == 10 and not d.fail_repos and not d.reset


def test_redis_without_a_record() -> None:
    d = decide(None, 0, 30, NOT_FETCHED, E, group_committed=True)
    assert d.seek == 0 and d.reset and d.fail_all is None and "replaying" in d.detail
    d = decide(None, 7, 30, NOT_FETCHED, E, group_committed=True)
    assert d.seek == 7 and d.fail_all and "no longer starts at 0" in d.fail_all


@given(epoch=st.sampled_from(["e1", "e2"]), off=st.integers(-1, 50),
       start=st.integers(0, 60), end=st.integers(0, 80), same=st.booleans(),
       have=st.booleans())
def test_decide_never_skips_what_it_cannot_prove_applied(epoch: str, off: int, start: int,
                                                         end: int, same: bool,
                                                         have: bool) -> None:
    """Whatever it finds: it either resumes right after what Redis applied from the SAME log, or
    starts over at the log start; anything Redis may lack and cannot replay is fail-closed."""
    end = max(end, start)
    rec = LogRecord(epoch, off, "fp") if have else None
    found = ("fp" if same else "other") if rec and start <= off < end else NOT_FETCHED
    d = decide(rec, start, end, found, E)
    assert start <= d.seek <= max(end, (rec.offset + 1) if rec else 0)
    if d.reset:
        assert d.record.epoch == E and d.seek == start
        if rec is not None:  # a log that changed under Redis: repositories fail-closed
            assert d.fail_repos
    else:
        assert rec is not None and d.record.epoch == rec.epoch
        assert d.seek == rec.offset + 1 or d.fail_repos  # no silent gap


@dataclass
class Rec:
    value: bytes | None
    key: bytes | None
    topic: str = "events"
    partition: int = 2
    offset: int = 17
    timestamp: int = 1


def test_dlq_message_truncates_with_reason_and_size() -> None:
    rec = Rec(b"x" * 5_000_000, b"k" * 3000)
    key, value, headers = dlq_message(rec, "too big", max_value=1000)
    h = dict(headers)
    assert len(value) == 1000 and key is not None and len(key) == 1024
    assert h["reason"] == b"too big" and h["truncated"] == b"value"
    assert h["original_size"] == b"5000000" and h["original_key_size"] == b"3000"
    assert h["partition"] == b"2" and h["offset"] == b"17"
    key, value, headers = dlq_message(Rec(None, None), "empty")
    assert value == b"" and key is None and "truncated" not in dict(headers)


def test_hold_targets_only_known_repositories_and_their_namespace() -> None:
    ns = {"r1": "s3://b/r1/", "r2": "s3://b/r2/"}
    body = {"type": "object_written", "repository": "r1", "address": "s3://b/r1/data/a",
            "replaces_address": "s3://b/r2/data/z", "junk": 1}
    got = codec.hold_targets(orjson.dumps(body), b"r2", ns)
    assert got == [("r1", "s3://b/r1/data/a"), ("r2", "s3://b/r2/data/z")]
    # what cannot be read could name anything in the namespace of the repository it names
    assert codec.hold_targets(b"{not json", b"r1", ns) == [("r1", "s3://b/r1/")]
    assert codec.hold_targets(None, b"r1", ns) == [("r1", "s3://b/r1/")]
    assert codec.hold_targets(b"{not json", None, ns) == []
    untyped = {"repository": "r1", "address": "s3://b/r1/data/a"}
    assert codec.hold_targets(orjson.dumps(untyped), None, ns) == [("r1", "s3://b/r1/")]
    teleported = {**untyped, "type": "object_teleported"}
    assert codec.hold_targets(orjson.dumps(teleported), None, ns) == [("r1", "s3://b/r1/")]
    # a lost ref event may be what retains committed data: the namespace
    for t in ("tag_created", "tag_deleted", "branch_created", "branch_reset", "branch_deleted",
              "commit_created"):
        assert codec.hold_targets(orjson.dumps({"type": t, "repository": "r1", "v": 99}),
                                  b"r1", ns) == [("r1", "s3://b/r1/")]
    # a forged addresses_reaped or a refused repository event holds nothing
    for t in ("addresses_reaped", "repository_created", "repository_deleted"):
        assert codec.hold_targets(orjson.dumps({"type": t, "repository": "r1",
                                                "addresses": ["s3://b/r1/data/a"]}),
                                  b"r1", ns) == []
    # a repository not known (yet): held on its own keys, everything when what the record
    # names cannot be read (no type); and on the live owner of the address, when the registry
    # is given (tests/integration/tracker/test_dlq_unknown_repository_held.py end to end)
    nope = orjson.dumps({"repository": "nope", "address": "s3://b/r1/x"})
    assert codec.hold_targets(nope, None, ns) == [("nope", codec.EVERYTHING)]
    assert codec.hold_targets(nope, None, ns, {"s3://b/r1/": "r1"}) == [
        ("nope", codec.EVERYTHING), ("r1", "s3://b/r1/x")]
    typed = orjson.dumps({"type": "object_written", "repository": "nope",
                          "address": "S3://B/r1/x"})
    assert codec.hold_targets(typed, None, ns) == [("nope", "s3://b/r1/x")]
    reserved = {"type": "object_written", "repository": "r1",
                "address": "s3://b/r1/_hardelete/reports/x"}
    assert codec.hold_targets(orjson.dumps(reserved), b"r1", ns) == []


def test_horizon_is_capped_by_the_verified_partition_count() -> None:
    meta = {"partitions": "2", "verified_ms": "100"}
    assert horizon_from(meta, {"0": "500", "1": "300"}) == 100
    assert horizon_from({**meta, "verified_ms": "900"}, {"0": "500", "1": "300"}) == 300
    assert horizon_from({**meta, "partitions": "3"}, {"0": "500", "1": "300"}) is None
    assert horizon_from({**meta, "verified_ms": "x"}, {"0": "5", "1": "3"}) is None








def test_a_replaced_cluster_fails_closed_even_with_nothing_applied_from_the_log() -> None:
    from tracker.logid import cluster_tag, epoch_cluster, new_epoch

    old = new_epoch("cluster-a")
    assert epoch_cluster(old) == cluster_tag("cluster-a") and epoch_cluster(new_epoch()) is None
    nothing = LogRecord(old, -1, "")  # a fresh log's record: no fingerprint to compare
    d = decide(nothing, 0, 5, NOT_FETCHED, new_epoch("cluster-b"), cluster="cluster-b")
    assert d.reset and d.fail_repos and "cluster changed" in d.fail_repos and d.seek == 0
    assert epoch_cluster(d.record.epoch) == cluster_tag("cluster-b")
    # the same cluster: no record to compare; the tracker that wrote it and held the log since
    # goes on (it anchors again)...
    d = decide(nothing, 0, 5, NOT_FETCHED, new_epoch("cluster-a"), cluster="cluster-a",
               held=True)
    assert not d.reset and not d.fail_repos and d.seek == 0
    # ... any other fails closed, but not for a changed cluster (test_an_unanchored_log_...)
    d = decide(nothing, 0, 5, NOT_FETCHED, new_epoch("cluster-a"), cluster="cluster-a")
    assert d.fail_repos and "cluster changed" not in d.fail_repos
    # an epoch minted without a cluster id, or the id unknown now: the old rules only
    legacy = LogRecord(new_epoch(), -1, "")
    assert not decide(legacy, 0, 5, NOT_FETCHED, new_epoch("b"), cluster="b",
                      held=True).fail_repos
    assert not decide(nothing, 0, 5, NOT_FETCHED, new_epoch(), cluster=None, held=True).fail_repos


def test_a_record_without_a_fingerprint_does_not_let_a_new_log_be_skipped() -> None:
    """Found by an adversarial review. After a retention gap hd:log holds ``e:S-1:`` (no
    fingerprint). If the topic is then re-created on the same broker cluster (same cluster id)
    and its new log grows past S before the tracker resumes, ``decide`` sought to S: new records
    0..S-1 (a copy that kept an address alive) were skipped silently. A log never starts lower
    than it did: this one is another."""
    d = decide(LogRecord("e", 99, ""), 0, 200, NOT_FETCHED, "e2")
    assert d.reset and d.seek == 0 and d.fail_repos and "starts at 0" in d.fail_repos
    assert d.record == LogRecord("e2", -1, "")
    # the same log, its start where it was (or further on: a gap, as before)
    assert decide(LogRecord("e", 99, ""), 100, 200, NOT_FETCHED, "e2").seek == 100
    assert decide(LogRecord("e", 99, ""), 150, 200, NOT_FETCHED, "e2").fail_repos


def test_an_anchored_record_round_trips_and_names_its_witness() -> None:
    rec = LogRecord("e", -1, "", (0, "ab"))
    assert rec.encode() == "e:-1:@0.ab" and LogRecord.decode(rec.encode()) == rec
    assert rec.witness == (0, "ab") and LogRecord("e", 4, "ff", (0, "ab")).witness == (4, "ff")
    assert LogRecord("e", -1, "").witness is None
    for bad in ("e:-1:@", "e:-1:@x.ab", "e:-1:@3.", "e:-1:@3"):
        assert LogRecord.decode(bad) is None, bad  # unreadable: no record (fail-closed rules)


def test_a_log_known_by_its_anchor_resumes_only_while_the_anchor_is_there() -> None:
    """Nothing applied from the log (offset -1): the anchor record the tracker wrote at offset 3
    is what tells this log from a topic re-created on the same cluster."""
    rec = LogRecord("e", -1, "", (3, "fp"))
    d = decide(rec, 0, 10, "fp", E)
    assert (d.seek, d.record, d.reset, d.fail_repos) == (0, rec, False, None)
    other = decide(rec, 0, 10, "not-it", E)  # another log grew past the anchor's offset
    assert other.reset and other.seek == 0 and other.fail_repos and "anchor" in other.fail_repos
    short = decide(rec, 0, 3, None, E)  # another log, shorter than the anchor's offset
    assert short.reset and short.fail_repos and "before the anchor" in short.fail_repos
    assert decide(rec, 0, 10, None, E).fail_repos  # no record fetched there
    # without an anchor (the broker refused it): test_an_unanchored_log_...


def test_an_unanchored_log_goes_on_only_with_the_tracker_that_held_it() -> None:
    """Found by review: the broker refused the anchor of a log nothing was applied from
    (``e:-1:``); the tracker stopped; the log was reset on the same cluster (a partition's
    directory lost: same cluster id, offsets reused) with a copy in it that was never applied.
    Resumed "(no anchor to compare)", the copy was lost unnoticed and the reaper deleted the
    copied object (tests/integration/tracker/test_unanchored_log.py). Only the tracker that
    recorded it and held the partition since (it applied what came) may go on with it."""
    for rec in (LogRecord("e", -1, ""), LogRecord("e", 9, "")):  # fresh; retention took it
        nxt = rec.offset + 1
        for end in (nxt, nxt + 5):  # an empty log is no proof either (the old one had records)
            d = decide(rec, nxt, end, NOT_FETCHED, E)
            assert d.reset and d.fail_repos and "unproven" in d.fail_repos
            assert d.seek == nxt and d.record == LogRecord(E, nxt - 1, "")
            held = decide(rec, nxt, end, NOT_FETCHED, E, held=True)
            assert (held.seek, held.record, held.reset, held.fail_repos) == (nxt, rec, False,
                                                                             None)
    # what told a changed log before still tells it, held or not
    assert decide(LogRecord("e", 9, ""), 0, 20, NOT_FETCHED, E, held=True).fail_repos
    assert decide(LogRecord("e", 9, ""), 12, 20, NOT_FETCHED, E, held=True).fail_repos
    # an anchored log is judged by its anchor, held or not
    assert not decide(LogRecord("e", -1, "", (3, "fp")), 0, 10, "fp", E).fail_repos


def test_an_anchor_lost_right_after_its_ack_is_a_reset_not_a_log_known_by_nothing() -> None:
    """Found by review: the anchor acknowledged at offset 2, the topic re-created before the
    tracker fetched it back (the new log ends at 1). Kept as written, the next decision sees a
    log shorter than its anchor; taken from the fetch, it would have been "no anchor" and the
    old log's unapplied records lost unnoticed."""
    from tracker.logid import anchored, fingerprint_of

    fp = fingerprint_of(b"k", b"v", 1_700_000_000_000)
    rec, disagrees = anchored(LogRecord("e", -1, ""), 2, fp, None)
    assert disagrees and rec.anchor == (2, fp)
    d = decide(rec, 0, 1, NOT_FETCHED, E)
    assert d.reset and d.fail_repos
    assert anchored(LogRecord("e", -1, ""), 2, fp, fp) == (LogRecord("e", -1, "", (2, fp)), False)


def test_only_the_exact_anchor_record_is_taken_for_one() -> None:
    from tracker.logid import ANCHOR_KEY, anchor_value, is_anchor, new_epoch

    assert is_anchor(Rec(anchor_value(new_epoch("c")), ANCHOR_KEY))
    assert is_anchor(Rec(anchor_value(new_epoch()), ANCHOR_KEY))
    # the key alone is not enough: a malformed event keyed so is dead-lettered and held
    for value in (b'{"type": "object_written"}', anchor_value("e") + b" s3://b/r/x", None):
        assert not is_anchor(Rec(value, ANCHOR_KEY)), value
    assert not is_anchor(Rec(anchor_value("e"), b"repo0"))


def test_a_log_that_retention_took_the_last_applied_record_of_is_anchored_again() -> None:
    d = decide(LogRecord("e", 9, "fp"), 10, 30, NOT_FETCHED, E)
    assert (d.seek, d.reset, d.fail_repos) == (10, False, None)
    assert d.record == LogRecord("e", 9, "") and d.record.witness is None  # the tracker anchors


@given(st.integers(-1, 50), st.integers(0, 60), st.integers(0, 80), st.integers(0, 80),
       st.booleans())
def test_a_record_without_a_fingerprint_never_skips_a_record_of_another_log(
        offset: int, start: int, end: int, anchor_at: int, same: bool) -> None:
    """Whatever the log looks like now: either the decision fails the repositories closed, or
    it resumes at the record's next offset of a log that may be the same one (its start not
    lower, the anchor found where it was written), never past a record of a log it cannot
    tell."""
    end = max(end, start)
    anchor = (offset + 1 + anchor_at, "fp")
    rec = LogRecord("e", offset, "", anchor)
    found = ("fp" if same else "x") if start <= anchor[0] < end else NOT_FETCHED
    d = decide(rec, start, end, found, E)
    if d.fail_repos or d.fail_all:
        assert d.seek == start
        return
    assert d.seek == offset + 1 and start == offset + 1 and same and anchor[0] < end
