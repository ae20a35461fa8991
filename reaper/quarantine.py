"""Restorable quarantine: instead of deleting, move an object under
``<namespace>_hardelete/quarantine/`` for N days; ``hardelete restore REPO ADDRESS`` brings it
back. The quarantine copy carries where it came from and when it may be purged."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import time
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from core.clients import redis_async, redis_sync, split_s3_uri
from core.clock import aredis_time_ms
from core.deleter import QUARANTINE, AsyncDeleter, Copy, Deleter, Plan, Recheck, Report
from core.errors import UserError
from core.facts import HOLD_ADD, HOLD_REMOVE, FactError, RepoFacts
from core.gate import Evidence, aread_gate, keep_reasons, read_evidence
from core.logs import get_logger
from core.registry import arepo_namespace
from core.settings import Settings
from reaper.claims import ClaimStore
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


async def quarantine(deleter: AsyncDeleter, plan: Plan, repo: str, addresses: list[str],
                     keep_days: float) -> Report:
    """Copy each address into quarantine, then delete the original (``plan``: its namespace,
    recheck right before each request); one report of both. A failed copy deletes nothing."""
    expires = str(int(time.time() + keep_days * 86400))
    valid: list[str] = []
    refused: dict[str, str] = {}
    for address in addresses:
        try:
            quarantine_address(plan.namespace, address)
            valid.append(address)
        except ValueError as exc:  # (OutsideNamespace): never copied, never deleted
            refused[address] = str(exc)
    copies = await deleter.copy(Plan(plan.namespace), [
        Copy(a, quarantine_address(plan.namespace, a),
             {"hardelete-repo": repo, "hardelete-address": a, "hardelete-expires": expires})
        for a in valid])
    # A source that is not there leaves nothing to keep: its delete is a no-op.
    gone = await deleter.delete(plan, [*copies.copied, *copies.absent])
    return Report(refused=refused) + copies + gone


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


def purge_recheck(r: Any, s3: Any, repo: str, namespace: str, grace_ms: int) -> Recheck:
    """The gate's judgment for purging quarantine copies (:func:`purge_keeps`), read right
    before each request (the repository's holds and pauses proven first: core/facts.py)."""
    facts = RepoFacts(r, s3, repo, namespace)

    def run(addresses: list[str]) -> dict[str, str]:
        from core.clock import tracker_horizon_ms

        proof = facts.prove(by="quarantine purge")
        return purge_keeps(read_evidence(r, repo, addresses, facts=proof), repo, namespace,
                           horizon_ms=tracker_horizon_ms(r), grace_ms=grace_ms)

    return run


def _copy_of(namespace: str, bucket: str, key: str, address: str) -> bool:
    """Is ``key`` the quarantine copy of ``address`` (pure)? The metadata is judged in the
    copy's place, and whoever writes the namespace can rewrite it: a copy whose metadata names
    another address than the one its key keeps would be judged for that other one."""
    try:
        return quarantine_address(namespace, address) == f"s3://{bucket}/{key}"
    except ValueError:  # (OutsideNamespace)
        return False


async def purge_expired(deleter: Deleter, namespace: str, now: float | None = None,
                        recheck: Recheck | None = None, listing: Any = None) -> Report:
    """Delete quarantine copies whose keep period is over, through the one deleter:
    ``recheck`` (addresses -> reasons to keep, :func:`purge_recheck`) runs right before each
    request with the addresses the copies keep. Only ever touches the quarantine prefix of
    this namespace (the plan's area). ``listing``: a client to list and read metadata with
    (default the deleter's)."""
    now = time.time() if now is None else now
    bucket, prefix = split_s3_uri(namespace + QUARANTINE_PREFIX)
    lister = listing if listing is not None else deleter.client

    def run() -> Report:
        due: dict[str, str] = {}  # quarantine key -> the address it keeps
        for page in lister.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
            for obj in page.get("Contents", []):
                try:
                    head = lister.head_object(Bucket=bucket, Key=obj["Key"])
                except ClientError as exc:  # gone since the listing: a restore or purge took it
                    if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
                        continue
                    raise
                meta = head.get("Metadata", {})
                exp = float(meta.get("hardelete-expires", "inf"))
                address = meta.get("hardelete-address")
                if address is None or not _copy_of(namespace, bucket, obj["Key"], address):
                    continue  # doubt keeps: no recorded address, or not the one its key keeps
                if exp <= now and obj["Key"].startswith(prefix):
                    due[obj["Key"]] = address
        copies = {f"s3://{bucket}/{k}": a for k, a in sorted(due.items())}

        def copy_recheck(qaddrs: list[str]) -> dict[str, str]:
            if recheck is None:
                return {}
            keep = recheck([copies[q] for q in qaddrs])
            return {q: keep[copies[q]] for q in qaddrs if copies[q] in keep}

        return deleter.delete(Plan(namespace, area=QUARANTINE, recheck=copy_recheck),
                              list(copies))

    purged = await asyncio.to_thread(run)
    if purged.deleted:
        log.info("quarantine purged", namespace=namespace, objects=len(purged.deleted))
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
    left once it lands), and once the hold is on, the reaper's claim script and every delete
    path's recheck before its request keep the address. A delete request sent before the hold
    (a reaper whose lease ran out mid-request, its claim since finished by another; a sweep)
    may still be on its way: restore copies the object back only once every such request is
    void (``core.deleter``, point 3: ``settle_seconds`` after the hold). The quarantine copy
    is deleted through the one deleter, only after the object is seen in place
    (:func:`copy_keep_reason`)."""
    redis = redis_async(settings)
    deleter = Deleter.for_settings(settings)
    client = deleter.client
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
        settled = time.monotonic() + deleter.settle_seconds  # (measured after the hold)
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
                wait = settled - time.monotonic()
                if wait > 0:  # a delete request sent before the hold may still land until then
                    log.info("restore waits for delete requests sent before its hold to be "
                             "void", address=address, seconds=round(wait, 1))
                    await asyncio.sleep(wait)
                back = await asyncio.to_thread(deleter.copy_one, Plan(namespace),
                                               Copy(qaddr, address))
                if back.failed or back.refused:
                    raise RuntimeError(f"copying {qaddr} back failed: "
                                       f"{(back.failed or back.refused)[qaddr]}")
                if back.absent:
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
        kept = await _delete_copy(redis, facts, deleter, repo, namespace, address, qaddr,
                                  qsize)
        log.info("restored from quarantine", repository=repo, address=address, state=state,
                 copy_kept=kept)
        return Restored(address, state, qaddr, kept)
    finally:
        await redis.aclose()
        sync_redis.close()


async def _delete_copy(redis: Any, facts: RepoFacts, deleter: Deleter, repo: str,
                       namespace: str, address: str, qaddr: str, size: int) -> str | None:
    """Delete the quarantine copy ``qaddr`` of the restored ``address`` through the one
    deleter, judged right before each request (:func:`copy_keep_reason`); why it was kept, or
    None."""
    client = deleter.client
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

    def recheck(qaddrs: list[str]) -> dict[str, str]:
        why = asyncio.run_coroutine_threadsafe(judge(), loop).result(timeout=60)
        return dict.fromkeys(qaddrs, why) if why else {}

    out = await asyncio.to_thread(deleter.delete, Plan(namespace, area=QUARANTINE,
                                                       recheck=recheck), [qaddr])
    if qaddr in out.kept:
        return out.kept[qaddr]
    if qaddr in out.failed or qaddr in out.refused:
        return f"its delete failed: {out.failed.get(qaddr) or out.refused[qaddr]}"
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
