"""``hardelete reaper run``: the async reaper daemon.

One clear loop (after arq): for each repository, claim what the tracker proves unreferenced
since before ``horizon - grace`` (the horizon is the tracker's proven progress, never the wall
clock), delete it in bulk (or quarantine it), publish what the store confirmed
(``addresses_reaped``: a Redis restored from an older copy learns it again from the log), mark
it reaped, prune old tombstones. ``--once`` runs one pass, ``--dry-run`` claims nothing and
deletes nothing.

Right before every delete request the reaper judges each claimed address again
(``schemas.liveness.judge``, path ``online``, its own lease excepted) with the guards read from
Redis at that moment (``core.gate.Gate``: namespace ownership, holds, fail-closed,
pause): whatever the judgment keeps is not sent, and is counted under its reason. A repository
that is fail-closed (its own flag or the global one), paused or not the live owner of its
namespace is skipped before anything is claimed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge, Histogram, start_http_server

from core.clients import redis_async, redis_sync, s3_client
from core.clock import atracker_horizon_ms
from core.deleter import AsyncDeleter, Deleter, Plan, Recheck, Report, client_attempts
from core.facts import FactsProof, RepoFacts
from core.gate import aread_evidence, aread_gate, keep_reasons
from core.logs import get_logger
from core.registry import arepo_namespace
from core.settings import Settings
from reaper.claims import ClaimBatch, ClaimStore
from reaper.quarantine import purge_expired, purge_recheck, quarantine, quarantine_size
from schemas import reaper_auth
from schemas.events import MAX_REAPED_PER_EVENT, AddressesReaped, new_id
from schemas.layout import REPOS
from schemas.publisher import Publisher

log = get_logger(__name__)

REAPED = PCounter("hardelete_reaper_objects_reaped_total", "objects the store confirmed deleted",
                  ["repository"])
REAPED_BYTES = PCounter("hardelete_reaper_bytes_reaped_total", "bytes of reaped objects",
                        ["repository"])
FAILURES = PCounter("hardelete_reaper_failures_total", "deletes that failed after retries",
                    ["repository"])
REFUSED = PCounter("hardelete_reaper_refused_total",
                   "deletes the one deleter refused to send (outside the namespace or in its "
                   "reserved prefixes)", ["repository"])
PASS_FAILURES = PCounter("hardelete_reaper_pass_failures_total",
                         "passes that failed (Redis or S3 trouble); such a pass deletes nothing")
KEPT = PCounter("hardelete_reaper_kept_total",
                "addresses the reaper looked at and kept, by reason (schemas.liveness.Keep)",
                ["repository", "reason"])
LATENCY = Histogram("hardelete_reaper_unreferenced_to_deleted_seconds",
                    "time from unreferenced (tracker clock) to confirmed delete",
                    buckets=(1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, float("inf")))
QUARANTINE_OBJECTS = Gauge("hardelete_reaper_quarantine_objects", "objects in quarantine",
                           ["repository"])
# `hardelete health reaper`: a loop that stopped shows here while the endpoint still answers.
PROGRESS = Gauge("hardelete_reaper_progress_timestamp_seconds",
                 "when this reaper last completed a pass, a repository's part of one, or a "
                 "delete batch")
HORIZON_LAG = Gauge("hardelete_reaper_horizon_lag_seconds",
                    "how far the tracker's proven progress trails the Redis clock (+Inf: no "
                    "proof for some partition)")


@dataclass
class RepoPass:
    repository: str
    claimed: int = 0
    deleted: int = 0
    bytes: int = 0
    failed: int = 0
    refused: int = 0
    kept: Counter[str] = field(default_factory=Counter)
    skipped: str | None = None  # the whole repository was skipped: why
    would_delete: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


@dataclass
class PassReport:
    horizon_ms: int | None
    dry_run: bool
    repos: list[RepoPass] = field(default_factory=list)

    def total(self, attr: str) -> int:
        return sum(len(getattr(r, attr)) if attr == "would_delete" else int(getattr(r, attr))
                   for r in self.repos)

    def as_dict(self) -> dict[str, Any]:
        return {
            "horizon_ms": self.horizon_ms,
            "dry_run": self.dry_run,
            "repositories": [
                {"repository": r.repository, "claimed": r.claimed, "deleted": r.deleted,
                 "bytes": r.bytes, "failed": r.failed, "refused": r.refused,
                 "kept": dict(r.kept), "would_delete": r.would_delete, "skipped": r.skipped}
                for r in self.repos
            ],
        }


class Reaper:
    def __init__(self, settings: Settings, *, dry_run: bool = False,
                 redis: Any = None, s3: Any = None, reaper_id: str | None = None) -> None:
        self.settings = settings
        self.dry_run = dry_run
        self.id = reaper_id or f"reaper-{uuid.uuid4().hex[:8]}"
        self._own_redis = redis is None
        self.redis = redis if redis is not None else redis_async(settings)
        pool = settings.reaper_concurrency * 2
        self.s3 = s3 if s3 is not None else s3_client(settings, max_pool=pool)
        # The deleter's own client: one attempt per request (it retries, re-judging first).
        if s3 is None:
            self.gate_s3 = s3_client(settings, max_pool=pool, retries=False)
        elif client_attempts(s3) == 1:
            self.gate_s3 = s3
        else:  # a caller's client (another endpoint, a proxy): its no-retry twin
            self.gate_s3 = s3_client(settings.replace(s3_endpoint_url=s3.meta.endpoint_url),
                                     max_pool=pool, retries=False)
        self.claims = ClaimStore(self.redis)
        self.deleter = AsyncDeleter(Deleter.for_settings(settings, self.gate_s3),
                                    concurrency=settings.reaper_concurrency)
        self.log = log.bind(reaper=self.id, dry_run=dry_run)
        self._last_purge = 0.0
        self._publisher: Publisher | None = None
        self.records_published = 0  # addresses_reaped records
        self._reap_key: bytes | None = None  # signs them (schemas/reaper_auth.py)
        self._facts_redis: Any = None  # the facts proof's client (core/facts.py: synchronous)

    async def close(self) -> None:
        if self._publisher is not None:
            await self._publisher.stop()
        if self._own_redis:
            await self.redis.aclose()
        if self._facts_redis is not None:
            self._facts_redis.close()

    async def _publish_reaped(self, repo: str, addresses: list[str]) -> None:
        """Record confirmed deletes in the log (acks=all) before Redis: Redis can go back to
        an older copy, the log cannot, and the tracker re-applies it (``addresses_reaped``).
        If this fails the pass fails; the claims stay ``reaping`` until their lease expires,
        then they are deleted again (a no-op) and published again."""
        if not addresses:
            return
        if self._publisher is None:
            publisher = Publisher(self.settings)
            try:
                await publisher.start()
            except BaseException:  # broker down: do not leak a producer per failed pass
                with contextlib.suppress(Exception):
                    await publisher.stop()
                raise
            self._publisher = publisher
        if self._reap_key is None:
            self._reap_key = await reaper_auth.aload_key(self.redis,
                                                         self.settings.reaper_secret)
        key = self._reap_key
        records = []
        for i in range(0, len(addresses), MAX_REAPED_PER_EVENT):
            chunk = addresses[i:i + MAX_REAPED_PER_EVENT]
            eid = new_id()
            records.append(AddressesReaped(
                repository=repo, addresses=chunk, reaper=self.id, event_id=eid,
                emitted_at=time.time(),
                signature=reaper_auth.sign(key, repo, self.id, eid, chunk)))
        self.records_published += await self._publisher.publish_many(records)

    async def run_once(self) -> PassReport:
        horizon = await atracker_horizon_ms(self.redis)
        report = PassReport(horizon_ms=horizon, dry_run=self.dry_run)
        if horizon is None:
            # No proof of progress for every partition: a stopped tracker holds reaping back.
            self.log.info("no tracker progress yet; nothing may be reaped")
            HORIZON_LAG.set(math.inf)  # (the last value would say reaping goes on)
            PROGRESS.set_to_current_time()
            return report
        HORIZON_LAG.set(max(0.0, time.time() - horizon / 1000))
        for repo in sorted(await self.redis.smembers(REPOS)):
            report.repos.append(await self._reap_repository(repo, horizon))
            PROGRESS.set_to_current_time()
        PROGRESS.set_to_current_time()
        return report

    async def _reap_repository(self, repo: str, horizon: int) -> RepoPass:
        result = RepoPass(repo)
        namespace = await arepo_namespace(self.redis, repo)
        if not namespace:
            self.log.warning("repository has no namespace; skipped", repository=repo)
            return result
        grace_ms = int(self.settings.grace_for(repo) * 1000)
        cutoff = horizon - grace_ms
        per_claim = self.settings.reaper_batch_keys * self.settings.reaper_concurrency
        lease_ms = int(self.settings.lease_seconds * 1000)
        rlog = self.log.bind(repository=repo)
        # The global fail-closed flag and the registry are not in the repository's slot: they
        # are checked here before any claim (and again right before every request).
        problem = (await aread_gate(self.redis, repo, facts=await self._prove(repo, namespace))
                   ).repo_problem(repo, namespace)
        if problem is not None:
            result.skipped = problem[0]
            result.kept[problem[0]] += 1
            KEPT.labels(repo, problem[0]).inc()
            rlog.warning("repository skipped: nothing is claimed or deleted", reason=problem[0],
                         detail=problem[1])
            return result
        recheck = self._recheck(repo, namespace, horizon, grace_ms)

        def claim() -> asyncio.Future[ClaimBatch]:
            return asyncio.ensure_future(self.claims.claim(
                repo, cutoff_ms=cutoff, limit=100_000 if self.dry_run else per_claim,
                lease_ms=lease_ms, claimer=self.id, grace_ms=grace_ms, dry_run=self.dry_run))

        pending = claim()
        while True:
            batch = await pending
            result.kept.update(reason for _, reason in batch.kept)
            for _, reason in batch.kept:
                KEPT.labels(repo, reason).inc()
            if batch.refused:
                result.skipped = batch.refused
                result.kept[batch.refused] += 1
                KEPT.labels(repo, batch.refused).inc()  # (the alert on skipped repositories)
                rlog.warning("repository refused by the claim script", reason=batch.refused)
                break
            if self.dry_run:
                addresses = [c.address for c in batch.claimed]
                keep = await self._judge_now(repo, namespace, addresses, horizon, grace_ms)
                result.kept.update(keep.values())
                result.would_delete = [a for a in addresses if a not in keep]
                for c in batch.claimed:
                    if c.address not in keep:
                        rlog.info("would delete", address=c.address, size=c.size)
                break
            if not batch.claimed:
                break
            result.claimed += len(batch.claimed)
            # Claim the next batch while this one is deleted: Redis and S3 work overlap.
            pending = claim()
            outcome = await self._remove(namespace, repo, [c.address for c in batch.claimed],
                                         recheck)
            await self._publish_reaped(repo, list(outcome.deleted))
            await self.claims.complete(repo, list(outcome.deleted))
            self._account(result, batch, outcome, rlog)
            if not outcome.deleted:
                # Everything failed: do not spin. The prefetched claims, like the failed ones,
                # are taken again once their lease expires.
                nxt = await pending
                result.claimed += len(nxt.claimed)
                break
        if not self.dry_run:
            tomb_ms = int(self.settings.tombstone_days * 86400 * 1000)
            await self.claims.prune(repo, tombstone_ms=tomb_ms)
            await self._quarantine_housekeeping(repo, namespace)
        return result

    def _account(self, result: RepoPass, batch: ClaimBatch, outcome: Report,
                 rlog: Any) -> None:
        repo = result.repository
        confirmed = set(outcome.deleted)
        now_s = time.time()
        reaped_bytes = 0
        for c in batch.claimed:
            if c.address in confirmed:
                reaped_bytes += c.size
                # since is on the Redis clock; the claim's now too; then local time passes.
                lat = max(0.0, (batch.now_ms - c.since_ms) / 1000)
                lat += max(0.0, now_s - batch.now_ms / 1000)
                result.latencies_s.append(lat)
                LATENCY.observe(lat)
        result.bytes += reaped_bytes
        result.deleted += len(outcome.deleted)
        result.failed += len(outcome.failed)
        result.refused += len(outcome.refused)
        result.kept.update(outcome.kept.values())
        for why in outcome.kept.values():
            KEPT.labels(repo, why).inc()
        for address, why in outcome.kept.items():
            # The claim stays until its lease expires; the claim script then judges it again.
            rlog.warning("kept right before the delete request", address=address, reason=why)
        PROGRESS.set_to_current_time()
        REAPED.labels(repo).inc(len(outcome.deleted))
        REAPED_BYTES.labels(repo).inc(reaped_bytes)
        FAILURES.labels(repo).inc(len(outcome.failed))
        REFUSED.labels(repo).inc(len(outcome.refused))
        for address, code in outcome.codes.items():
            # The claim stays until its lease expires: a natural backoff before the retry.
            rlog.warning("delete failed; will retry after the lease", address=address,
                         error=code)
        rlog.info("reaped", deleted=len(outcome.deleted), failed=len(outcome.failed),
                  refused=len(outcome.refused), requests=outcome.requests,
                  retries=outcome.retries)

    async def _judge_now(self, repo: str, namespace: str, addresses: list[str], horizon: int,
                         grace_ms: int) -> dict[str, str]:
        """address -> reason to keep, judged now (the one evidence reader and judgment)."""
        if not addresses:
            return {}
        evidence = await aread_evidence(self.redis, repo, addresses,
                                        facts=await self._prove(repo, namespace))
        return keep_reasons(evidence, repo, namespace, path="online", horizon_ms=horizon,
                            grace_ms=grace_ms, claimer=self.id)

    async def _prove(self, repo: str, namespace: str) -> FactsProof:
        """The repository's holds and pauses proven current (core/facts.py), right before a
        gate read: its durable home listed, what the Redis copy lacks applied again."""
        if self._facts_redis is None:
            self._facts_redis = redis_sync(self.settings)
        facts = RepoFacts(self._facts_redis, self.gate_s3, repo, namespace)
        return await asyncio.to_thread(facts.prove, by=self.id,
                                       now_ms=int(time.time() * 1000))

    def _recheck(self, repo: str, namespace: str, horizon: int,
                 grace_ms: int) -> Recheck:
        """The judgment, run from the deleter's threads right before each request."""
        loop = asyncio.get_running_loop()

        def run(addresses: list[str]) -> dict[str, str]:
            fut = asyncio.run_coroutine_threadsafe(
                self._judge_now(repo, namespace, addresses, horizon, grace_ms), loop)
            return fut.result(timeout=60)

        return run

    async def _remove(self, namespace: str, repo: str, addresses: list[str],
                      recheck: Recheck | None = None) -> Report:
        plan = Plan(namespace, recheck=recheck, batch_keys=self.settings.reaper_batch_keys)
        if self.settings.quarantine_days > 0:
            return await quarantine(self.deleter, plan, repo, addresses,
                                    self.settings.quarantine_days)
        return await self.deleter.delete(plan, addresses)

    async def _quarantine_housekeeping(self, repo: str, namespace: str) -> None:
        if self.settings.quarantine_days <= 0 or time.time() - self._last_purge < 300:
            return
        self._last_purge = time.time()
        r = redis_sync(self.settings)
        try:
            await purge_expired(self.deleter.deleter, namespace, listing=self.s3,
                                recheck=purge_recheck(r, self.gate_s3, repo, namespace,
                                                      int(self.settings.grace_for(repo) * 1000)))
        finally:
            r.close()
        n, _ = await quarantine_size(self.s3, namespace)
        QUARANTINE_OBJECTS.labels(repo).set(n)

    async def run(self, stop: asyncio.Event) -> None:
        self.log.info("reaper started", grace_seconds=self.settings.grace_seconds)
        while not stop.is_set():
            try:
                report = await self.run_once()
                busy = report.total("claimed") > 0
            except Exception:
                # Redis or S3 trouble: log, back off, try again. Nothing is deleted without a
                # claim, and claims expire, so no state gets stuck.
                self.log.exception("reaper pass failed")
                PASS_FAILURES.inc()
                busy = False
            if not busy:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.reaper_poll_seconds)
        self.log.info("reaper stopped")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="one pass, then exit (cron, tests)")
    parser.add_argument("--dry-run", action="store_true",
                        help="log and count what would go; claim and delete nothing")
    parser.add_argument("--json", action="store_true", help="with --once: print the pass as JSON")


