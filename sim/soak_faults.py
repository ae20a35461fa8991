"""Fault injection, one part of the soak: each fault kind of the plan (sim/soak_plan.py)
carried out against the real stack, with what it did noted for the verdict."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import orjson

from core.clients import redis_async, redis_sync, s3_client
from core.logs import get_logger
from schemas.events import (
    BranchCreated,
    Event,
    ObjectDeleted,
    ObjectWritten,
    RepositoryCreated,
    encode,
)
from schemas.layout import RepoKeys
from schemas.publisher import ensure_topics
from sim.model import Model, ModelError
from sim.soak_base import SoakBase
from sim.soak_plan import FaultKind, ReconcileKind, Step
from sim.soak_procs import PYTHON_CLI, Daemon, settings_env
from sim.soak_verdict import ReconcileRun

log = get_logger("sim.soak")


class FaultInjection(SoakBase):
    """Carries out the plan's faults (one ``_fault_<kind>`` per kind)."""

    async def _fault_kill_tracker(self, step: Step) -> None:
        async def kill() -> None:
            self.sup.kill_and_restart(f"tracker-{step.target % 2}")
            self._injected(FaultKind.KILL_TRACKER)

        self._later(step.delay, kill, "kill_tracker")

    async def _fault_kill_reaper(self, step: Step) -> None:
        async def kill() -> None:
            self.sup.kill_and_restart(f"reaper-{step.target % 2}")
            self._injected(FaultKind.KILL_REAPER)

        self._later(step.delay, kill, "kill_reaper")

    async def _fault_redis_restart(self, step: Step) -> None:
        async def go() -> None:
            await asyncio.to_thread(self.servers.kill_redis, step.delay)
            self._injected(FaultKind.REDIS_RESTART)

        self._background(go(), "redis_restart")

    async def _fault_redis_rollback(self, step: Step) -> None:
        snapshot = await asyncio.to_thread(self.servers.snapshot_redis)
        target = step.at_op + max(1, step.span)
        # A hold placed after the copy Redis goes back to: only its durable fact keeps it.
        await self._operator_hold(step, "placed after the Redis copy a rollback restores")

        async def go() -> None:
            while self.op_index < target and not self.stopping:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.servers.rollback_redis, snapshot)
            self._injected(FaultKind.REDIS_ROLLBACK)

        self._background(go(), "redis_rollback")

    async def _operator_hold(self, step: Step, why: str) -> str | None:
        """``hardelete hold add`` on a stored object of the step's repository: it must never
        be deleted once the hold is in effect."""
        from core.clients import split_s3_uri
        from hardelete.holds import add_hold

        rng = random.Random(f"soak-hold:{self.o.seed}:{step.at_op}:{step.target}")
        repos = sorted(self.model.repositories)
        if not repos:
            return None
        repo = repos[step.target % len(repos)]
        candidates = sorted(a for a, obj in self.model.objects.items()
                            if obj.repository == repo and a not in self.operator_holds)
        rng.shuffle(candidates)
        s = self.servers.daemon_settings
        s3 = s3_client(s)

        def stored(address: str) -> bool:
            bucket, key = split_s3_uri(address)
            return s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get(
                "KeyCount", 0) > 0

        for address in candidates[:50]:
            if await asyncio.to_thread(stored, address):
                break
        else:
            return None
        r = redis_sync(s)
        try:
            await asyncio.to_thread(add_hold, r, address, f"soak: {why}", s3=s3)
        finally:
            r.close()
        self._note(address, f"operator hold ({why})")

        async def settled() -> None:
            # A request judged right before the hold may still land within its bound: the
            # hold is judged from the first listing after that.
            await asyncio.sleep(5.0)
            if await asyncio.to_thread(stored, address):
                self.operator_holds.add(address)
            else:
                self._note(address, "gone within a request's bound of the hold: not judged")

        self._background(settled(), "operator_hold")
        return address

    async def _fault_operator_hold(self, step: Step) -> None:
        if await self._operator_hold(step, "a legal hold") is not None:
            self._injected(FaultKind.OPERATOR_HOLD)
        else:
            self._failed(FaultKind.OPERATOR_HOLD, "no object to hold yet")

    async def _fault_operator_pause(self, step: Step) -> None:
        """``hardelete pause`` a repository for ``span`` operations: the objects it had when
        paused must all be there when it is resumed (no delete path deletes while paused)."""
        from hardelete.pause import clear_paused, set_paused

        repos = sorted(self.model.repositories)
        if not repos:
            self._failed(FaultKind.OPERATOR_PAUSE, "no repository yet")
            return
        repo = repos[step.target % len(repos)]
        s = self.servers.daemon_settings
        who = f"soak-{step.at_op}"
        r = redis_sync(s)
        try:
            await asyncio.to_thread(set_paused, r, repo, "soak: an operator looks", who,
                                    s3=s3_client(s))
        finally:
            r.close()
        # A request judged right before the pause may still land: the listing waits out the
        # longest request (every retry is judged again, so none lands later than that).
        await asyncio.sleep(5.0)
        before = set(await self.service.list_namespace(repo))
        target = step.at_op + max(1, step.span)
        self._injected(FaultKind.OPERATOR_PAUSE)

        async def go() -> None:
            while self.op_index < target and not self.stopping:
                await asyncio.sleep(0.05)
            after = set(await self.service.list_namespace(repo))
            for address in sorted(before - after):
                self._note(address, f"deleted while {repo} was paused (ops {step.at_op}-"
                                    f"{self.op_index})")
                self.violations.setdefault(address, "while its repository was paused")
                self.violation_op.setdefault(address, min(self.op_index, self.o.ops))
            for attempt in range(60):  # Redis may be down or loading (another fault)
                rr = redis_sync(s)
                try:
                    await asyncio.to_thread(clear_paused, rr, repo, who, s3=s3_client(s))
                    break
                except Exception:
                    if attempt == 59:
                        raise
                    await asyncio.sleep(1.0)
                finally:
                    rr.close()
            self.paused_spans += 1

        self._background(go(), "operator_pause")

    async def _fault_broker_restart(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=False,
                                down_seconds=step.delay)
        self._injected(FaultKind.BROKER_RESTART)

    async def _fault_broker_kill(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=False,
                                down_seconds=step.delay, hard=True)
        self._injected(FaultKind.BROKER_KILL)

    async def _fault_broker_log_lost(self, step: Step) -> None:
        await asyncio.to_thread(self.servers.restart_broker, lose_log=True,
                                down_seconds=step.delay)
        await ensure_topics(self.settings)  # the operator re-creates the topics
        self._injected(FaultKind.BROKER_LOG_LOST)

    async def _fault_add_partition(self, step: Step) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

        admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        await admin.start()
        try:
            topic = self.settings.events_topic
            meta = await admin.describe_topics([topic])
            count = len(meta[0]["partitions"])
            await admin.create_partitions({topic: NewPartitions(total_count=count + 1)})
        finally:
            await admin.close()
        self._injected(FaultKind.ADD_PARTITION)

    async def _fault_duplicate(self, step: Step) -> None:
        await self.flush()
        published = list(self.recent)
        if not published:
            return
        start = self.rng.randrange(len(published))
        chunk = published[start:start + max(1, step.span)]
        # Half the time out of order too: a redelivery is not always of the latest events.
        if self.rng.random() < 0.5:
            self.rng.shuffle(chunk)
        await self._publish(chunk)
        self._injected(FaultKind.DUPLICATE)

    async def _fault_reorder(self, step: Step) -> None:
        """A repository's next events are published after later ones; and a stale tag event
        (a tag deleted, re-created, then the old delete delivered again)."""
        repo = self._repo(step.target)
        if repo in self.diverted:
            return
        await self.flush()
        self.diverted[repo] = []
        target_ops = self.op_index + max(2, step.span)

        async def release() -> None:
            while self.op_index < target_ops and not self.stopping:
                await asyncio.sleep(0.02)
            await self.flush()
            block = self.diverted.pop(repo, [])
            half = len(block) // 2
            await self._publish(block[half:])  # the later half first ...
            await self._publish(block[:half])  # ... then the earlier half
            self._injected(FaultKind.REORDER)

        self._background(release(), "reorder")
        r = self.model.repository(repo)
        heads = sorted(b for b, br in r.branches.items() if br.head)
        if heads:
            self.counter += 1
            tag = f"soak-tag-{self.counter}"
            await self.service.call(Model.create_tag, repo, tag, heads[0])
            deleted = await self.service.call(Model.delete_tag, repo, tag)
            await self.service.call(Model.create_tag, repo, tag, heads[-1])
            await self.flush()
            self._later(1.0, lambda: self._publish(list(deleted)), "reorder")  # stale, again

    def _two_branches(self, repo: str) -> tuple[str, str] | None:
        r = self.model.repository(repo)
        names = sorted(r.branches)
        if len(names) < 2:
            return None
        src = r.default_branch
        dst = self.rng.choice([b for b in names if b != src])
        return src, dst

    async def _copy_then_delete_source(self, repo: str, kind: FaultKind
                                       ) -> tuple[str, list[Event]] | None:
        """Write X on one branch, shallow-copy it to another (the copy's event withheld),
        delete X from the first: the tracker sees X unreferenced until the copy arrives."""
        pair = self._two_branches(repo)
        if pair is None:
            return None
        src, dst = pair
        self.counter += 1
        path = f"soak/{kind.value}-{self.counter}"
        # A short upload token: the address' protection as an issued upload ends well inside
        # the grace window, so the grace window alone protects the delayed copy.
        issued = await self.service.call(Model.issue_address, repo, 0.5)
        assert issued.address is not None and issued.signed_token is not None
        await self.service.call(Model.upload, repo, issued.address, 16)
        written = await self.service.call(Model.link, repo, src, path, issued.address,
                                          issued.signed_token)
        assert written.address is not None
        copied = self.model.copy(repo, src, path, dst, path)
        held = self._withhold(copied)
        await self.service.call(Model.delete, repo, src, path)
        await self.flush()
        self._note(written.address, f"{kind.value}: copy {src}->{dst}:{path} withheld, "
                                    f"source deleted")
        return written.address, held

    async def _fault_delay(self, step: Step) -> None:
        made = await self._copy_then_delete_source(self._repo(step.target), FaultKind.DELAY)
        if made is None:
            return
        address, held = made

        async def release() -> None:
            await self._release(held)
            self._note(address, f"delay: copy published {step.delay:.2f}s late (within grace)")
            self._injected(FaultKind.DELAY)

        self._later(step.delay, release, "delay")

    async def _fault_delay_beyond(self, step: Step) -> None:
        repo = self._repo(step.target)
        made = await self._copy_then_delete_source(repo, FaultKind.DELAY_BEYOND)
        if made is None:
            return
        address, held = made

        async def release() -> None:
            # Beyond the contract: publish once the source is reaped (or well past grace).
            r = redis_async(self.settings)
            # A loaded machine (or a killed reaper) can take a while to reap it.
            deadline = time.monotonic() + max(60.0, 20 * self.o.grace_seconds)
            reaped = False
            try:
                while time.monotonic() < deadline and not self.stopping and not reaped:
                    with contextlib.suppress(Exception):
                        reaped = await r.hget(RepoKeys(repo).address(address),
                                              "state") == "reaped"
                    if not reaped:
                        await asyncio.sleep(0.2)
            finally:
                await r.aclose()
            if reaped:
                self.late[address] = "copy published after its source was reaped (beyond grace)"
            self.beyond_contract["after_reap" if reaped else "source_not_yet_reaped"] += 1
            await self._release(held)
            self._note(address, "delay_beyond: copy published "
                       + ("after the source was reaped" if reaped
                          else "beyond grace, its source not yet reaped"))
            self._injected(FaultKind.DELAY_BEYOND)

        self._background(release(), "delay_beyond")

    async def _fault_malformed(self, step: Step) -> None:
        repo = self._repo(step.target)
        ns = self.model.repository(repo).storage_namespace
        bodies = [
            b"{not json",
            orjson.dumps({"type": "object_teleported", "v": 1, "repository": repo,
                          "event_id": uuid.uuid4().hex, "emitted_at": 0}),
            orjson.dumps({"type": "tag_created", "v": 99, "repository": repo,
                          "event_id": uuid.uuid4().hex, "emitted_at": 0, "tag": "x",
                          "commit_id": "y"}),
            encode(ObjectWritten(repository=repo, branch="main", staging_token="t",
                                 path="p", address=f"s3://elsewhere/{uuid.uuid4().hex}",
                                 size=1, ref_id=uuid.uuid4().hex)),
            encode(ObjectWritten(repository=repo, branch="main", staging_token="t", path="p",
                                 address=f"{ns}_hardelete/manifests/x", size=1,
                                 ref_id=uuid.uuid4().hex)),
        ]
        body = bodies[step.target % len(bodies)]
        await self.producer.send_and_wait(self.settings.events_topic, body, key=repo.encode())
        self._injected(FaultKind.MALFORMED)

    async def _fault_oversized(self, step: Step) -> None:
        repo = self._repo(step.target)
        # As large as Kafka's default record limit (1 MB) lets through: above the tracker's
        # dead-letter cut (900 kB), so its dead letter is truncated.
        body = b'{"type": "object_written", "v": 1, "junk": "' + b"x" * 1_000_000 + b'"}'
        await self.producer.send_and_wait(self.settings.events_topic, body, key=repo.encode())
        self._injected(FaultKind.OVERSIZED)

    async def _fault_miskeyed(self, step: Step) -> None:
        """The next operations' events of one repository go out under another's key."""
        repo = self._repo(step.target)
        other = self._repo(step.target + 1)
        if repo in self.diverted:
            return
        await self.flush()
        self.diverted[repo] = []
        until = self.op_index + 10

        async def go() -> None:
            while self.op_index < until and not self.stopping:
                await asyncio.sleep(0.02)
            await self.flush()
            block = self.diverted.pop(repo, [])
            await self._publish(block, key=other.encode() if other != repo else b"")
            self.misdirected.append(block)  # the operator replays it at the drain
            self._injected(FaultKind.MISKEYED)

        self._background(go(), "miskeyed")

    async def _fault_namespace_claim(self, step: Step) -> None:
        """A repository whose namespace contains every other's claims a committed address of
        one of them and deletes it."""
        victim = self._repo(step.target)
        r = self.model.repository(victim)
        head = r.branches[r.default_branch].head
        if head is None:
            heads = [b.head for b in r.branches.values() if b.head]
            head = heads[-1] if heads else None
        if head is None or not self.model.commits[head].entries:
            self._failed(FaultKind.NAMESPACE_CLAIM, "victim has no committed entry yet")
            return
        entry = sorted(self.model.commits[head].entries.values(), key=lambda e: e.address)[0]
        self.counter += 1
        intruder = f"intruder-{self.run_id}-{self.counter}"
        parent = r.storage_namespace.rstrip("/").rsplit("/", 1)[0] + "/"
        token, ref = uuid.uuid4().hex, uuid.uuid4().hex
        events: list[Event] = [
            RepositoryCreated(repository=intruder, storage_namespace=parent,
                              default_branch="main", default_retention_days=7.0),
            BranchCreated(repository=intruder, branch="main", staging_token=token,
                          ref_version=1),
            ObjectWritten(repository=intruder, branch="main", staging_token=token, path="x",
                          address=entry.address, size=entry.size, ref_id=ref),
            ObjectDeleted(repository=intruder, branch="main", staging_token=token, path="x",
                          address=entry.address, ref_id=ref),
        ]
        await self.flush()
        await self._publish(events)
        self._note(entry.address, f"namespace_claim: {intruder} claimed {parent} and "
                                  f"unreferenced this committed address")
        self._injected(FaultKind.NAMESPACE_CLAIM)

    async def _fault_s3_errors(self, step: Step) -> None:
        faults = self.servers.proxy.faults
        faults.rng.seed(f"{self.o.seed}:{step.at_op}")
        faults.error_share = step.share
        until = step.at_op + max(1, step.span)
        self._injected(FaultKind.S3_ERRORS)

        async def heal() -> None:
            while self.op_index < until and not self.stopping:
                await asyncio.sleep(0.05)
            faults.error_share = 0.0

        self._background(heal(), "s3_errors")

    async def _fault_kill_reconciler(self, step: Step) -> None:
        if not self.o.reconcile:
            return
        repo = self._repo(step.target)
        self._background(self._killed_reconcile(repo, step), "kill_reconciler")

    async def _killed_reconcile(self, repo: str, step: Step) -> None:
        env = settings_env(self.servers.daemon_settings)
        env["HARDELETE_LOG_FORMAT"] = "json"
        d = Daemon("reconciler", [*PYTHON_CLI, "reconcile", "--repo", repo, "--json"], env,
                   self.servers.workdir / "reconciler-killed.log")
        d.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < step.delay and d.alive():
            await asyncio.sleep(0.05)
        finished = not d.alive()
        await asyncio.to_thread(d.kill9)
        self._injected(FaultKind.KILL_RECONCILER)
        self.runs.append(ReconcileRun(
            "killed (subprocess)", repo, step.at_op, None, True,
            "finished before the kill" if finished else f"killed after {step.delay:.1f}s",
            seconds=time.monotonic() - t0))
        # Restart: the same run again, once the killed run's lease has expired.
        await self._reconcile(ReconcileKind.MARK_SWEEP, repo, step.at_op, retry_lease=True,
                              label="mark_sweep (rerun after kill)")

    async def _fault_mark_sweep_race(self, step: Step) -> None:
        if not self.o.reconcile:
            return
        repo = self._repo(step.target)
        self._background(self._race(repo, step), "mark_sweep_race")

    async def _race(self, repo: str, step: Step) -> None:
        from reconciler.job import RunOptions

        await self._await_tracker_knows(repo)
        summary = await self._run_reconcile(RunOptions(repo, dry_run=True), "race: mark",
                                            repo, step.at_op)
        run_id = summary.get("run_id") if summary.get("success") else None
        if not run_id:
            self._failed(FaultKind.MARK_SWEEP_RACE, f"mark failed: {summary.get('error')}")
            return
        # Between the mark and the sweep: refs to old commits, and a copy committed on main.
        # Only commits whose data is all still stored: an expired commit whose data an earlier
        # sweep rightly took would otherwise come back "live" in the model with its data gone
        # (a branch at an expired commit after its collection: the retention contract's loss,
        # not a deletion of anything live; seen as a false alarm with seed 101).
        r = self.model.repository(repo)
        old = []
        for c in r.commit_ids:
            entries = self.model.commits[c].entries
            if entries and await self.service.all_stored(e.address for e in entries.values()):
                old.append(c)
                if len(old) == 3:
                    break
        if old:
            self.counter += 1
            branch = f"soak-race-{self.counter}"
            await self.service.call(Model.create_branch, repo, branch, old[0])
            await self.service.call(Model.create_tag, repo, f"soak-race-tag-{self.counter}",
                                    old[-1])
            entries = self.model.branch_entries(repo, branch)
            if entries:
                path = sorted(entries)[0]
                with contextlib.suppress(ModelError):
                    await self.service.call(Model.copy, repo, branch, path, r.default_branch,
                                            f"soak/race-{self.counter}")
                    await self.service.call(Model.commit, repo, r.default_branch)
            await self.flush()
        await self._run_reconcile(RunOptions(repo, sweep_only=run_id), "race: sweep-only",
                                  repo, step.at_op)
        self._injected(FaultKind.MARK_SWEEP_RACE)
