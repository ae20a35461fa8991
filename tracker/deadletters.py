"""Dead letters, one part of the tracker: a record that cannot be applied goes to the
dead-letter topic with its reason, acknowledged before the batch's offsets are committed, and
the addresses it names are held (SPEC safety 10) until an operator resolves it.

Each dead letter is signed (``schemas/reaper_auth.py``, the key publishers never hold) over its
claim, origin, reason, the digest of its key and value as written and the (repository, target)
pairs held for it: ``dlq resolve`` lifts only what a dead letter the tracker wrote held."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka.errors import MessageSizeTooLargeError

from core.clients import redis_sync, s3_client
from core.continuity import SEQ_MAX
from core.facts import HOLD_ADD, RepoFacts
from core.registry import arepo_namespace
from schemas.holds import aadd_claims, claims_of
from schemas.layout import DEAD_SEQS_MAX, STRIPES_MAX, RepoKeys
from schemas.reaper_auth import DeadLetterFields, key_id, record_digest, seal_dead_letter
from tracker.shared import TrackerShared

# A note is added while the repository keeps fewer than DEAD_SEQS_MAX (or replaces its own):
# seqs come from the record, so a writer of the events topic could make up any number.
_NOTE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
    or redis.call('HLEN', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return 1
end
return 0
"""


async def anote_dead_seqs(redis: Any, notes: Sequence[tuple[str, str, str]]) -> int:
    """Write ``(key, '<k>:<seq>', json)`` notes of dead-lettered seqs, bounded per repository;
    returns how many were kept."""
    pipe = redis.pipeline(transaction=False)
    for key, field, value in notes:
        pipe.eval(_NOTE, 1, key, field, value, DEAD_SEQS_MAX)
    return sum(int(n) for n in await pipe.execute())


_DLQ_MAX_VALUE = 900_000  # bytes of a dead-lettered value (the producer's request limit is 1 MB)
_DLQ_MAX_KEY = 1_024
MAX_REASON = 1_000


def reason_kind(reason: str) -> str:
    for kind in ("not valid JSON", "unknown event type", "schema version", "unknown repository",
                 "record key", "must be", "missing", "expected", "outside namespace", "reserved",
                 "already exists", "namespace overlap", "retired", "not canonical"):
        if kind in reason:
            return kind.replace(" ", "_")
    return "other"


def short_key(key: bytes | None) -> str:
    if key is None:
        return "null"
    return repr(key[:200]) + ("..." if len(key) > 200 else "")


def event_id_of(value: bytes | None) -> str:
    try:
        body = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return ""
    eid = body.get("event_id") if type(body) is dict else None
    return eid[:200] if type(eid) is str else ""


def sequenced_of(value: bytes | None) -> tuple[str, int, int] | None:
    """(repository, stripe, seq) of a dead-lettered record that carries a seq, read leniently
    (the record was refused: only these three fields are trusted, for status to say which
    dead letter a missing seq waits on)."""
    try:
        body = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    if type(body) is not dict:
        return None
    repo, seq, stripe = body.get("repository"), body.get("seq"), body.get("stripe", 0)
    if type(repo) is not str or not repo or type(seq) is not int or type(stripe) is not int:
        return None
    if not (1 <= seq <= SEQ_MAX and 0 <= stripe < STRIPES_MAX):
        return None
    return repo, stripe, seq


@dataclass(frozen=True)
class DeadLetterClaim:
    """The claim a dead letter's holds carry and the (repository, target) pairs held."""

    claim: str
    held: tuple[tuple[str, str], ...]


def dlq_message(rec: Any, reason: str, max_value: int = _DLQ_MAX_VALUE,
                claim: str | None = None, held: Sequence[tuple[str, str]] = (),
                signing_key: bytes | None = None,
                ) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) of the dead-letter record for ``rec``: its value and key cut to
    fit the topic, with the reason, the id of the claim its holds carry (``dlq resolve``
    removes exactly that one), when cut the original sizes, and with ``signing_key`` what it
    held (``held``) and the tracker's signature over all of that."""
    value = rec.value if rec.value is not None else b""
    key = rec.key
    headers = [("reason", reason.encode()), ("topic", rec.topic.encode()),
               ("partition", str(rec.partition).encode()),
               ("offset", str(rec.offset).encode())]
    if claim is not None:
        headers.append(("claim", claim.encode()))
    if len(value) > max_value:
        headers += [("truncated", b"value"), ("original_size", str(len(value)).encode())]
        value = value[:max_value]
    if key is not None and len(key) > _DLQ_MAX_KEY:
        headers += [("original_key_size", str(len(key)).encode())]
        key = key[:_DLQ_MAX_KEY]
    if signing_key is not None and claim is not None:
        pairs = tuple(sorted(set(held)))
        fields = DeadLetterFields(claim, rec.topic, str(rec.partition), str(rec.offset), reason,
                                  record_digest(key, value), pairs)
        headers += [("held", orjson.dumps([list(p) for p in pairs])),
                    ("signature", seal_dead_letter(signing_key, fields).encode()),
                    ("signed_by", key_id(signing_key).encode())]
    return key, value, headers