def print_report(report: PassReport) -> None:
    from rich.console import Console
    from rich.table import Table

    title = "reaper pass (dry run)" if report.dry_run else "reaper pass"
    table = Table(title=title)
    for col in ("repository", "claimed", "deleted", "bytes", "failed", "refused",
                "would delete", "kept (why)"):  # a skipped repository shows kept <reason>=1
        table.add_column(col, justify="left" if col in ("repository", "kept (why)") else "right")
    for r in report.repos:
        kept = ", ".join(f"{k}={v}" for k, v in sorted(r.kept.items()))
        table.add_row(r.repository, str(r.claimed), str(r.deleted), str(r.bytes), str(r.failed),
                      str(r.refused), str(len(r.would_delete)), kept)
    Console().print(table)
    if report.horizon_ms is None:
        Console().print("[yellow]no tracker progress: nothing may be reaped[/yellow]")


def run_cli(settings: Settings, args: argparse.Namespace) -> int:
    async def main() -> int:
        reaper = Reaper(settings, dry_run=args.dry_run)
        try:
            if settings.metrics_port:
                start_http_server(settings.metrics_port)
            if args.once:
                report = await reaper.run_once()
                if args.json:
                    print(orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2).decode())
                else:
                    print_report(report)
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await reaper.run(stop)
            return 0
        finally:
            await reaper.close()

    return asyncio.run(main())
