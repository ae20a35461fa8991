"""The dead-letter topic from the CLI: ``hardelete dlq list|show|replay|resolve``.

The tracker dead-letters a record it cannot apply (tracker/daemon.py ``_dead_letter``): the value
as it was (possibly truncated), the record key, and headers ``reason``, ``topic``, ``partition``,
``offset`` (where the event was in the events topic; ``original_size`` and ``truncated`` when it
was cut). A dead letter is named here by its place in the dead-letter topic, ``PARTITION:OFFSET``.

- list/show read the topic from its beginning to its high watermark (no consumer group: reading
  never moves anyone's offsets).
- replay publishes a fixed event (a file, or stdin) to the events topic, keyed by its repository,
  after the same validation the tracker applies; the original dead letter stays for the record.
- resolve removes this dead letter's claim (``dlq:<topic>:<partition>:<offset>`` of its origin,
  ``schemas/holds.py``) from every hold the tracker placed for it, once the operator has
  replayed or judged it: a hold that another dead letter (or an operator, or a restore) still
  claims stays. A hold stored before holds had claims is only lifted by
  ``hardelete hold remove --force``; resolve names those it finds on the event's addresses.

Any publisher can write the dead-letter topic, so resolve acts only on a dead letter the tracker
signed (``schemas/reaper_auth.py``: its claim, origin, reason, the digest of its key and value
and the (repository, target) pairs it held, under the key publishers never hold), and lifts
its claim only from those pairs. An unsigned dead letter (forged, or written before the tracker
signed them), a wrong signature, or one signed under a key Redis no longer has (re-minted after
Redis went back) is refused, nothing lifted: an operator who judged the event lifts its holds
with ``hardelete hold remove --force TARGET``. list and show mark such dead letters.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from core.clients import topic_partitions
from core.errors import UserError
from core.facts import HOLD_REMOVE
from core.settings import Settings
from hardelete.cli import non_negative
from hardelete.holds import Hold, list_holds, operator_s3, record
from schemas.holds import LEGACY_CLAIM, Removal, dlq_claim
from schemas.holds import remove as removal_of
from schemas.layout import REFUSED, RepoKeys
from schemas.reaper_auth import DeadLetterFields, dead_letter_problem, load_key, record_digest

ADDRESS_KEYS = ("address", "replaces_address")
READ_TIMEOUT_S = 20.0


@dataclass
class DeadLetter:
    id: str  # "partition:offset" in the dead-letter topic
    timestamp_ms: int
    reason: str
    origin_topic: str | None
    origin_partition: int | None
    origin_offset: int | None
    key: str | None
    size: int
    value: bytes = field(repr=False)
    headers: dict[str, str] = field(default_factory=dict)
    raw_key: bytes | None = field(default=None, repr=False)
    # why it is not known to be the tracker's (None: its signature verified); see verify_all
    unverified: str | None = "not checked"

    @property
    def body(self) -> dict[str, Any] | None:
        try:
            body = orjson.loads(self.value)
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None

    @property
    def repository(self) -> str | None:
        body = self.body
        repo = body.get("repository") if body else None
        if isinstance(repo, str):
            return repo
        return self.key

    @property
    def event_type(self) -> str | None:
        body = self.body
        etype = body.get("type") if body else None
        return etype if isinstance(etype, str) else None

    def addresses(self) -> list[str]:
        """The s3:// addresses the event names (none when its value is not a JSON object)."""
        body = self.body or {}
        return sorted({v for k in ADDRESS_KEYS if isinstance(v := body.get(k), str)
                       and v.startswith("s3://")})

    @property
    def claim(self) -> str | None:
        """The claim id its holds carry: the tracker's ``claim`` header, else (dead letters
        written before it) the origin's (None without the origin headers)."""
        if self.headers.get("claim"):
            return str(self.headers["claim"])
        if self.origin_topic is None or self.origin_partition is None \
                or self.origin_offset is None:
            return None
        return dlq_claim(self.origin_topic, self.origin_partition, self.origin_offset)

    def held(self) -> tuple[tuple[str, str], ...] | None:
        """The (repository, target) pairs the tracker held for it (its ``held`` header), or
        None when it has none or it is unreadable."""
        try:
            pairs = orjson.loads(self.headers.get("held", ""))
        except orjson.JSONDecodeError:
            return None
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in pairs):
            return None
        return tuple((p[0], p[1]) for p in pairs)

    def seal_problem(self, key: bytes | None) -> str | None:
        """Why this is not a dead letter the tracker wrote (signed under ``key``), or None."""
        h = self.headers
        held = self.held()
        if h.get("signature") and (held is None or not h.get("claim")):
            return "its signature does not verify (its claim or held header is unreadable)"
        fields = DeadLetterFields(
            h.get("claim", ""), h.get("topic", ""), h.get("partition", ""), h.get("offset", ""),
            h.get("reason", ""), record_digest(self.raw_key, self.value), held or ())
        return dead_letter_problem(key, fields, h.get("signature"), h.get("signed_by"))

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "time": _iso(self.timestamp_ms), "reason": self.reason,
                "repository": self.repository, "type": self.event_type, "size": self.size,
                "origin": {"topic": self.origin_topic, "partition": self.origin_partition,
                           "offset": self.origin_offset},
                "verified": self.unverified is None, "unverified": self.unverified,
                "headers": self.headers, "addresses": self.addresses()}


