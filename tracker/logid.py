"""Log identity and continuity (SPEC safety 10): which log Redis is a fold of, and up to where.

Kafka (and Tansu) reuse offsets when a topic is re-created or a broker loses its log, and aiokafka
cannot see topic ids (its metadata requests predate them). So the identity of a partition's log
is an **epoch** (a random id the tracker mints when it first sees the log, or sees that it
changed) plus the **fingerprint** of the last record applied from it (a hash of its key, value
and timestamp: records of another log differ at the same offset). ``hd:log`` holds, per topic and
partition, ``<epoch>:<offset>:<fingerprint>``; every repository's ``applied`` offset is recorded
with its epoch by ``apply.lua``, so offsets of an old log never skip records of a new one.

A record with nothing applied behind it (a fresh log, or one whose unapplied head retention
took) has no fingerprint, and a topic re-created on the same cluster would pass for it. So the
tracker writes an **anchor** into such a log (a marker record it ignores when applying) and
keeps the marker's offset and fingerprint in the record (``<epoch>:<offset>:@<at>.<fp>``): the
log is known by the anchor until a record applied after it gives the fingerprint. A log the
broker refused the anchor for is known by nothing: only the tracker that recorded it, holding
it since, may go on with it (and anchor it again); any other verification fails it closed.

On assignment the tracker resumes from what Redis says it applied (not from the group's offsets),
so a Redis that went back in time is repaired by replay; :func:`decide` is the pure rule for
what it finds. Where replay cannot restore what Redis lacks, the affected repositories (or all,
when they cannot be known) are put fail-closed.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LogRecord:
    """What the tracker applied from one partition's log: everything up to ``offset``."""

    epoch: str
    offset: int  # -1: nothing applied yet
    fingerprint: str  # of the record at offset ("" when unknown)
    anchor: tuple[int, str] | None = None  # (offset, fingerprint) of this log's anchor record

    def encode(self) -> str:
        if self.fingerprint or self.anchor is None:
            return f"{self.epoch}:{self.offset}:{self.fingerprint}"
        return f"{self.epoch}:{self.offset}:@{self.anchor[0]}.{self.anchor[1]}"

    @staticmethod
    def decode(value: str | None) -> LogRecord | None:
        if not value:
            return None
        try:
            epoch, offset, fp = value.split(":", 2)
            if fp.startswith("@"):
                at, dot, afp = fp[1:].partition(".")
                if not dot or not afp:
                    return None
                return LogRecord(epoch, int(offset), "", (int(at), afp))
            return LogRecord(epoch, int(offset), fp)
        except ValueError:
            return None  # unreadable: treated as no record (fail-closed rules apply)

    @property
    def witness(self) -> tuple[int, str] | None:
        """(offset, fingerprint) of the record that tells this log from another: the last one
        applied, else the anchor; None when there is neither."""
        if self.fingerprint:
            return self.offset, self.fingerprint
        return self.anchor


# The anchor: a record the tracker writes into a log it knows by no fingerprint. Its key is no
# repository's (the NUL byte), so no event can be taken for it, nor it for an event.
ANCHOR_KEY = b"\x00hardelete:log-anchor"


_ANCHOR_VALUE = re.compile(rb"hardelete log anchor of epoch [0-9a-f-]{1,64}")


def anchor_value(epoch: str) -> bytes:
    return f"hardelete log anchor of epoch {epoch}".encode()


def is_anchor(record: Any) -> bool:
    """The tracker's own marker: its key *and* its exact value (a record that merely has the
    key names what it names: it is dead-lettered and held like any other; found by review)."""
    return bool(record.key == ANCHOR_KEY and record.value is not None
                and _ANCHOR_VALUE.fullmatch(record.value))


def anchored(record: LogRecord, offset: int, fp: str, found_fp: str | None
             ) -> tuple[LogRecord, bool]:
    """``record`` known by the anchor the broker acknowledged at ``offset``; ``fp`` is its
    fingerprint from what was sent and the timestamp the broker stored, ``found_fp`` what a fetch
    there returned right after. It is always kept as written: a log that no longer holds it is
    another one, and the next decision says so. True: the log disagrees already (verify again
    at once)."""
    return LogRecord(record.epoch, record.offset, "", (offset, fp)), found_fp != fp


