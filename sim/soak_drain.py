"""The drain, one part of the soak: the faults stop, the trackers catch up (rebuilds
included), the dead letters are replayed and resolved as an operator would, the reapers drain
and a final reconciler run per repository takes the rest."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson

from core.clients import redis_async, redis_sync
from core.logs import get_logger
from sim.soak_base import SoakBase
from sim.soak_plan import ReconcileKind
from sim.soak_verdict import ReconcileRun

log = get_logger("sim.soak")


class Drain(SoakBase):
    """The end of a run: recover, replay the dead letters, reap, reconcile."""

    async def _drain(self) -> bool:
        """Stop the faults, let everything recover, reap, reconcile; True if the trackers
        caught up."""
        o = self.o
        with self.console.status("soak: drain (faults stopped, trackers catching up)"):
            self.servers.proxy.faults.error_share = 0.0
            await self.flush()
            if self.tasks:  # held events released, reconciler runs finished
                await asyncio.wait(self.tasks, timeout=o.drain_timeout)
            # Reconciler runs queue behind one Spark session: let the scheduled ones finish.
            runs = [t for t in self.tasks if not t.done() and t.get_name().startswith(
                ("reconcile", "kill_reconciler", "mark_sweep_race"))]
            if runs:
                await asyncio.wait(runs, timeout=max(600.0, o.drain_timeout))
            for t in self.tasks:
                t.cancel()
            self.sup.check()
            await self.flush()
            await self._play_dlq_operator()
            caught_up = await self._await_trackers(o.drain_timeout)
            if o.rebuild:
                await self._await_rebuilds(o.drain_timeout)
            # Upload tokens expire and grace passes; then the reapers take the online garbage.
            deadline = time.monotonic() + o.drain_timeout
            await asyncio.sleep(o.upload_ttl_seconds + o.grace_seconds)
            while time.monotonic() < deadline:
                self.sup.check()
                listed = await self._listed()
                truth = self.model.truth()
                closed = set(self.fail_closed)
                pending = [a for a in truth.online_garbage & listed & set(self.model.objects)
                           if "*" not in closed
                           and self.model.objects[a].repository not in closed]
                if not pending:
                    break
                await asyncio.sleep(1.0)
        if o.reconcile:
            with self.console.status("soak: final reconciler runs"):
                await asyncio.sleep(o.min_age_seconds)
                for repo in sorted(self.model.repositories):
                    if repo in self.fail_closed or "*" in self.fail_closed:
                        # Its mark would fail closed after listing the whole namespace: a
                        # drain that grew with the run. (Its garbage counts as kept.)
                        self.runs.append(ReconcileRun("final mark_sweep", repo, o.ops, None,
                                                      False, "skipped: fail-closed"))
                        continue
                    await self._reconcile(ReconcileKind.MARK_SWEEP, repo, o.ops,
                                          retry_lease=True, label="final mark_sweep")
                # A key the sweep kept because its record changed since the mark (a reaper's
                # claim, a late event) is judged again by the next night's mark: run it for
                # the repositories whose final sweep kept marked keys.
                again = [run.repository for run in self.runs
                         if run.kind == "final mark_sweep" and run.status == "done"
                         and run.marked > run.confirmed]
                if again:
                    await asyncio.sleep(o.grace_seconds + o.min_age_seconds)
                for repo in again:
                    await self._reconcile(ReconcileKind.MARK_SWEEP, repo, o.ops,
                                          retry_lease=True, label="final mark_sweep (next night)")
        return caught_up

    async def _await_rebuilds(self, timeout: float) -> None:
        """A repository failed closed late in the load heals by its rebuild (the tracker
        prepares, the service exports, the tracker applies: a round every rebuild interval).
        Wait for it: the final mark skips a fail-closed repository, and its garbage would count
        as kept only because the soak stopped watching too early."""
        deadline = time.monotonic() + timeout
        while self.fail_closed and time.monotonic() < deadline:
            self.sup.check()
            await asyncio.sleep(0.5)

    async def _play_dlq_operator(self) -> None:
        """The operator's part for dead letters, after the load: each one came from a fault the
        soak injected. The miskeyed blocks are the service's real events: they are published
        again under their own key (`dlq replay` of the fixed event), and once the trackers
        applied them every dead letter's claim is lifted (`dlq resolve`). Without the replay a
        resolve would let go what only the dead-lettered events reference; without the
        resolve their holds would keep whole namespaces, and reclaim could not be judged."""
        ids = await asyncio.to_thread(self._dead_lettered_ids)
        ids.update(e.event_id for block in self.misdirected for e in block)
        # The model's own events among them, in the model's order (the fix is the key: an
        # event dead-lettered for any reason, its dead letter lost with a broker log or not,
        # is named by its hold's claim). Crafted ones (malformed, oversized) are not replayed.
        replay = [e for e in self.model.events if e.event_id in ids]
        t0 = time.time()
        await self._publish(replay)
        self.dlq_replayed = len(replay)
        t1 = time.time()
        caught_up = await self._await_trackers(self.o.drain_timeout)
        t2 = time.time()
        holds_before = await asyncio.to_thread(self._dlq_holds_snapshot)
        # As `dlq resolve --wait`: nothing is lifted unless the trackers applied the replay.
        if caught_up:
            self.dlq_resolved = await asyncio.to_thread(self._resolve_dead_letters)
        else:
            log.warning("soak.dlq_not_resolved", why="trackers not caught up with the replay")
        t3 = time.time()
        if not self.o.keep_workdir:
            return
        letters: list[Any] = []
        with contextlib.suppress(Exception):
            from hardelete.dlq import read as read_dlq

            letters = [{"id": d.id, "reason": d.reason[:120], "key": d.key,
                        "event_id": (d.body or {}).get("event_id"), "at": d.timestamp_ms,
                        "claim": d.claim} for d in await read_dlq(self.settings)]
        with contextlib.suppress(Exception):  # what the operator did, with the kept servers
            (self.servers.workdir / "dlq-operator.json").write_bytes(orjson.dumps({
                "published_at": t0, "acked_at": t1, "caught_up": caught_up,
                "caught_up_at": t2, "resolved_at": t3, "ids": sorted(ids),
                "replayed": [{"event_id": e.event_id, "type": e.TYPE,
                              "repository": e.repository,
                              "address": getattr(e, "address", None)} for e in replay],
                "holds_resolved": holds_before, "dead_letters": letters,
                "misdirected": [[e.event_id for e in b] for b in self.misdirected]},
                option=orjson.OPT_INDENT_2))

    def _dead_lettered_ids(self) -> set[str]:
        from hardelete.holds import DLQ, list_holds

        r = redis_sync(self.settings)
        try:
            return {str(c.get("event_id")) for h in list_holds(r, source=DLQ)
                    for c in h.claims.values() if isinstance(c, dict) and c.get("event_id")}
        finally:
            r.close()

    def _dlq_holds_snapshot(self) -> list[dict[str, Any]]:
        from hardelete.holds import DLQ, list_holds

        r = redis_sync(self.settings)
        try:
            return [{"repository": h.repository, "target": h.target, "kind": h.kind,
                     "claims": h.claims} for h in list_holds(r, source=DLQ)]
        finally:
            r.close()

    def _resolve_dead_letters(self) -> int:
        from hardelete.holds import DLQ, lift, list_holds, operator_s3

        r = redis_sync(self.settings)
        s3 = operator_s3(self.settings)
        n = 0
        try:
            for h in list_holds(r, source=DLQ):
                if h.sources() <= {DLQ}:  # an operator's or a restore's claim stays
                    lift(r, h, s3=s3, force=True)  # (exactly this hold, not every form of it)
                    n += 1
        finally:
            r.close()
        return n

    async def _await_trackers(self, timeout: float) -> bool:
        from core.clock import aredis_time_ms, atracker_horizon_ms

        deadline = time.monotonic() + timeout
        target = None
        while time.monotonic() < deadline:
            r = redis_async(self.settings)
            try:
                if target is None:
                    target = await aredis_time_ms(r)
                h = await atracker_horizon_ms(r)
                if h is not None and h >= target:
                    return True
            except Exception:
                pass
            finally:
                with contextlib.suppress(Exception):
                    await r.aclose()
            self.sup.check()
            await asyncio.sleep(0.25)
        return False
