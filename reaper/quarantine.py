"""Restorable quarantine: instead of deleting, move an object under
``<namespace>_hardelete/quarantine/`` for N days; ``hardelete restore REPO ADDRESS`` brings it
back. The quarantine copy carries where it came from and when it may be purged."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from core.clients import redis_async, redis_sync, s3_client, split_s3_uri
from core.clock import aredis_time_ms
from core.errors import UserError
from core.facts import HOLD_ADD, HOLD_REMOVE, FactError, RepoFacts
from core.gate import (
    S3_MAX_KEYS,
    Evidence,
    aread_gate,
    copy_key,
    delete_keys,
    keep_reasons,
    read_evidence,
)
from core.logs import get_logger
from core.registry import arepo_namespace
from core.settings import Settings
from reaper.claims import ClaimStore
from reaper.deleter import AddressRecheck, DeleteOutcome, S3Deleter
from schemas.address import canonical_address
from schemas.holds import (
    RESTORE,
    RESTORE_CLAIM,
    RestoreClaim,
    aplace_restore_claim,
    reaper_claims,
)
from schemas.layout import QUARANTINE_PREFIX, RepoKeys, namespace_key

log = get_logger(__name__)


def quarantine_address(namespace: str, address: str) -> str:
    return namespace + QUARANTINE_PREFIX + namespace_key(namespace, address)


async def quarantine(client: Any, deleter: S3Deleter, namespace: str, repo: str,
                     addresses: list[str], keep_days: float,
                     recheck: AddressRecheck | None = None) -> DeleteOutcome:
    """Copy each address into quarantine, then delete the original through the deleter (so the
    same namespace guard, re-check right before the request and confirmation rules apply).
    A failed copy deletes nothing."""
    copied: list[str] = []
    failed: dict[str, str] = {}
    expires = time.time() + keep_days * 86400

    def copy_one(address: str) -> None:
        bucket, key = split_s3_uri(address)
        _, qkey = split_s3_uri(quarantine_address(namespace, address))
        copy_key(client, bucket, key, qkey, {"hardelete-repo": repo,
                                             "hardelete-address": address,
                                             "hardelete-expires": str(int(expires))})

    async def one(address: str) -> None:
        try:
            namespace_key(namespace, address)
            await asyncio.to_thread(copy_one, address)
            copied.append(address)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404"):
                copied.append(address)  # nothing to keep: deleting is a no-op
            else:
                failed[address] = code or "copy failed"
        except ValueError as exc:
            failed[address] = str(exc)

    await asyncio.gather(*(one(a) for a in addresses))
    outcome = await deleter.delete(namespace, copied, recheck)
    outcome.failed.update(failed)
    return outcome


def purge_keeps(evidence: Evidence, repo: str, namespace: str, *, horizon_ms: int | None,
                grace_ms: int) -> dict[str, str]:
    """address -> reason to keep its quarantine copy (pure). A copy is the last copy of its
    address, so it stays while anything would keep the address itself (guards: holds, pause,
    fail-closed, ownership; a reference, a commit, an upload, grace: ``schemas.liveness`` on
    the reconciler path), and a committed address is kept too (restore it instead)."""
    if horizon_ms is None:  # grace cannot be judged without the tracker's proven progress
        return dict.fromkeys(evidence.records, "no_horizon")
    keep = keep_reasons(evidence, repo, namespace, path="reconciler", horizon_ms=horizon_ms,
                        grace_ms=grace_ms)
    for address, rec in evidence.records.items():
        if address not in keep and rec is not None and (
                rec.committed or rec.state == "committed"):
            keep[address] = "committed: a commit references it (restore it)"
    return keep


def purge_recheck(r: Any, s3: Any, repo: str, namespace: str, grace_ms: int
                  ) -> Callable[[list[str]], dict[str, str]]:
    """The gate's judgment for purging quarantine copies (:func:`purge_keeps`), read right
    before each request (the repository's holds and pauses proven first: core/facts.py)."""
    facts = RepoFacts(r, s3, repo, namespace)

    def run(addresses: list[str]) -> dict[str, str]:
        from core.clock import tracker_horizon_ms

        proof = facts.prove(by="quarantine purge")
        return purge_keeps(read_evidence(r, repo, addresses, facts=proof), repo, namespace,
                           horizon_ms=tracker_horizon_ms(r), grace_ms=grace_ms)

    return run


async def purge_expired(client: Any, namespace: str, now: float | None = None,
                        recheck: Callable[[list[str]], Mapping[str, str]] | None = None,
                        listing: Any = None) -> int:
    """Delete quarantine copies whose keep period is over, through the gate: ``recheck``
    (addresses -> reasons to keep, :func:`purge_recheck`) runs right before each request.
    Only ever touches the quarantine prefix of this namespace. ``listing``: a client to list
    and read metadata with (default ``client``); ``client`` must be the gate's (no retries)."""
    now = time.time() if now is None else now
    bucket, prefix = split_s3_uri(namespace + QUARANTINE_PREFIX)
    lister = listing if listing is not None else client

    def run() -> int:
        due: dict[str, str] = {}  # quarantine key -> the address it keeps
        for page in lister.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
            for obj in page.get("Contents", []):
                head = lister.head_object(Bucket=bucket, Key=obj["Key"])
                meta = head.get("Metadata", {})
                exp = float(meta.get("hardelete-expires", "inf"))
                address = meta.get("hardelete-address")
                if address is None:
                    continue  # doubt keeps: no recorded address
                if exp <= now and obj["Key"].startswith(prefix):
                    due[obj["Key"]] = address
        n = 0
        items = sorted(due.items())
        for i in range(0, len(items), S3_MAX_KEYS):
            batch = dict(items[i:i + S3_MAX_KEYS])

            def key_recheck(keys: list[str], batch: dict[str, str] = batch) -> dict[str, str]:
                if recheck is None:
                    return {}
                keep = recheck([batch[k] for k in keys])
                return {k: keep[batch[k]] for k in keys if batch[k] in keep}

            n += len(delete_keys(client, bucket, list(batch), recheck=key_recheck).deleted)
        return n

    purged = await asyncio.to_thread(run)
    if purged:
        log.info("quarantine purged", namespace=namespace, objects=purged)
    return purged


async def quarantine_size(client: Any, namespace: str) -> tuple[int, int]:
    bucket, prefix = split_s3_uri(namespace + QUARANTINE_PREFIX)

    def run() -> tuple[int, int]:
        n = b = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                n += 1
                b += int(obj.get("Size", 0))
        return n, b

    return await asyncio.to_thread(run)


@dataclass(frozen=True)
class Restored:
    """What ``hardelete restore`` did."""

    address: str  # the object brought back, canonical (restore's claim holds it)
    state: str  # its record's state now
    copy: str  # its quarantine copy
    copy_kept: str | None  # why the quarantine copy was kept (None: deleted)


def copy_keep_reason(problem: tuple[str, str] | None, *, in_place: bool, held: bool,
                     reaper_claimed: bool) -> str | None:
    """Why restore keeps the quarantine copy of the object it brought back, judged right before
    the copy's delete request (pure), or None. The copy may be the last one: it stays unless
    the object is in place, still held (so no reaper has claimed it and quarantined it again
    over the copy since) and unclaimed, and the repository may delete now (not fail-closed,
    paused, or out of its namespace's ownership: no delete path deletes then)."""
    if problem is not None:
        return f"{problem[0]}: {problem[1]}"
    if not in_place:
        return "the restored object is not in place"
    if reaper_claimed:
        return "a reaper claims the address"
    if not held:
        return "the address is no longer held"
    return None


def refusal(address: str, taken: RestoreClaim, now_ms: int) -> str:
    """The one line of a restore refused because a reaper claims ``address`` (nothing done)."""
    who = f" {taken.claimer}" if taken.claimer else ""
    if taken.lease_until is not None and taken.lease_until > now_ms:
        return (f"{address} is being deleted right now (claimed by reaper{who}, lease until "
                f"{_iso_ms(taken.lease_until)}): nothing was restored; run restore again once "
                f"`hardelete explain {address}` shows it reaped")
    return (f"{address} is claimed by reaper{who}, whose lease ran out unfinished "
            f"({_iso_ms(taken.lease_until)}): its delete may still be in flight, so nothing was "
            "restored; the next reaper pass finishes or releases the claim, then run restore "
            "again")


def _iso_ms(ms: int | None) -> str:
    if ms is None:
        return "no lease"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


def _size(client: Any, bucket: str, key: str) -> int | None:
    """The object's size, None when there is none (the gate's client: one attempt)."""
    try:
        return int(client.head_object(Bucket=bucket, Key=key).get("ContentLength", 0))
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
            return None
        raise


_MISSING = ("NoSuchKey", "404", "NotFound")


async def restore(settings: Settings, repo: str, address: str) -> Restored:
    """Copy a quarantined address back to its place, recompute its state in Redis, and delete
    its quarantine copy once it is back.

    A restore and a reaper's delete of one address exclude each other: restore's claim (the
    hold that keeps the restored object) is placed in one script with the check that no
    reaper claims the address (``schemas.holds.restore_claim``); a claimed address is refused
    with nothing touched (its delete may be in flight: the quarantine copy may be the only one
    left once it lands), and once the hold is on, the reaper's claim script and its recheck
    before the request keep the address. The quarantine copy is deleted through the gate, only
    after the object is seen in place (:func:`copy_keep_reason`)."""
    redis = redis_async(settings)
    client = s3_client(settings, retries=False)  # the gate's client
    sync_redis = redis_sync(settings)  # the durable facts' (core/facts.py)
    try:
        namespace = await arepo_namespace(redis, repo)
        if not namespace:
            raise UserError(f"unknown repository {repo!r}")
        try:
            # The object in the canonical form its quarantine copy and every delete path use
            # (its restore hold is compared in that form): S3://, s3a://, a bucket in any
            # case, a key relative to the namespace. Escapes are kept literally: a restore
            # names one quarantine copy, the one quarantined under that very key.
            address = canonical_address(namespace, address)
            qaddr = quarantine_address(namespace, address)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        bucket, key = split_s3_uri(address)
        _, qkey = split_s3_uri(qaddr)
        # Hold it before it is back, so no reaper takes the restored object again (it is still
        # unreferenced); `hardelete hold remove --restore` lets it go. The hold is restore's own
        # claim (schemas/holds.py): other claims on it are untouched.
        now = await aredis_time_ms(redis)
        claim = {"reason": "restored from quarantine", "source": RESTORE, "at_ms": now}
        taken = await aplace_restore_claim(redis, repo, address, claim)
        if taken.status != "held":
            raise UserError(refusal(address, taken, now))
        facts = RepoFacts(sync_redis, client, repo, namespace)

        async def fact(kind: str, body: dict[str, Any]) -> None:
            try:
                await asyncio.to_thread(facts.record, kind, body, by="restore", now_ms=now)
            except FactError as exc:
                raise UserError(f"{address}: nothing was restored: {exc}") from None

        async def release() -> None:
            # Nothing was brought back: restore's claim goes unless it was there before, or
            # the object is in place (a concurrent restore brought it back and relies on it).
            if taken.added and await asyncio.to_thread(_size, client, bucket, key) is None:
                await fact(HOLD_REMOVE, {"hash": "holds", "target": address,
                                         "claim_ids": [RESTORE_CLAIM], "force": False})

        # The claim is durable before anything is brought back (core/facts.py): a Redis that
        # goes back cannot forget it while the restored object relies on it.
        await fact(HOLD_ADD, {"hash": "holds", "replace": True,
                              "items": [[address, RESTORE_CLAIM, claim]]})

        try:
            qsize = await asyncio.to_thread(_size, client, bucket, qkey)
            if qsize is not None:
                try:
                    await asyncio.to_thread(copy_key, client, bucket, qkey, key)
                except ClientError as exc:
                    if str(exc.response.get("Error", {}).get("Code", "")) not in _MISSING:
                        raise
                    qsize = None  # purged, or a concurrent restore's, since the head
        except BaseException:
            with contextlib.suppress(Exception):  # (if it fails too, the claim stays: keeps)
                await release()
            raise
        if qsize is None:
            await release()
            if await asyncio.to_thread(_size, client, bucket, key) is not None:
                raise UserError(f"{address} is not in quarantine: it is in place (state "
                                f"{taken.state or 'untracked'}) and held by restore; "
                                f"`hardelete hold remove --restore {address}` lets it go")
            raise UserError(f"{address} is not in quarantine (purged or never there)")
        if await asyncio.to_thread(_size, client, bucket, key) != qsize:
            raise UserError(f"{address} was copied back but is not in place now: its quarantine "
                            f"copy {qaddr} is kept and the address held; run restore again")
        state = await ClaimStore(redis).restore(repo, address)
        kept = await _delete_copy(redis, facts, client, repo, namespace, address, qkey, qsize)
        log.info("restored from quarantine", repository=repo, address=address, state=state,
                 copy_kept=kept)
        return Restored(address, state, qaddr, kept)
    finally:
        await redis.aclose()
        sync_redis.close()


async def _delete_copy(redis: Any, facts: RepoFacts, client: Any, repo: str, namespace: str,
                       address: str, qkey: str, size: int) -> str | None:
    """Delete the quarantine copy ``qkey`` of the restored ``address`` through the gate, judged
    right before each request (:func:`copy_keep_reason`); why it was kept, or None."""
    bucket, key = split_s3_uri(address)
    k = RepoKeys(repo)
    loop = asyncio.get_running_loop()

    async def judge() -> str | None:
        proof = await asyncio.to_thread(facts.prove, by="restore")
        gate = await aread_gate(redis, repo, [address], facts=proof)
        state = await redis.hget(k.address(address), "state")
        in_claims = await redis.zscore(k.claims, address) is not None
        in_place = await asyncio.to_thread(_size, client, bucket, key) == size
        return copy_keep_reason(
            gate.repo_problem(repo, namespace), in_place=in_place,
            held=gate.guards(repo, namespace, address).held is not None,
            reaper_claimed=reaper_claims(None if state is None else str(state), in_claims))

    def recheck(keys: list[str]) -> dict[str, str]:
        why = asyncio.run_coroutine_threadsafe(judge(), loop).result(timeout=60)
        return dict.fromkeys(keys, why) if why else {}

    out = await asyncio.to_thread(delete_keys, client, bucket, [qkey], recheck=recheck)
    if qkey in out.kept:
        return out.kept[qkey]
    if qkey in out.errors:
        return f"its delete failed: {out.errors[qkey]}"
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("repository")
    parser.add_argument("address", help="the s3:// address to bring back (any spelling of "
                                        "it, or a key relative to the namespace)")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    done = asyncio.run(restore(settings, args.repository, args.address))
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    print(f"restored {done.address} at {when}; its state is now {done.state}; held (source "
          f"restore) so no delete path takes it again: `hardelete hold remove --restore "
          f"{done.address}` lets it go (restore's claim only: any other hold on it stays)")
    if done.copy_kept:
        print(f"its quarantine copy {done.copy} is kept ({done.copy_kept}); running restore "
              "again once that is over removes it")
    return 0
