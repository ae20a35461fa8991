"""Worlds for the reconciler's end-to-end tests: the model service writes real objects and
manifests to the S3 server, its events go through the tracker's own apply script into the real
Redis; cutoffs and grace waits on the wall clock; a short history of expired commits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from core.clock import redis_time_ms
from reconciler.s3io import Namespace
from schemas.layout import PROGRESS, PROGRESS_META, REPOS
from sim.model import Model, ModelService, Workload, seeded_ids
from sim.testing import apply_lua, lua_batches
from tracker import codec

BUCKET = "recon"


class Clock:
    """The model's clock: settable, moves on a little at every call."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@dataclass
class World:
    settings: Any
    s3: Any
    r: Any
    clock: Clock
    model: Model
    svc: ModelService
    gate: codec.Gate = field(default_factory=codec.Gate)
    applied: int = 0
    # No upload the tracker recorded is protected past this (Redis-clock ms; see boundary).
    issued_until_ms: int = 0

    def track(self, now_ms: int | None) -> None:
        """Apply the model's new events with the tracker's script (tracker clock now_ms)."""
        events = self.model.events[self.applied:]
        batch, rejected = lua_batches(events, self.gate, first_offset=self.applied)
        assert not rejected
        ttls = [e[3] for chunk in batch.values() for e in chunk if e[1] == codec.OP_ISSUE]
        apply_lua(self.r, batch, now_ms)
        if ttls:  # the script's expiry is its clock at the apply plus the ttl: at most this
            applied_ms = now_ms if now_ms is not None else redis_time_ms(self.r)
            self.issued_until_ms = max(self.issued_until_ms, applied_ms + max(ttls))
        self.applied += len(events)
        if batch:  # the daemon registers repositories beside the per-repository script
            self.r.sadd(REPOS, *batch)
        # a tracker that is caught up and keeps up (its progress moves on as time passes)
        self.r.hset(PROGRESS_META, mapping={"topic": "t", "partitions": "1"})
        sec, _ = self.r.time()
        self.r.hset(PROGRESS, "0", str((int(sec) + 86_400) * 1000))

    def run(self, ops: Any) -> None:
        asyncio.run(_run(self.svc, ops))

    def keys(self, repo: str) -> set[str]:
        ns = Namespace(self.model.repository(repo).storage_namespace)
        out: set[str] = set()
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=ns.bucket,
                                                                        Prefix=ns.prefix):
            out.update(f"s3://{ns.bucket}/{o['Key']}" for o in page.get("Contents", ()))
        return out

    def data(self, repo: str) -> set[str]:
        ns = self.model.repository(repo).storage_namespace
        return {k for k in self.keys(repo) if k.startswith(ns + "data/")}


async def _run(svc: ModelService, ops: Any) -> None:
    if isinstance(ops, Workload):
        await svc.run_workload(ops)
        return
    for fn, args in ops:
        await svc.call(fn, *args)


def boundary(w: World | None = None) -> int:
    """A cutoff after everything written so far (the store keeps whole seconds), and wait
    until the wall clock passes it so that later writes are not older than it.

    With ``w``, also after every upload expiry its tracker recorded: the reconciler keeps an
    address whose upload is protected past the run's cutoff (``issued``), so an upload applied
    less than its ttl before a whole second would otherwise stay protected by that cutoff."""
    start = max(time.time(), (w.issued_until_ms / 1000.0) if w is not None else 0.0)
    cutoff = (int(start) + 1) * 1000
    while time.time() * 1000 < cutoff + 5:
        time.sleep(0.02)
    return cutoff


def past_grace(settings: Any, repo: str = "") -> None:
    """Wait until the grace window of everything the tracker applied so far has passed (the
    reconciler never marks an address unreferenced for less than the grace window)."""
    until = time.time() + settings.grace_for(repo) + 0.2
    while time.time() < until:
        time.sleep(0.02)


def make_world(settings: Any, s3: Any, r: Any, seed: int = 7) -> World:
    clock = Clock(time.time() - 2 * 3600)
    model = Model(clock=clock, upload_ttl_seconds=60, new_id=seeded_ids(seed),
                  upload_secret=settings.upload_token_secret)
    return World(settings, s3, r, clock, model, ModelService(settings, s3, None, model=model))


DAY = 86_400.0


def make(rsettings: Any, s3: Any, r: Any) -> World:
    w = make_world(rsettings, s3, r)
    w.model.upload_ttl_seconds = 0.05  # upload protection ends at once: not what is tested
    return w


def call(w: World, fn: Any, *args: Any, **kwargs: Any) -> Any:
    return asyncio.run(w.svc.call(fn, *args, **kwargs))


def history(w: World, ns: str) -> dict[str, Any]:
    """main: C1..C4 a day apart, ten to seven days ago, each replacing the one path of the
    last; retention one day, so C1..C3 are expired and P1..P3 are committed garbage."""
    now = time.time()
    call(w, Model.create_repository, "r", ns, default_retention_days=1.0)
    commits, addrs = [], []
    for i in range(4):
        if i:
            call(w, Model.delete, "r", "main", f"p{i}")
        addrs.append(call(w, Model.write, "r", "main", f"p{i + 1}", 10).address)
        commits.append(call(w, Model.commit, "r", "main", at=now - (10 - i) * DAY).commit.id)
    w.track(None)
    past_grace(w.settings)
    return {"commits": commits, "addrs": addrs}