def _iso(ms: int | None) -> str:
    if ms is None or ms < 0:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _size(d: DeadLetter) -> str:
    original = d.headers.get("original_size")
    return f"{d.size} of {original} (truncated)" if original else str(d.size)


def from_record(rec: Any) -> DeadLetter:
    headers = {k: (v.decode(errors="replace") if isinstance(v, bytes) else str(v))
               for k, v in (rec.headers or ())}
    value = rec.value or b""
    return DeadLetter(
        id=f"{rec.partition}:{rec.offset}", timestamp_ms=int(rec.timestamp or -1),
        reason=headers.get("reason", "?"), origin_topic=headers.get("topic"),
        origin_partition=_int(headers.get("partition")),
        origin_offset=_int(headers.get("offset")),
        key=rec.key.decode(errors="replace") if rec.key else None,
        size=len(value), value=value, headers=headers, raw_key=rec.key)


def verify_all(settings: Settings, letters: list[DeadLetter]) -> None:
    """Mark each dead letter verified or not (``unverified``), under the tracker's key."""
    if not letters:
        return
    why = None
    key = None
    if settings.reaper_secret:
        key = settings.reaper_secret.encode()
    elif not settings.redis_url:
        why = "cannot be verified: no redis_url to read the tracker's key from"
    else:
        from core.clients import redis_sync

        r = redis_sync(settings)
        try:
            key = load_key(r)
        except Exception as exc:  # list/show still work without Redis; nothing is trusted
            why = f"cannot be verified: Redis unreachable ({type(exc).__name__})"
        finally:
            r.close()
    for d in letters:
        d.unverified = why or d.seal_problem(key)


def parse_id(text: str) -> tuple[int, int]:
    p, sep, o = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(p), int(o)
    except ValueError:
        raise UserError(f"a dead letter is named PARTITION:OFFSET (see `hardelete dlq list`), "
                        f"got {text!r}") from None


def _consumer(settings: Settings) -> Any:
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=None,
                            enable_auto_commit=False, request_timeout_ms=10_000,
                            client_id="hardelete-dlq")


async def _partitions(consumer: Any, topic: str) -> list[Any]:
    return await topic_partitions(consumer, topic)


async def _ends(consumer: Any, tps: list[Any]) -> tuple[dict[Any, int], dict[Any, int]]:
    """(first, end) offsets per partition, from ListOffsets (the end is the high watermark).
    (A fetch's high watermark was read too while the embedded broker was Tansu, whose
    ListOffsets answered the last batch's base offset + 1.)"""
    starts = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    return ({tp: int(o) for tp, o in starts.items()}, {tp: int(o) for tp, o in ends.items()})


async def counts(settings: Settings) -> tuple[int, int]:
    """(high-watermark sum, records still retained) of the dead-letter topic."""
    consumer = _consumer(settings)
    await consumer.start()
    try:
        tps = await _partitions(consumer, settings.dlq_topic)
        if not tps:
            return 0, 0
        starts, ends = await _ends(consumer, tps)
        return sum(ends.values()), sum(ends[tp] - starts[tp] for tp in tps)
    finally:
        await consumer.stop()


async def read(settings: Settings, only: tuple[int, int] | None = None) -> list[DeadLetter]:
    """Every retained dead letter (or the one named), oldest first per partition."""
    consumer = _consumer(settings)
    await consumer.start()
    try:
        tps = await _partitions(consumer, settings.dlq_topic)
        if only is not None:
            tps = [tp for tp in tps if tp.partition == only[0]]
            if not tps:
                raise UserError(f"no partition {only[0]} in {settings.dlq_topic}")
        if not tps:
            return []
        starts, ends = await _ends(consumer, tps)
        consumer.assign(tps)
        wanted = {}
        for tp in tps:
            if only is not None:
                if not starts[tp] <= only[1] < ends[tp]:
                    raise UserError(f"no dead letter {only[0]}:{only[1]} in {settings.dlq_topic} "
                                    f"(retained: {starts[tp]}..{ends[tp] - 1})")
                consumer.seek(tp, only[1])
                wanted[tp] = only[1] + 1
            else:
                consumer.seek(tp, starts[tp])
                wanted[tp] = ends[tp]
        out: list[DeadLetter] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READ_TIMEOUT_S
        pending = {tp for tp in tps if wanted[tp] > (only[1] if only else starts[tp])}
        while pending:
            if loop.time() > deadline:
                raise UserError(f"reading {settings.dlq_topic} timed out after "
                                f"{READ_TIMEOUT_S:g}s")
            batch = await consumer.getmany(*pending, timeout_ms=500)
            for tp, records in batch.items():
                out += [from_record(rec) for rec in records if rec.offset < wanted[tp]]
            for tp in list(pending):
                if await consumer.position(tp) >= wanted[tp]:
                    pending.discard(tp)
        return out
    finally:
        await consumer.stop()


