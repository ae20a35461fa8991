"""Bulk deletes against the real S3 server, through a fault-injecting HTTP proxy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from core.clients import s3_client
from core.deleter import AsyncDeleter, Deleter, Plan, RetryPolicy
from sim.faultproxy import FaultProxy


def _put_many(s3: Any, bucket: str, keys: list[str]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=b"x"), keys))


def _listed(s3: Any, bucket: str) -> set[str]:
    out: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update(o["Key"] for o in page.get("Contents", []))
    return out




async def test_partial_failures_are_retried_and_reported_truthfully(settings, s3, bucket):
    ns = f"s3://{bucket}/repo/"
    keys = [f"repo/data/0001/{i:04d}" for i in range(250)]
    _put_many(s3, bucket, [*keys, "repo/_hardelete/manifests/m.parquet", "elsewhere/x"])
    with FaultProxy(settings.s3_endpoint_url) as proxy:
        proxy.faults.throttle_deletes = 2
        proxy.faults.fail_keys = {keys[3]: ("InternalError", 2), keys[7]: ("AccessDenied", 99)}
        client = s3_client(settings.replace(s3_endpoint_url=proxy.url), retries=False)
        deleter = AsyncDeleter(Deleter(client), concurrency=4)
        addresses = [f"s3://{bucket}/{k}" for k in keys]
        bad = [f"s3://{bucket}/repo/_hardelete/manifests/m.parquet", f"s3://{bucket}/elsewhere/x"]
        outcome = await deleter.delete(
            Plan(ns, batch_keys=100, retry=RetryPolicy(base_delay=0.01)), addresses + bad)

    assert max(proxy.faults.keys_per_request) <= 100
    assert set(outcome.refused) == set(bad)
    assert outcome.codes == {f"s3://{bucket}/{keys[7]}": "AccessDenied"}
    assert sorted(outcome.deleted) == sorted(a for a in addresses if not a.endswith(keys[7]))
    # Every retry is the gate's own (botocore does not retry its client), so each was judged
    # again first: two for the InternalError key, two for the throttled requests; 3 batches
    # + 4 retries reached the proxy.
    assert outcome.retries == 4
    assert proxy.faults.delete_requests == 7
    # The store agrees with the report: only the failed key and the refused ones remain.
    assert _listed(s3, bucket) == {keys[7], "repo/_hardelete/manifests/m.parquet", "elsewhere/x"}


async def test_deleting_twice_is_harmless(settings, s3, bucket):
    _put_many(s3, bucket, ["repo/data/1/a"])
    deleter = AsyncDeleter(Deleter(s3_client(settings, retries=False)))
    plan = Plan(f"s3://{bucket}/repo/")
    first = await deleter.delete(plan, [f"s3://{bucket}/repo/data/1/a"])
    second = await deleter.delete(plan, [f"s3://{bucket}/repo/data/1/a"])
    assert first.deleted == second.deleted == (f"s3://{bucket}/repo/data/1/a",)
    assert not second.failed


# --- the one deleter's synchronous core ---------------------------------------------------

def test_core_enforces_1000_keys_although_the_server_accepts_more(settings, bucket):
    keys = {f"repo/data/1/{i}": f"s3://{bucket}/repo/data/1/{i}" for i in range(1001)}
    with pytest.raises(ValueError, match="at most 1000"):
        Deleter(s3_client(settings, retries=False)).delete_batch(
            Plan(f"s3://{bucket}/repo/"), bucket, keys)


async def test_wrapper_splits_into_requests_of_at_most_1000(settings, s3, bucket):
    keys = [f"repo/data/1/{i:05d}" for i in range(1001)]
    _put_many(s3, bucket, keys)
    with FaultProxy(settings.s3_endpoint_url) as proxy:
        client = s3_client(settings.replace(s3_endpoint_url=proxy.url), retries=False)
        outcome = await AsyncDeleter(Deleter(client)).delete(
            Plan(f"s3://{bucket}/repo/"), [f"s3://{bucket}/{k}" for k in keys])
    assert sorted(proxy.faults.keys_per_request) == [1, 1000]
    assert len(outcome.deleted) == 1001 and _listed(s3, bucket) == set()


def test_core_recheck_runs_before_every_request_and_a_failing_one_keeps_all(settings, s3,
                                                                            bucket):
    keys = [f"repo/data/1/{i}" for i in range(4)]
    addr = {k: f"s3://{bucket}/{k}" for k in keys}
    _put_many(s3, bucket, keys)
    seen: list[list[str]] = []

    def recheck(batch: list[str]) -> dict[str, str]:
        seen.append([b[len(f"s3://{bucket}/"):] for b in batch])
        # a hold arrives between the first request and its retry
        return {addr[keys[1]]: "held"} if len(seen) > 1 else {}

    with FaultProxy(settings.s3_endpoint_url) as proxy:
        proxy.faults.fail_keys = {keys[0]: ("InternalError", 1), keys[1]: ("SlowDown", 1)}
        client = s3_client(settings.replace(s3_endpoint_url=proxy.url), retries=False)
        out = Deleter(client).delete(
            Plan(f"s3://{bucket}/repo/", recheck=recheck, retry=RetryPolicy(base_delay=0.001)),
            list(addr.values()))
    assert seen == [keys, [keys[0], keys[1]]]
    assert sorted(out.deleted) == sorted(addr[k] for k in (keys[0], keys[2], keys[3]))
    assert out.kept == {addr[keys[1]]: "held"} and out.requests == 2 and out.retries == 1
    assert _listed(s3, bucket) == {keys[1]}

    def broken(batch: list[str]) -> dict[str, str]:
        raise ConnectionError("redis down")

    out = Deleter(s3_client(settings, retries=False)).delete(
        Plan(f"s3://{bucket}/repo/", recheck=broken), [addr[keys[1]]])
    assert out.requests == 0 and out.kept[addr[keys[1]]].startswith("recheck failed")
    assert _listed(s3, bucket) == {keys[1]}
