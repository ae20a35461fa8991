"""Fixtures: real servers (Apache Kafka, Redis/Valkey, MinIO) started once per worker on free
loopback ports by the same launcher the demo uses; each test gets fresh topics (deleted after
it), a flushed Redis and an S3 server without buckets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from core.clients import redis_sync, s3_client
from core.settings import Settings
from sim.sequenced import SequencedService
from sim.stack import (
    KAFKA_JVM_EXTRA,
    Server,
    Stack,
    embedded_stack,
    reset_s3,
    start_redis_cluster,
)
from sim.testing import base_settings, misplaced_tests

# Property tests check outcomes, not speed: on 2 cores under 3 workers an example can take
# longer than hypothesis' 200 ms default deadline, which failed a run for no bug.
hypothesis_settings.register_profile("hardelete", deadline=None)
hypothesis_settings.load_profile("hardelete")

os.environ.setdefault("HARDELETE_LOG_FORMAT", "console")
# The JIT's top tier (C2) costs a short-lived JVM more CPU than it wins back: the suite's Kafka
# brokers and Spark drivers run C1 only, which halved their CPU on this 2-core machine (a broker
# started, given ten topics and idle: 7.3 -> 3.4 s; a Spark session and a few jobs: 29-33 ->
# 16-18 s). The environment carries it to the Spark drivers of the CLI processes tests start.
QUICK_JVM = "-XX:TieredStopAtLevel=1"
if QUICK_JVM not in KAFKA_JVM_EXTRA:
    KAFKA_JVM_EXTRA.append(QUICK_JVM)
os.environ.setdefault("PYSPARK_SUBMIT_ARGS",
                      f"--conf spark.driver.defaultJavaOptions={QUICK_JVM} pyspark-shell")
# pytest-xdist's workers export the runner's COLUMNS; the CLI subprocesses the tests start
# must size their tables as a user's pipe would (full width), not as the runner's terminal.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


_INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The folder tells a test's kind: ``tests/unit`` (pure, no server) and
    ``tests/integration`` (real servers, marked ``integration``: ``-m "not integration"`` runs
    the unit tests alone). A unit test that asks for a server is refused here.

    Tests marked ``slow`` first: the suite runs on parallel workers (pytest-xdist), and a
    long test started last would run alone at the end."""
    kinds = []
    for item in items:
        integration = _INTEGRATION in Path(str(item.path)).parents
        if integration:
            item.add_marker(pytest.mark.integration)
        kinds.append((item.nodeid, integration, getattr(item, "fixturenames", ())))
    misplaced = misplaced_tests(kinds)
    if misplaced:
        raise pytest.UsageError("tests that reach a server belong in tests/integration/: "
                                + "; ".join(misplaced))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    wd: Path = tmp_path_factory.mktemp("stack")
    with embedded_stack(base_settings(), redis_aof=True, workdir=wd) as st:
        yield st
        _TOPIC_DELETION.join()  # (before the broker stops)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """A real three-node Redis Cluster (valkey-server in cluster mode), started once per worker
    the first time a test asks for the ``cluster`` topology."""
    nodes = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"), 3)
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> str:
    """``single`` (one Redis) unless the test is parametrized over both: the safety tests run
    on each (issue 19 item 9: the scale-out path keeps every check), a module opting in with
    ``pytestmark = pytest.mark.parametrize("topology", ["single", "cluster"], indirect=True)``."""
    return str(getattr(request, "param", "single"))


@pytest.fixture
def settings(stack: Stack, topology: str, request: pytest.FixtureRequest) -> Iterator[Settings]:
    """Per-test settings: own topics and consumer group on the shared servers, clean state
    (on the worker's Redis Cluster for the ``cluster`` topology)."""
    suffix = uuid.uuid4().hex[:8]
    s = stack.settings.replace(
        events_topic=f"events-{suffix}",
        dlq_topic=f"dlq-{suffix}",
        control_topic=f"control-{suffix}",
        consumer_group=f"tracker-{suffix}",
        tick_interval_seconds=0.1,  # (a test waits for a certified horizon: keep it close)
        resend_interval_seconds=1.0,
    )
    if topology == "cluster":
        nodes = request.getfixturevalue("redis_cluster")
        s = s.replace(redis_url=f"redis://127.0.0.1:{nodes[0].port}/0", redis_cluster=True)
        for n in nodes:  # every primary (FLUSHALL reaches one node only)
            r = redis_sync(s.replace(redis_url=f"redis://127.0.0.1:{n.port}/0",
                                     redis_cluster=False))
            r.flushall()
            r.close()
    else:
        r = redis_sync(s)
        r.flushall()
        r.close()
    reset_s3(s)
    yield s
    # The broker is shared by the worker's tests: it keeps only what a test is using. (In a
    # thread of its own: the test's event loop, if any, must stay the current one.) The
    # controller's answer takes 0.1-2 s; the next test runs meanwhile (its topics have other
    # names), and joins this deletion before it starts its own.
    _TOPIC_DELETION.start(stack.settings.kafka_bootstrap, suffix)


class _TopicDeletion:
    """One test's topic deletion in flight at a time, on a thread of its own."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def start(self, bootstrap: str, suffix: str) -> None:
        self.join()
        self.thread = threading.Thread(target=asyncio.run, daemon=True,
                                       args=(_delete_topics(bootstrap, suffix),))
        self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=30)
            self.thread = None


_TOPIC_DELETION = _TopicDeletion()


async def _delete_topics(bootstrap: str, suffix: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
    with contextlib.suppress(Exception):  # (best effort: a test may have stopped the broker)
        await admin.start()
        try:
            mine = [t for t in await admin.list_topics() if t.endswith(suffix)]
            if mine:
                await admin.delete_topics(mine)
        finally:
            await admin.close()


@pytest.fixture
def sequenced(settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
              ) -> Iterator[SequencedService | None]:
    """The test's service certifies its history: ``sim.testing.publish`` goes through its
    outbox and relay (on a thread of its own: sync tests too), ``wait_horizon`` waits for the
    continuity horizon too. A module opts in with ``pytestmark =
    pytest.mark.usefixtures("sequenced")``; a test of a service that breaks the contract is
    marked ``unsequenced``."""
    if request.node.get_closest_marker("unsequenced") is not None:
        yield None
        return
    with SequencedService(settings, tmp_path / "service") as svc:
        yield svc


@pytest.fixture
def redis_client(settings: Settings) -> Iterator[Any]:
    r = redis_sync(settings)
    yield r
    r.close()


@pytest.fixture
def s3(settings: Settings) -> Any:
    return s3_client(settings)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"bucket-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def cli(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The CLI's environment points at the test's servers and topics."""
    for key, value in {
        "KAFKA_BOOTSTRAP": settings.kafka_bootstrap, "REDIS_URL": settings.redis_url,
        "REDIS_CLUSTER": "true" if settings.redis_cluster else "false",
        "S3_ENDPOINT_URL": settings.s3_endpoint_url, "EVENTS_TOPIC": settings.events_topic,
        "DLQ_TOPIC": settings.dlq_topic, "CONSUMER_GROUP": settings.consumer_group,
        "GRACE_SECONDS": "1", "ALLOW_UNSAFE_GRACE": "true", "LOG_LEVEL": "error",
        "S3_REQUEST_SECONDS": "2", "CLOCK_SKEW_SECONDS": "0",
    }.items():
        monkeypatch.setenv(f"HARDELETE_{key}", value)
    monkeypatch.setenv("COLUMNS", "1000")
    return settings


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session per test worker (about 5 s to start)."""
    from reconciler.spark import get_spark

    session = get_spark(base_settings())
    yield session
    session.stop()
