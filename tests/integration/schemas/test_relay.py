"""The relay against a real broker (Apache Kafka): a tick is answered with each stripe's
committed counter read after the tick arrived, a re-send publishes the range again or says it
is gone, and every outbox row reaches the log at least once across a relay that dies between
the broker's acknowledgement and its own record of it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from core.settings import Settings
from schemas import control, reaper_auth
from schemas import events as ev
from schemas.outbox import Outbox
from schemas.relay import Relay

KEY = b"tracker-key"
NS = "s3://b/r/"


def tag(repo: str, i: int) -> ev.TagCreated:
    return ev.TagCreated(repository=repo, tag=f"v{i}", commit_id="c", ref_version=i + 1)


class Log:
    """The events topic as a tracker reads it, from the start: (partition, offset, event)."""

    def __init__(self, settings: Settings) -> None:
        self.seen: list[tuple[int, int, ev.Event]] = []
        self._consumer = AIOKafkaConsumer(
            settings.events_topic, bootstrap_servers=settings.kafka_bootstrap,
            group_id=f"test-{uuid.uuid4().hex[:8]}", auto_offset_reset="earliest",
            enable_auto_commit=False, session_timeout_ms=3000, heartbeat_interval_ms=1000)

    async def __aenter__(self) -> Log:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def until(self, done: Callable[[list[ev.Event]], bool], timeout: float = 30.0
                    ) -> list[ev.Event]:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            assert time.monotonic() < deadline, [e.TYPE for e in self.events]
            for tp, records in (await self._consumer.getmany(timeout_ms=200)).items():
                self.seen += [(tp.partition, r.offset, ev.decode(r.value)) for r in records]
        return self.events

    @property
    def events(self) -> list[ev.Event]:
        return [e for _, _, e in sorted(self.seen, key=lambda x: (x[0], x[1]))]


async def send_control(settings: Settings, *messages: control.ControlMessage) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for m in messages:
            await producer.send_and_wait(settings.control_topic, control.encode(m), key=m.key)
    finally:
        await producer.stop()


def marks(events: list[ev.Event], tick_id: str) -> dict[int, ev.Watermark]:
    return {e.stripe: e for e in events if isinstance(e, ev.Watermark) and e.tick_id == tick_id}


async def test_a_tick_is_answered_with_the_counters_committed_when_it_arrived(
        settings: Settings, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "service.db")
    with outbox.transaction() as tx:
        tx.emit(ev.RepositoryCreated(repository="r", storage_namespace=NS,
                                     default_branch="main", default_retention_days=7,
                                     stripes=2))
        for i in range(3):
            tx.emit(tag("r", i), stripe=i % 2)
    async with Relay(settings, outbox) as relay, Log(settings) as log:
        first = control.signed_tick(KEY, "r", 1000, [2, 1], tick_id="t1")
        await send_control(settings, first)
        got = marks(await log.until(lambda es: len(marks(es, "t1")) == 2), "t1")
        assert {k: w.seq for k, w in got.items()} == {0: 3, 1: 1}
        w = got[0]
        assert w.incarnation == outbox.incarnation and w.tick_ms == 1000
        assert w.tick_applied == [2, 1]  # carried back as received
        assert reaper_auth.tick_problem(KEY, "r", w.tick_ms, w.tick_id, w.tick_sig,
                                        w.tick_applied) is None
        # in the repository's partition every event up to M comes before its watermark
        before = log.events[:log.events.index(w)]
        assert sorted(e.seq for e in before if isinstance(e, ev.ServiceEvent)
                      and e.stripe == 0) == [1, 2, 3]
        # committed after the first tick, before the second: counted by the second only
        with outbox.transaction() as tx:
            tx.emit(tag("r", 7), stripe=1)
            tx.emit(tag("r", 8), stripe=1)
        await send_control(settings, control.signed_tick(KEY, "r", 2000, tick_id="t2"))
        got = marks(await log.until(lambda es: len(marks(es, "t2")) == 2), "t2")
        assert {k: w.seq for k, w in got.items()} == {0: 3, 1: 3}
        # a tick for a repository this outbox never held is another service's
        assert await relay.answer(control.signed_tick(KEY, "elsewhere", 3000)) == 0
    outbox.close()


async def test_a_resend_publishes_the_range_again_or_says_it_is_gone(
        settings: Settings, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "service.db")
    with outbox.transaction() as tx:
        sent = [tx.emit(tag("r", i)) for i in range(6)]
    inc = outbox.incarnation
    async with Relay(settings, outbox) as relay, Log(settings) as log:
        await log.until(lambda es: len(es) == 6)
        await relay.publish_pending()  # (waits for the flush in flight: its rows are marked)
        assert outbox.trim("r", 0, 3) == 3  # the tracker's horizon covered 1..3
        await send_control(settings, control.Resend(repository="r", stripe=0, incarnation=inc,
                                                    from_seq=2, to_seq=100))
        events = await log.until(lambda es: any(isinstance(e, ev.RangeGone) for e in es)
                                 and len(es) == 10)
        gone = [e for e in events if isinstance(e, ev.RangeGone)]
        assert [(g.from_seq, g.to_seq, g.incarnation) for g in gone] == [(2, 3, inc)]
        assert "trimmed" in gone[0].reason
        assert events[6:9] == sent[3:6]  # the same events (ids, seqs) as first published
        # the store was restored since: what the old incarnation's rows do not hold is gone,
        # up to the range's end (those seqs will be reused)
        outbox.restored()
        assert await relay.answer(control.Resend(repository="r", stripe=0, incarnation=inc,
                                                 from_seq=1, to_seq=8)) == 5
        events = await log.until(lambda es: len(es) == 15)
        assert events[10:13] == sent[3:6]
        gone = [e for e in events[13:] if isinstance(e, ev.RangeGone)]
        assert [(g.from_seq, g.to_seq) for g in gone] == [(1, 3), (7, 8)]
        assert all("restored" in g.reason for g in gone)
    outbox.close()


async def test_a_break_is_kept_and_every_later_watermark_of_its_stripe_carries_it(
        settings: Settings, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "service.db")
    with outbox.transaction() as tx:
        tx.emit(ev.RepositoryCreated(repository="r", storage_namespace=NS,
                                     default_branch="main", default_retention_days=7,
                                     stripes=2))
    inc = outbox.incarnation
    async with Relay(settings, outbox) as relay, Log(settings) as log:
        stale = control.broken("r", 0, "an older incarnation", "x")
        await send_control(settings, control.broken("r", 1, inc, "an event without a seq"),
                           control.broken("r", 1, inc, "again"), stale,
                           control.broken("elsewhere", 0, inc, "not this outbox's"),
                           control.signed_tick(KEY, "r", 1000, tick_id="t1"))
        got = marks(await log.until(lambda es: len(marks(es, "t1")) == 2), "t1")
        # (the control topic is read in order: the breaks were kept before the tick came)
        assert {k: w.broken for k, w in got.items()} == {0: None, 1: "an event without a seq"}
        assert outbox.breaks("r") == {(1, inc): "an event without a seq"}
        assert outbox.breaks("elsewhere") == {}
        assert relay.stats.breaks == 2  # (a repeat is recorded again, idempotently)
        await send_control(settings, control.signed_tick(KEY, "r", 2000, tick_id="t2"))
        got = marks(await log.until(lambda es: len(marks(es, "t2")) == 2), "t2")
        assert got[1].broken == "an event without a seq" and got[0].broken is None
        # a restored store: the new incarnation's watermarks carry no old break
        new = outbox.restored()
        await send_control(settings, control.signed_tick(KEY, "r", 3000, tick_id="t3"))
        got = marks(await log.until(lambda es: len(marks(es, "t3")) == 2), "t3")
        assert {(w.incarnation, w.broken) for w in got.values()} == {(new, None)}
    outbox.close()


class _Died(BaseException):
    """The relay's process dying right after the broker acknowledged its batch."""