def cluster_tag(cluster: str) -> str:
    """A short tag of the broker's cluster id (Kafka formats a new one with a lost disk)."""
    return hashlib.blake2b(cluster.encode(), digest_size=4).hexdigest()


def new_epoch(cluster: str | None = None) -> str:
    """A fresh epoch; with the broker's cluster id it starts with its tag (``<tag>-<random>``),
    so a log that was replaced is told even when nothing of it was applied yet."""
    rnd = uuid.uuid4().hex[:16]
    return f"{cluster_tag(cluster)}-{rnd}" if cluster else rnd


def epoch_cluster(epoch: str) -> str | None:
    """The cluster tag an epoch was minted under (None: minted without one)."""
    tag, sep, _ = epoch.partition("-")
    return tag if sep and len(tag) == 8 else None


def log_field(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def gone_partitions(fields: Iterable[str], topic: str, partitions: Collection[int]) -> list[int]:
    """Partitions ``hd:log`` has a record for that the topic no longer has. A topic re-created
    with fewer partitions (a broker that lost its disk auto-creates it with its default count)
    moves their repositories to other partitions: what was published to the gone ones and never
    applied is lost, and no assignment will ever check them again."""
    prefix = f"{topic}:"
    out = []
    for f in fields:
        if f.startswith(prefix) and f[len(prefix):].isdigit():
            p = int(f[len(prefix):])
            if p not in partitions:
                out.append(p)
    return sorted(out)


def fingerprint(record: Any) -> str:
    """Of one consumer record: key, value and broker timestamp (cheap; once per partition and
    batch)."""
    return fingerprint_of(record.key, record.value, record.timestamp)


def fingerprint_of(key: bytes | None, value: bytes | None, timestamp: int) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(key or b"\x00")
    h.update(b"\x01")
    h.update(value or b"\x00")
    h.update(str(timestamp).encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do with one partition on assignment."""

    seek: int  # the next offset to consume
    record: LogRecord  # the log record to keep (a new epoch when the log changed)
    reset: bool  # the log changed: a new epoch, the partition's progress is dropped
    fail_repos: str | None = None  # reason: the repositories of this partition are fail-closed
    fail_all: str | None = None  # reason: every repository is fail-closed (unknown which)
    detail: str = ""


NOT_FETCHED = "\x00not fetched"


def decide(rec: LogRecord | None, start: int, end: int, found_fp: str | None,
           epoch: str, *, group_committed: bool = False, cluster: str | None = None,
           held: bool = False) -> Decision:
    """The rule for one partition.

    rec: Redis' log record (None: Redis has none). start/end: the log's first offset and high
    watermark now. found_fp: the fingerprint of the record at the offset of ``rec.witness`` as
    fetched now (None: no such record; :data:`NOT_FETCHED` when the offset is outside [start,
    end)). epoch: a fresh
    epoch to use if the log changed. group_committed: the consumer group has committed offsets.
    cluster: the broker's cluster id now (None: unknown). held: this tracker wrote ``rec``
    itself and has held (and consumed) the partition without a break since (its re-check of a
    log it could not anchor); False whenever the log may have gone unwatched.
    """
    if rec is None:
        fresh = LogRecord(epoch, start - 1, "")
        if start > 0:
            why = ("Redis has no record of what was applied and the log no longer starts at 0 "
                   f"(first offset {start}): what it lacks cannot be replayed")
            return Decision(start, fresh, True, fail_all=why, detail=why)
        detail = ("Redis has no record of what was applied; the group has committed offsets: "
                  "replaying the whole log" if group_committed else "new log")
        return Decision(0, fresh, True, detail=detail)
    known = epoch_cluster(rec.epoch)
    if cluster is not None and known is not None and known != cluster_tag(cluster):
        # Another broker cluster (a lost disk formatted anew): the log Redis folded is gone,
        # with whatever of it was not applied yet; with nothing applied from it (offset -1)
        # there is no record to compare, so the identity is what tells.
        why = (f"log reset or replaced: the broker's cluster changed since epoch {rec.epoch} "
               f"(offset {rec.offset} applied)")
        return Decision(start, LogRecord(epoch, start - 1, ""), True, fail_repos=why, detail=why)
    nxt = rec.offset + 1
    if end < nxt:
        why = (f"log reset or re-created: it ends at {end} but offset {rec.offset} of epoch "
               f"{rec.epoch} was applied")
        return Decision(start, LogRecord(epoch, start - 1, ""), True, fail_repos=why, detail=why)
    if start > nxt:
        why = (f"the log starts at {start}: offsets {nxt}..{start - 1}, which Redis never "
               "applied, are gone (retention)")
        return Decision(start, LogRecord(rec.epoch, start - 1, ""), False, fail_repos=why,
                        detail=why)
    if not rec.fingerprint:
        return _by_anchor(rec, start, end, found_fp, epoch, held)
    if rec.offset < start:
        # Retention took the record last applied (the log starts right after it): nothing
        # left to compare, so the tracker anchors the log again.
        return Decision(nxt, LogRecord(rec.epoch, rec.offset, ""), False,
                        detail="resumed (the record last applied is gone by retention)")
    if found_fp == NOT_FETCHED:
        return Decision(nxt, rec, False, detail="resumed (no record to compare)")
    if found_fp != rec.fingerprint:
        why = (f"log reset or re-created: the record at offset {rec.offset} is not the one "
               f"applied (epoch {rec.epoch})")
        return Decision(start, LogRecord(epoch, start - 1, ""), True, fail_repos=why, detail=why)
    return Decision(nxt, rec, False, detail="resumed")


def _by_anchor(rec: LogRecord, start: int, end: int, found_fp: str | None,
               epoch: str, held: bool = False) -> Decision:
    """A record with no fingerprint (nothing applied since the log started at ``offset + 1``):
    the log's start, which never goes back within one log, and the anchor record tell."""
    nxt = rec.offset + 1
    reset = LogRecord(epoch, start - 1, "")
    if start < nxt:
        why = (f"log reset or re-created: it starts at {start}, but epoch {rec.epoch} recorded a "
               f"log that started at {nxt}")
        return Decision(start, reset, True, fail_repos=why, detail=why)
    if rec.anchor is None:
        # Written by a tracker that could not anchor (the broker refused the marker). Nothing
        # tells this log from one reset on the same cluster since (a partition's directory
        # lost, an unclean leader election, the topic re-created): records published to the
        # old one and not applied would be lost unnoticed. The tracker that wrote it, holding
        # the partition since, applied what the log took as it came (the first record applied
        # gives the fingerprint) and anchors again now. Any other one (a restart, a rebalance)
        # cannot know what the log held while nobody watched it: fail closed (found by review:
        # a repository keyed to a partition added under a broker that refused the anchor lost
        # a copy with that partition's log while the tracker was down; nothing was failed
        # closed and the reaper deleted the copied object).
        if held:
            return Decision(nxt, rec, False, detail="resumed (not anchored yet; held since)")
        why = (f"log unproven: epoch {rec.epoch} was recorded with nothing applied from it and "
               "no anchor (the broker refused it), and the log went unwatched since: a log "
               "reset on the same cluster cannot be told from it")
        return Decision(start, reset, True, fail_repos=why, detail=why)
    at, fp = rec.anchor
    if end <= at:
        why = (f"log reset or re-created: it ends at {end}, before the anchor record at offset "
               f"{at} of epoch {rec.epoch}")
        return Decision(start, reset, True, fail_repos=why, detail=why)
    if found_fp != fp:
        why = (f"log reset or re-created: the record at offset {at} is not the anchor of epoch "
               f"{rec.epoch}")
        return Decision(start, reset, True, fail_repos=why, detail=why)
    return Decision(nxt, rec, False, detail="resumed (anchor matches)")