class DeadLetters(TrackerShared):
    """Publish dead letters (with backoff, never dropped) and place their holds."""

    async def _dead_letter(self, items: list[tuple[Any, str]],
                           claims: dict[int, DeadLetterClaim] | None = None) -> None:
        """Every item is acknowledged by the dead-letter topic before the offsets are committed;
        a failing publish is retried with backoff (never dropped, never stops the tracker for
        good: only a requested stop ends the retries, and then nothing is committed)."""
        await asyncio.gather(*(self._dead_letter_one(rec, reason, (claims or {}).get(id(rec)))
                               for rec, reason in items))
        self.dead_lettered += len(items)
        await self._note_dead_seqs(items)

    async def _note_dead_seqs(self, items: list[tuple[Any, str]]) -> None:
        """A dead-lettered event with a seq leaves that seq missing, so its repository's
        horizon waits (safe): note which dead letter it is, for ``status`` (informational;
        only for repositories this tracker tracks)."""
        notes = []
        for rec, reason in items:
            seqd = sequenced_of(rec.value)
            if seqd is not None and seqd[0] in self.gate.namespaces:
                repo, stripe, seq = seqd
                notes.append((RepoKeys(repo).dead_seqs, f"{stripe}:{seq}", orjson.dumps({
                    "dlq": f"{rec.partition}:{rec.offset}", "reason": reason[:200],
                    "event_id": event_id_of(rec.value)}).decode()))
        if not notes:
            return

        await self._retrying(lambda: anote_dead_seqs(self._redis, notes))

    async def _dead_letter_one(self, rec: Any, reason: str,
                               claim: DeadLetterClaim | None = None) -> None:
        assert self._producer is not None
        limit, delay = _DLQ_MAX_VALUE, 0.1
        reason = reason[:MAX_REASON]
        while True:
            key, value, headers = dlq_message(
                rec, reason, limit, claim.claim if claim else None,
                claim.held if claim else (), self._reap_key)
            try:
                fut = await self._producer.send(self.settings.dlq_topic, value=value, key=key,
                                                headers=headers)
                await fut
                break
            except MessageSizeTooLargeError:
                if limit <= 1024:
                    raise
                limit //= 4  # a broker with a smaller limit: cut further
                continue
            except Exception as exc:
                if self._stop.is_set():
                    raise RuntimeError("dead-letter topic unavailable while stopping; the batch "
                                       "is not committed and will be redelivered") from exc
                self.log.warning("dead-letter publish failed; retrying", error=str(exc),
                                 partition=rec.partition, offset=rec.offset)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.log.warning("dead-lettered event", reason=reason, partition=rec.partition,
                         offset=rec.offset)
        self.metrics.dlq.labels(reason_kind(reason)).inc()

    async def _record_holds(self, repo: str, name: str, items: list[list[Any]]) -> None:
        """The claims go into the repository's fact log (core/facts.py), which applies them to
        Redis, so a Redis that goes back cannot forget them. A fact log that cannot take them
        (no such bucket, S3 down) leaves them in Redis only, as an error: the tracker is not
        stopped by S3 (the delete paths of a repository whose fact log cannot be read delete
        nothing anyway). Durable first: a claim found in Redis was then made durable, or
        logged as not, so a retry (a reply lost after the claim reached Redis) or a
        redelivery that finds it need not write it again."""
        k = RepoKeys(repo)
        key = k.hold_prefixes if name == "hold_prefixes" else k.holds
        # A redelivered dead letter whose claims the copy holds is not written again.
        present = await self._redis.hmget(key, [t for t, _, _ in items])
        new = [it for it, raw in zip(items, present, strict=True)
               if raw is None or it[1] not in claims_of(raw)]
        if not new:
            return
        namespace = await arepo_namespace(self._redis, repo)
        if namespace:  # (no namespace: no home to write to)
            if self._facts_clients is None:
                self._facts_clients = (redis_sync(self.settings), s3_client(self.settings))
            r, s3 = self._facts_clients
            try:
                await asyncio.to_thread(
                    RepoFacts(r, s3, repo, namespace).record, HOLD_ADD,
                    {"hash": name, "replace": False, "items": new},
                    by=f"tracker {self.name}", now_ms=int(time.time() * 1000))
                return
            except Exception as exc:
                self.metrics.facts_failed.inc()
                self.log.error("dead-letter hold kept in Redis only, owed to its fact log "
                               "(the next proof writes it)", repository=repo,
                               error=f"{type(exc).__name__}: {exc}"[:500])
                await asyncio.to_thread(RepoFacts(r, s3, repo, namespace).owe, name, new)
                return
        await aadd_claims(self._redis, key, [(t, c, v) for t, c, v in new])

    async def _write_holds(self, holds: list[tuple[str, str, bool, str, dict[str, Any]]]
                           ) -> None:
        """Each repository's dead-letter claims are a durable fact of it (core/facts.py),
        written to its namespace before Redis, so a Redis that goes back cannot forget them."""
        by_hash: dict[tuple[str, str], list[list[Any]]] = defaultdict(list)
        for repo, address, prefix, claim_id, claim in holds:
            by_hash[(repo, "hold_prefixes" if prefix else "holds")].append(
                [address, claim_id, claim])

        async def write() -> None:  # idempotent: a redelivered dead letter has the same claim
            for (repo, name), items in by_hash.items():
                await self._record_holds(repo, name, items)
        await self._retrying(write)
        self.holds += len(holds)
        for repo, address, _, _, _ in holds:
            self.log.warning("hold placed on an address named by a dead-lettered event",
                             repository=repo, address=address[:500])