async def read_one(settings: Settings, ident: str) -> DeadLetter:
    found = await read(settings, parse_id(ident))
    if not found:
        raise UserError(f"no dead letter {ident} in {settings.dlq_topic}")
    return found[0]


def validate_fixed(data: bytes) -> Any:
    """The fixed event as the tracker will see it; a clear error instead of a new dead letter."""
    from schemas.events import EventError, decode

    try:
        return decode(data)
    except EventError as exc:
        raise UserError(f"the fixed event is still invalid: {exc}") from None


async def publish_fixed(settings: Settings, data: bytes) -> Any:
    from schemas.publisher import Publisher

    event = validate_fixed(data)
    if event.TYPE == "repository_created":
        # The tracker's refusal of this event is final (hd:refused) for every redelivery; an
        # operator's replay asks it to judge the event again.
        from core.clients import redis_async

        r = redis_async(settings)
        try:
            await r.hdel(REFUSED, event.event_id)
        finally:
            await r.aclose()
    async with Publisher(settings) as pub:
        await pub.publish_raw(data, event.key)
    return event


def holds_of(r: Any, dl: DeadLetter) -> list[Hold]:
    """The holds (address and prefix, any repository) that this dead letter claims."""
    claim = dl.claim
    if claim is None:
        return []
    return [h for h in list_holds(r) if claim in h.claims]


def unverified_line(r: Any, dl: DeadLetter, problem: str) -> str:
    """The one line a refused resolve says: why, and what an operator does instead."""
    named = sorted({f"{h.target} in {h.repository}" for h in holds_of(r, dl)})
    which = (f" (holds carrying its claim: {', '.join(named[:5])}"
             + (f" and {len(named) - 5} more" if len(named) > 5 else "") + ")") if named else ""
    return (f"dead letter {dl.id} is not verified as the tracker's: {problem}; nothing was "
            f"lifted. Check the event (`hardelete dlq show {dl.id}`); an operator lifts a hold "
            f"it must not keep with `hardelete hold remove --force TARGET`{which}")


def legacy_holds(r: Any, dl: DeadLetter) -> list[Hold]:
    """Holds stored before holds had claims on an address the event names: nobody can tell
    which dead letter placed them, so only ``hold remove --force`` lifts them."""
    named = set(dl.addresses())
    return [h for h in list_holds(r) if LEGACY_CLAIM in h.claims and h.target in named]


def resolve(r: Any, dl: DeadLetter, *, s3: Any, wait_s: float = 0.0,
            secret: str = "") -> list[tuple[Hold, Removal]]:
    """Remove this dead letter's claim from each hold it claims among those the tracker held
    for it (atomically per hold: a claim another dead letter adds meanwhile stays).

    Only a dead letter the tracker signed (under ``secret``, else the key in Redis): any
    other is refused with a :class:`UserError`, nothing lifted.

    Only once the tracker has applied everything published before now (its horizon, waited for
    up to ``wait_s``): the fix replayed a moment ago is then in the mirror. Lifting the hold
    first left the address judged on a record without the replayed reference (found by an
    adversarial review); a :class:`UserError` says so and nothing is lifted. Each removal is a
    durable fact of the hold's repository (``core/facts.py``; ``s3`` writes it)."""
    from core.clock import redis_time_ms, tracker_horizon_ms

    problem = dl.seal_problem(load_key(r, secret))
    if problem is not None:
        raise UserError(unverified_line(r, dl, problem))
    held = set(dl.held() or ())
    now = redis_time_ms(r)
    deadline = time.monotonic() + wait_s
    while (horizon := tracker_horizon_ms(r)) is None or horizon < now:
        if time.monotonic() >= deadline:
            behind = "has no horizon" if horizon is None else \
                f"is {(now - horizon) / 1000:.1f} s behind"
            raise UserError(f"the tracker {behind}: a fix replayed before now may not be "
                            "applied yet, so nothing was lifted; resolve again once the tracker "
                            "has caught up (`hardelete status`), or give it longer (--wait)")
        time.sleep(0.1)
    claim = dl.claim
    out = []
    for h in holds_of(r, dl):
        if (h.repository, h.target) not in held:
            continue  # not what the tracker held for it
        k = RepoKeys(h.repository)
        ids = [claim] if claim else []
        removal, _ = removal_of(r.hget(k.hold_prefixes if h.kind == "prefix" else k.holds,
                                       h.target), ids)
        if removal.removed:
            record(r, s3, h.repository, HOLD_REMOVE, {
                "hash": "hold_prefixes" if h.kind == "prefix" else "holds", "target": h.target,
                "claim_ids": ids, "force": False}, now)
            out.append((h, removal))
    return out


