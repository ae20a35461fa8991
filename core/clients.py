"""Small adapters that build the Redis and S3 clients from the settings (one place)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import boto3
import redis
import redis.asyncio as aredis
from botocore.config import Config

from core.settings import Settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def s3_client(settings: Settings, max_pool: int = 32, *, retries: bool = True) -> S3Client:
    """A boto3 S3 client; also used inside Spark tasks (settings are picklable).

    ``retries=False``: botocore never retries (one attempt per request), and it waits at most
    ``s3_request_seconds`` to connect and per read: the one deleter's client
    (``core.deleter``), which re-judges before each of its own retries and whose requests the
    store refuses after that bound."""
    # (botocore's own defaults when None: 60 s)
    timeout = None if retries else settings.s3_request_seconds
    client: S3Client = boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url or None,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key,
        config=Config(
            max_pool_connections=max_pool,
            retries=({"max_attempts": 5, "mode": "adaptive"} if retries
                     else {"total_max_attempts": 1, "mode": "standard"}),
            s3={"addressing_style": "path"},
            connect_timeout=timeout,
            read_timeout=timeout,
        ),
    )
    return client


def split_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/some/key' -> ('bucket', 'some/key')."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


async def topic_partitions(consumer: Any, topic: str) -> list[Any]:
    """``topic``'s partitions (TopicPartitions, in order) as a metadata request sent now sees
    them; empty when there is no such topic. (aiokafka's ``partitions_for_topic`` knows only
    the topics in the client's own metadata, which ``topics()`` does not fill: for a topic the
    consumer neither subscribed to nor was assigned, it is None on Apache Kafka.)"""
    from aiokafka import TopicPartition

    md = await consumer._client.fetch_all_metadata()
    return [TopicPartition(topic, p) for p in sorted(md.partitions_for_topic(topic) or ())]


def redis_sync(settings: Settings) -> Any:
    """A synchronous client (RedisCluster when redis_cluster is set)."""
    if settings.redis_cluster:
        return redis.RedisCluster.from_url(settings.redis_url, decode_responses=True)
    return redis.Redis.from_url(settings.redis_url, decode_responses=True, protocol=3)


def redis_async(settings: Settings) -> Any:
    """An asyncio client (RedisCluster when redis_cluster is set)."""
    if settings.redis_cluster:
        return aredis.RedisCluster.from_url(settings.redis_url, decode_responses=True)
    return aredis.Redis.from_url(settings.redis_url, decode_responses=True, protocol=3)
