"""The tracker's side of continuity (schemas/README.md, "Continuity"): ticks and re-sends.

Every ``tick_interval_seconds`` the :class:`Ticker` reads, for each sequenced repository, the
Redis time on the node that holds its records and, in the same script, the highest seq applied
in each stripe; signs both and publishes a ``tick`` on the control topic; the service's relay
answers with a ``watermark`` per stripe, which the apply path certifies (``apply.lua``). It
also asks again for every range of seqs a stripe is missing (``resend``), at most once per
``resend_interval_seconds`` per range, so a lost or not yet published event is fetched from
the service's outbox instead of holding the horizon back for ever. For every stripe it reads
as broken it tells the relay (``broken``, at most once per ``resend_interval_seconds`` per
stripe, for as long as it stays broken): the relay keeps the break in the service's database
and its watermarks carry it back, so a Redis that went back to before the break breaks the
stripe again before it certifies anything.

The Ticker owns its state (what it asked for, and when); it shares the tracker's Redis client
and producer. Safety does not depend on it: a tick that is lost certifies nothing, a re-send
only brings events the fold applies once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer

from core.continuity import Domain, gaps
from core.continuity_store import AsyncContinuityStore, compose
from core.settings import Settings
from schemas import control
from schemas.layout import REPOS, RepoKeys
from tracker.metrics import TrackerMetrics

# The slot's clock and what was applied then, read atomically: every seq applied before the time
# committed before the relay reads M, so a watermark below it is from a store that lags.
# No tick is read while a stripe is broken (atomically with the time): a watermark answering
# a tick read after the break would certify a slot that went back to before it (found by an
# adversarial review). It also forgets the notes of dead-lettered seqs the prefix has passed
# (a fixed replay or a re-send applied them).
_TICK = compose("""
local C = continuity(ARGV[1])
local t = redis.call('TIME')
local node = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local clock = C.clock()
local r = math.max(0, clock - tonumber(ARGV[3]))  -- core.continuity.tick_time
local out = {string.format('%.0f', r), string.format('%.0f', clock), string.format('%.0f', node)}
for k = 0, tonumber(ARGV[2]) - 1 do
  if C.is_broken(k) then out = {} break end
  out[#out + 1] = string.format('%.0f', C.applied_max(k))
end
if #out > 0 then C.issue(r) end
local dead = ARGV[1] .. 'deadseq'
for _, f in ipairs(redis.call('HKEYS', dead)) do
  local k, seq = string.match(f, '^(%d+):(%d+)$')
  if k == nil or tonumber(k) >= tonumber(ARGV[2]) or tonumber(seq) <= C.prefix(tonumber(k)) then
    redis.call('HDEL', dead, f)
  end
end
return out
""")


@dataclass
class TickRound:
    """What one round did."""

    ticks: int = 0
    resends: list[control.Resend] = field(default_factory=list)
    breaks: list[control.Broken] = field(default_factory=list)


class Ticker:
    def __init__(self, settings: Settings, redis: Any, producer: AIOKafkaProducer, key: bytes,
                 metrics: TrackerMetrics, log: Any) -> None:
        self.settings = settings
        self.redis = redis
        self.producer = producer
        self.key = key
        self.metrics = metrics
        self.log = log
        self.store = AsyncContinuityStore(redis)
        self.skew_ms = round(settings.clock_skew_seconds * 1000)
        self._stall_said = -1e9
        self._tick = redis.register_script(_TICK)
        self._asked: dict[tuple[str, int, str, int, int], float] = {}  # range -> monotonic
        self._told: dict[tuple[str, int], float] = {}  # broken stripe -> monotonic

    async def run(self, stop: asyncio.Event) -> None:
        every = self.settings.tick_interval_seconds
        while not stop.is_set():
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis or Kafka trouble: the horizon simply waits
                self.log.warning("tick round failed", error=f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)

    async def sequenced(self) -> dict[str, int]:
        """Sequenced repositories and their declared stripes."""
        repos = sorted(await self.redis.smembers(REPOS))
        if not repos:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for repo in repos:
            pipe.hmget(RepoKeys(repo).meta, ["sequenced", "stripes"])
        out = {}
        for repo, (seqd, stripes) in zip(repos, await pipe.execute(), strict=True):
            if seqd in ("1", b"1"):
                out[repo] = int(stripes or 1)
        return out

    async def round(self) -> TickRound:
        done = TickRound()
        topic = self.settings.control_topic
        stall = 0
        for repo, stripes in (await self.sequenced()).items():
            keys = RepoKeys(repo)
            read = await self._tick(keys=[keys.meta], args=[keys.tag + ":", stripes,
                                                            self.skew_ms])
            if read:  # (none while a stripe is broken)
                at, clock, node, *applied = read
                stall = max(stall, int(clock) - int(node))
                tick = control.signed_tick(self.key, repo, int(at), [int(a) for a in applied])
                await self.producer.send(topic, control.encode(tick), key=tick.key)
                done.ticks += 1
            domains = [await self.store.read(repo, k) for k in range(stripes)]
            for k, d in enumerate(domains):
                done.resends += self._resends(repo, k, d)
            done.breaks += self._breaks(repo, domains)
        told: list[control.ControlMessage] = [*done.breaks, *done.resends]
        for msg in told:
            await self.producer.send(topic, control.encode(msg), key=msg.key)
        await self.producer.flush()
        self.metrics.ticks.inc(done.ticks)
        self._stalled(stall)
        self.metrics.resends.inc(len(done.resends))
        if done.breaks:
            self.log.warning("told relays of broken stripes",
                             stripes=[(m.repository, m.stripe, m.reason[:200])
                                      for m in done.breaks[:10]])
        if done.resends:
            self.log.info("asked relays again for missing seqs",
                          ranges=[(m.repository, m.stripe, m.from_seq, m.to_seq)
                                  for m in done.resends[:10]])
        return done

    def _stalled(self, stall_ms: int) -> None:
        """A slot clock ahead of its node's (the node's clock stepped back, or the slot failed
        over to a replica whose clock is behind) stalls: ticks repeat its time and certify
        nothing new until the node catches up. Safe, but reaping waits: say so."""
        self.metrics.clock_stall.set(stall_ms / 1000)
        now = time.monotonic()
        if stall_ms > max(self.skew_ms, 1000) and now >= self._stall_said + 60:
            self._stall_said = now
            self.log.warning("a repository's slot clock is ahead of its Redis node's clock: "
                             "its ticks wait until the node catches up (a clock stepped back?)",
                             ahead_seconds=round(stall_ms / 1000, 1))

    def _breaks(self, repo: str, domains: list[Domain]) -> list[control.Broken]:
        now = time.monotonic()
        out = []
        for k, d in enumerate(domains):
            if d.broken is None:
                self._told.pop((repo, k), None)
                continue
            if now - self._told.get((repo, k), -1e18) < self.settings.resend_interval_seconds:
                continue
            inc = break_incarnation(domains, k)
            if inc is None:  # no fact of the service's bound one: nothing to tell a relay
                continue
            self._told[(repo, k)] = now
            out.append(control.broken(repo, k, inc, d.broken, d.epoch))
        return out

    def _resends(self, repo: str, stripe: int, d: Any) -> list[control.Resend]:
        if d.incarnation is None:
            return []
        now = time.monotonic()
        out = []
        for a, b in gaps(d):
            key = (repo, stripe, d.incarnation, a, b)
            if now - self._asked.get(key, -1e18) < self.settings.resend_interval_seconds:
                continue
            self._asked[key] = now
            out.append(control.Resend(repository=repo, stripe=stripe, incarnation=d.incarnation,
                                      from_seq=a, to_seq=b))
        if len(self._asked) > 10_000:  # forget old requests (only their timing is kept)
            cutoff = now - self.settings.resend_interval_seconds
            self._asked = {k: t for k, t in self._asked.items() if t >= cutoff}
        return out


def break_incarnation(domains: list[Domain], k: int) -> str | None:
    """The incarnation to report stripe ``k``'s break under: its own, or (a stripe broken
    before any fact of it bound one) the one another stripe of the repository holds: one store,
    one incarnation. None when no stripe holds one."""
    own = domains[k].incarnation
    if own is not None:
        return own
    return next((d.incarnation for d in domains if d.incarnation is not None), None)