class DyingRelay(Relay):
    async def _mark_published(self, ids: object) -> None:
        raise _Died


async def test_every_row_is_published_at_least_once_across_a_relay_crash(
        settings: Settings, tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "service.db")
    with outbox.transaction() as tx:  # committed while no relay runs
        rows = [tx.emit(tag("r", i)) for i in range(5)]
    async with DyingRelay(settings, outbox), Log(settings) as log:
        await log.until(lambda es: len(es) == 5)
        # its publishing task died before recording the acknowledgement
        assert len(outbox.unpublished()) == 5
    async with Relay(settings, outbox) as relay:
        with outbox.transaction() as tx:  # and one committed while the new relay runs
            rows.append(tx.emit(tag("r", 5)))
        async with Log(settings) as log:
            events = await log.until(lambda es: len(es) == 11)
        await relay.publish_pending()  # (waits for the flush in flight, finds nothing more)
    assert events == rows[:5] + rows  # every seq, the crashed batch twice, nothing lost
    assert outbox.unpublished() == []
    outbox.close()


async def test_the_model_service_with_an_outbox_publishes_through_its_relay(
        settings: Settings, s3: object, tmp_path: Path) -> None:
    from schemas.publisher import Publisher
    from sim.model import Model, ModelService

    outbox = Outbox(tmp_path / "service.db")
    model = Model.from_settings(settings, outbox=outbox)
    async with Publisher(settings) as pub, Relay(settings, outbox), Log(settings) as log:
        svc = ModelService(settings, s3, pub, model=model)  # type: ignore[arg-type]
        await svc.call(Model.create_repository, "m", "s3://model-relay/m/", stripes=2)
        await svc.call(Model.write, "m", "main", "a", 3)
        await svc.call(Model.commit, "m", "main")
        assert pub.published == 0 and svc.objects_written == 1  # the relay publishes
        events = await log.until(lambda es: len(es) == len(model.events))
    assert sorted(events, key=lambda e: e.event_id) == sorted(model.events,
                                                             key=lambda e: e.event_id)
    assert all(isinstance(e, ev.ServiceEvent) and e.seq for e in events)
    outbox.close()
