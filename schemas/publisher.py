"""The publisher library services use to emit events correctly.

``await publisher.publish(event)`` returns once the broker acknowledged the event (acks=all).
Events are keyed by repository, so one repository's events stay in one partition, in the order
each publisher sent them. ``publish_many`` sends a batch and awaits every acknowledgement;
aiokafka batches records per partition under the hood (``linger_ms``).

This publisher uses no idempotent producer: a retried send may duplicate an event, which the
tracker tolerates by design (event ids, reference ids, idempotent apply). A service that
certifies its history publishes through its outbox's relay instead (``schemas/relay.py``, an
idempotent producer: Kafka 4.4 takes it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from schemas.events import Event, encode


class Topics(Protocol):
    """Where the events go: what the publisher and the topic creation read (the runtime's
    settings have these fields; the contract layer names only what it needs)."""

    @property
    def kafka_bootstrap(self) -> str: ...
    @property
    def events_topic(self) -> str: ...
    @property
    def dlq_topic(self) -> str: ...
    @property
    def topic_partitions(self) -> int: ...
    @property
    def topic_replication_factor(self) -> int: ...


# CreateTopics errors that no retry mends (the request itself is wrong for this cluster).
_REFUSALS = {17: "InvalidTopic", 29: "TopicAuthorizationFailed", 37: "InvalidPartitions",
             38: "InvalidReplicationFactor", 39: "InvalidReplicaAssignment", 40: "InvalidConfig",
             42: "PolicyViolation"}


class TopicRefused(RuntimeError):
    """The broker refused to create a topic as configured (no retry helps)."""


def _topic_errors(response: Any) -> list[tuple[str, int, str]]:
    """(topic, error code, message) of each topic the broker did not create. aiokafka returns
    the per-topic errors of a CreateTopics response without raising them."""
    out = []
    for err in getattr(response, "topic_errors", ()):
        topic, code = err[0], err[1]
        message = err[2] if len(err) > 2 and isinstance(err[2], str) else ""
        if code not in (0, 36):  # 36: already exists (a concurrent creator won)
            out.append((topic, code, message or ""))
    return out


async def ensure_topics(settings: Topics, attempts: int = 20, *,
                        extra: Iterable[str] = ()) -> None:
    """Create the events and dead-letter topics (and the ``extra`` ones: the control topic)
    if they do not exist (idempotent). A topic the broker refuses (replication above its broker
    count, say) is an error, not a topic left to auto-creation with the broker's defaults."""
    names = [settings.events_topic, settings.dlq_topic, *extra]
    last: Exception | None = None
    for attempt in range(attempts):
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            wanted = [
                NewTopic(t, settings.topic_partitions, settings.topic_replication_factor)
                for t in dict.fromkeys(names)
                if t not in existing
            ]
            if wanted:
                with contextlib.suppress(TopicAlreadyExistsError):
                    errors = _topic_errors(await admin.create_topics(wanted))
                    refused = [e for e in errors if e[1] in _REFUSALS]
                    if refused:
                        topic, code, message = refused[0]
                        raise TopicRefused(
                            f"{settings.kafka_bootstrap} refused to create topic {topic} "
                            f"({settings.topic_partitions} partitions, replication factor "
                            f"{settings.topic_replication_factor}): {_REFUSALS[code]}: {message}")
                    if errors:  # (a controller moving, a timeout: retried)
                        raise RuntimeError(f"creating topics: {errors}")
            return
        except TopicAlreadyExistsError:
            return
        except TopicRefused:
            raise
        except Exception as exc:  # broker still starting: retry with backoff
            last = exc
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
        finally:
            await admin.close()
    raise RuntimeError(f"could not create topics on {settings.kafka_bootstrap}: {last}")


class Publisher:
    """Async, acks=all, keyed by repository."""

    def __init__(self, settings: Topics, *, linger_ms: int = 5) -> None:
        self.topic = settings.events_topic
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.kafka_bootstrap,
            acks="all",
            linger_ms=linger_ms,
            max_batch_size=1 << 20,
            request_timeout_ms=30_000,
        )
        self.published = 0

    async def start(self) -> Publisher:
        await self._producer.start()
        return self

    async def stop(self) -> None:
        await self._producer.stop()

    async def __aenter__(self) -> Publisher:
        return await self.start()

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def publish(self, event: Event) -> None:
        """Return once the broker has acknowledged the event."""
        await self._producer.send_and_wait(self.topic, encode(event), key=event.key)
        self.published += 1

    async def publish_many(self, events: Iterable[Event]) -> int:
        """Send all, then await every acknowledgement; per-repository order is preserved."""
        futures = [await self._producer.send(self.topic, encode(e), key=e.key) for e in events]
        if futures:
            await asyncio.gather(*futures)
        self.published += len(futures)
        return len(futures)

    async def publish_raw(self, value: bytes, key: bytes) -> None:
        """Publish bytes as they are (tests and tools that exercise the dead-letter path)."""
        await self._producer.send_and_wait(self.topic, value, key=key)