# --- CLI -----------------------------------------------------------------------------------------

class list_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--repo", help="only this repository's dead letters")
        parser.add_argument("--limit", type=non_negative, default=0, help="the newest N only")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        letters = asyncio.run(read(settings))
        if args.repo:
            letters = [d for d in letters if d.repository == args.repo]
        letters.sort(key=lambda d: (d.timestamp_ms, d.id))
        if args.limit > 0:
            letters = letters[-args.limit:]
        verify_all(settings, letters)
        if args.json:
            print(orjson.dumps([d.summary() for d in letters],
                               option=orjson.OPT_INDENT_2).decode())
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"dead letters in {settings.dlq_topic} ({len(letters)})")
        for col in ("id", "time", "repository", "type", "origin", "size", "signed", "reason"):
            t.add_column(col)
        for d in letters:
            t.add_row(d.id, _iso(d.timestamp_ms), d.repository or "-", d.event_type or "-",
                      f"{d.origin_topic}/{d.origin_partition}@{d.origin_offset}", _size(d),
                      "yes" if d.unverified is None else "UNVERIFIED", d.reason)
        Console().print(t)
        if any(d.unverified is not None for d in letters):
            print("UNVERIFIED: not known to be written by the tracker (`hardelete dlq show ID` "
                  "says why); `dlq resolve` refuses them")
        return 0


class show:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("id", help="PARTITION:OFFSET in the dead-letter topic")
        parser.add_argument("--raw", action="store_true",
                            help="print only the event's value as it was (to fix and replay)")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        dl = asyncio.run(read_one(settings, args.id))
        if args.raw:
            sys.stdout.buffer.write(dl.value + b"\n")
            return 0
        verify_all(settings, [dl])
        body = dl.body
        out = {**dl.summary(), "key": dl.key,
               "event": body if body is not None else dl.value.decode(errors="replace")}
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0


class replay:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("id", nargs="?", help="the dead letter it fixes (PARTITION:OFFSET); "
                            "without --file its value is published as it was")
        parser.add_argument("--file", help="the fixed event (JSON); '-' reads stdin")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        elif args.file:
            try:
                with open(args.file, "rb") as f:
                    data = f.read()
            except OSError as exc:
                raise UserError(f"cannot read {args.file}: {exc.strerror}") from None
        elif args.id:
            data = asyncio.run(read_one(settings, args.id)).value
        else:
            raise UserError("replay needs a dead letter id or --file FILE (or --file - for stdin)")
        event = asyncio.run(publish_fixed(settings, data.strip()))
        print(f"published {event.TYPE} {event.event_id} of {event.repository} to "
              f"{settings.events_topic}" + (f" (fixes dead letter {args.id})" if args.id else "")
              + "; once the tracker applied it, `hardelete dlq resolve` lifts its holds")
        return 0



class resolve_:
    @staticmethod
    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("id", help="the dead letter (PARTITION:OFFSET) whose holds to lift")
        parser.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                            help="how long to wait for the tracker to apply what was published "
                                 "before now (a replayed fix), default 60")

    @staticmethod
    def run_cli(settings: Settings, args: argparse.Namespace) -> int:
        from core.clients import redis_sync

        dl = asyncio.run(read_one(settings, args.id))
        r = redis_sync(settings)
        try:
            done = resolve(r, dl, s3=operator_s3(settings), wait_s=args.wait,
                           secret=settings.reaper_secret)
            legacy = legacy_holds(r, dl)
        finally:
            r.close()
        if not done:
            print(f"dead letter {dl.id} holds nothing (no hold carries its claim {dl.claim})")
        for h, removal in done:
            what = "prefix " if h.kind == "prefix" else ""
            if removal.status == "lifted":
                print(f"lifted the dlq hold on {what}{h.target} in {h.repository}")
            else:
                print(f"released dead letter {dl.id}'s claim on {what}{h.target} in "
                      f"{h.repository}; still held by: {', '.join(removal.remaining)}")
        for h in legacy:
            print(f"{h.target} in {h.repository} has a hold stored before holds had claims "
                  f"({h.reason}): `hardelete hold remove --force {h.target}` lifts it")
        return 0
