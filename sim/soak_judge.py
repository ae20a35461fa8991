"""The verdict, one part of the soak: what the model calls live and gone, against what the
store lists, the incidents and the log regressions the product recorded; each object left is
explained by the product itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any

import orjson

from core.clients import redis_async, redis_sync, s3_client, topic_partitions
from core.logs import get_logger
from schemas.layout import LOG, REPOS, RepoKeys
from sim.soak_base import SoakBase
from sim.soak_plan import FAILS_CLOSED, FaultKind
from sim.soak_verdict import (
    IncidentRecord,
    LiveDeletion,
    SoakVerdict,
    event_history,
    may_be_gone,
    why_live,
)

log = get_logger("sim.soak")


class Judging(SoakBase):
    """The verdict: the model's truth against the store and the product's records."""

    async def _verdict(self, caught_up: bool) -> SoakVerdict:
        listed = await self._check("end")
        now = time.time()
        written = set(self.model.objects)
        allowed = may_be_gone(self.model, now)
        incidents = await asyncio.to_thread(self._incidents)
        incident_addresses = {i.address for i in incidents}
        closed = set(self.fail_closed)
        for address in sorted(self.operator_holds - listed):  # held: it had to stay
            self.violations.setdefault(address, "end (under an operator hold)")
        live: list[LiveDeletion] = []
        late: list[LiveDeletion] = []
        r = redis_sync(self.servers.daemon_settings)
        s3 = s3_client(self.servers.daemon_settings)
        try:
            for address, seen in sorted(self.violations.items()):
                obj = self.model.objects[address]
                d = LiveDeletion(address, obj.repository, why_live(self.model, address, now),
                                 seen, event_history(self.model, address,
                                                     self.notes.get(address, [])))
                seen_op = self.violation_op.get(address, self.o.ops)
                d.faults_before = [f"{kind} at op {op}" for op, kind in self.fault_log
                                   if op <= seen_op]
                if address in self.late and address in incident_addresses:
                    d.attributed_to = (f"{self.late[address]}: the publisher broke the "
                                       "contract and the tracker raised an incident")
                    late.append(d)
                    continue
                if address in self.late:
                    d.attributed_to = f"{self.late[address]}, but NO incident: silent loss"
                d.explain = self._explain(r, s3, address, obj.repository)
                live.append(d)
        finally:
            r.close()
        lost = sorted({kind for _, kind in self.fault_log
                       if kind in {k.value for k in FAILS_CLOSED}})
        for inc in incidents:
            if inc.address in self.late:
                inc.legitimate, inc.why = True, self.late[inc.address]
            elif inc.type == "fail_closed" and lost:
                # the log lost records Redis never applied: failing closed is the safe answer
                inc.legitimate, inc.why = True, f"after {', '.join(lost)}"
            elif inc.type == "rebuilt" and not inc.address:
                # the record of a rebuild (an address would be an exported reference that
                # landed on a reaped one: a live object lost, never legitimate)
                inc.legitimate, inc.why = True, "rebuilt from the service's state export"
        # Without reconciler runs only the online path reclaims: its garbage is the target.
        garbage = (allowed if self.o.reconcile
                   else self.model.truth(now).online_garbage) & written
        # A dead-lettered event that named an address put a hold on it (SPEC safety 10): it is
        # kept until an operator resolves the dead letter, which the soak does not play.
        held = self._held() | self.operator_holds
        # Every repository counts, fail-closed ones included: failing closed is safe, but the
        # promise is that garbage still goes, so what they keep is garbage not reclaimed.
        reclaimable = {a for a in garbage if a not in held}
        left = sorted(reclaimable & listed)
        # The product's own reading of each object left (the first few): why it was kept.
        r = redis_sync(self.servers.daemon_settings)
        try:
            why_left = {a: self._explain(r, s3, a, self.model.objects[a].repository)
                        for a in left[:10]}
        finally:
            r.close()
        closed_garbage = sum(1 for a in left if "*" in closed
                             or self.model.objects[a].repository in closed)
        planned = Counter(s.action.value for s in self.steps
                          if isinstance(s.action, FaultKind))
        return SoakVerdict(
            seed=self.o.seed, ops=self.o.ops, repos=self.o.repos,
            faults_selected=sorted(k.value for k in self.o.faults),
            ops_by_kind=dict(sorted(self.ops_by_kind.items())), ops_refused=self.ops_refused,
            faults_planned=dict(sorted(planned.items())),
            faults_injected=dict(sorted(self.faults_injected.items())),
            fault_errors=self.fault_errors, reconciler_runs=self.runs,
            live_deleted=live, late_deleted=late,
            beyond_contract=dict(sorted(self.beyond_contract.items())),
            objects_written=len(written),
            rebuilds=sum(i.type == "rebuilt" and not i.address for i in incidents),
            rebuild_exports=self.rebuild_exports,
            dlq_replayed=self.dlq_replayed, dlq_resolved=self.dlq_resolved,
            operator_holds=len(self.operator_holds), paused_spans=self.paused_spans,
            reclaimable=len(reclaimable), reclaimed=len(reclaimable) - len(left),
            garbage_left_sample=left[:10], garbage_left_why=why_left,
            fail_closed_repos=sorted(closed),
            fail_closed_garbage=closed_garbage, fail_closed_periods=self.fail_closed_periods,
            incidents=incidents, dead_lettered=await self._dead_lettered(),
            log_regressions=await self._log_regressions(),
            daemons={n: {"starts": d.starts, "kills": d.kills, "exits": d.exits}
                     for n, d in self.sup.daemons.items()},
            checks=self.checks, tracker_caught_up=caught_up,
            max_horizon_lag_s=round(self.max_horizon_lag, 1),
            phases_s={k: round(v, 2) for k, v in self.phases.items()},
            elapsed_s=round(self._elapsed(), 2))

    def _explain(self, r: Any, s3: Any, address: str, repo: str) -> list[str]:
        from hardelete.status import explain_address

        try:
            ex = explain_address(r, self.servers.daemon_settings, address, repo, s3)
        except Exception as exc:
            return [f"explain failed: {type(exc).__name__}: {exc}"]
        return [f"state={ex.state}: {ex.verdict}", *ex.lines]

    def _held(self) -> set[str]:
        """Addresses under a hold: exact ones, and every object under a prefix hold (a
        dead-lettered event that named no readable address holds its whole namespace)."""
        r = redis_sync(self.settings)
        try:
            held = {a for repo in self.model.repositories
                    for a in r.hkeys(RepoKeys(repo).holds)}
            prefixes = tuple(p for repo in self.model.repositories
                             for p in r.hkeys(RepoKeys(repo).hold_prefixes))
            if prefixes:
                held |= {a for a in self.model.objects if a.startswith(prefixes)}
            return held
        finally:
            r.close()

    def _incidents(self) -> list[IncidentRecord]:
        r = redis_sync(self.settings)
        out = []
        try:
            for repo in sorted(r.smembers(REPOS)):
                for raw in r.lrange(RepoKeys(repo).incidents, 0, -1):
                    inc = orjson.loads(raw)
                    out.append(IncidentRecord(
                        repo, str(inc.get("address")), str(inc.get("type")), False,
                        "no deliberate contract violation explains it"))
        finally:
            r.close()
        return out

    async def _log_regressions(self) -> list[str]:
        """Partitions whose log ends below what a repository says it applied: the log went
        back (reset or lost tail) and new records reuse offsets the tracker skips."""
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap)
        out: list[str] = []
        r = redis_async(self.settings)
        try:
            await c.start()
            topic = self.settings.events_topic
            tps = await topic_partitions(c, topic)
            if not tps:
                raise RuntimeError(f"no partitions of {topic} in the broker's metadata")
            end_of = {tp.partition: int(end) for tp, end in (await c.end_offsets(tps)).items()}
            # hd:log holds what the trackers applied from each partition's log (epoch:offset:
            # fingerprint): an offset at or past the log's end there is a reset they missed.
            for fld, value in (await r.hgetall(LOG)).items():
                t, _, part = fld.rpartition(":")
                if t != topic or not part.isdigit():
                    continue
                _, offset, _ = value.split(":", 2)
                end = end_of.get(int(part))
                if end is not None and int(offset) >= end:
                    out.append(f"partition {part}: applied offset {offset} but the log ends at "
                               f"{end}")
        except Exception as exc:
            out.append(f"could not compare: {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):
                await c.stop()
            with contextlib.suppress(Exception):
                await r.aclose()
        return out

    async def _dead_lettered(self) -> int:
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap)
        try:
            await c.start()
            tps = await topic_partitions(c, self.settings.dlq_topic)
            ends = await c.end_offsets(tps) if tps else {}
            return int(sum(ends.values()))
        except Exception:
            return -1
        finally:
            with contextlib.suppress(Exception):
                await c.stop()
