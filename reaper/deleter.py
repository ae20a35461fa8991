"""Bulk deletes from S3: ``delete_objects`` with at most 1,000 keys per request, several requests
in flight, per-key errors and throttling retried with jittered exponential backoff.

The outcome separates what the store *confirmed* deleted from what failed, so reports count only
confirmed deletes. Every key passes :func:`schemas.layout.namespace_key` first: a key outside the
namespace or under a reserved prefix is refused here, whatever the caller asked.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from hardelete.clients import split_s3_uri
from hardelete.logs import get_logger
from schemas.layout import OutsideNamespace, namespace_key

S3_MAX_KEYS = 1000  # real S3 refuses more (moto accepts 1,001: enforce it ourselves)
RETRYABLE = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                       "503", "500", "Throttling", "ThrottlingException", "RequestLimitExceeded"})
log = get_logger(__name__)


@dataclass
class DeleteOutcome:
    deleted: list[str] = field(default_factory=list)  # addresses the store confirmed
    failed: dict[str, str] = field(default_factory=dict)  # address -> last error code
    refused: dict[str, str] = field(default_factory=dict)  # address -> why it was not attempted
    requests: int = 0
    retries: int = 0

    def merge(self, other: DeleteOutcome) -> None:
        self.deleted += other.deleted
        self.failed.update(other.failed)
        self.refused.update(other.refused)
        self.requests += other.requests
        self.retries += other.retries


class S3Deleter:
    def __init__(self, client: Any, *, concurrency: int = 8, batch_keys: int = S3_MAX_KEYS,
                 max_attempts: int = 6, base_delay: float = 0.05, max_delay: float = 5.0) -> None:
        if not 1 <= batch_keys <= S3_MAX_KEYS:
            raise ValueError(f"batch_keys must be 1..{S3_MAX_KEYS}")
        self._client = client
        self._sem = asyncio.Semaphore(concurrency)
        self._batch = batch_keys
        self._attempts = max_attempts
        self._base = base_delay
        self._max = max_delay

    def _backoff(self, attempt: int) -> float:
        # Full jitter: spreads retries of many reapers hitting one throttled prefix.
        return random.uniform(0, min(self._max, self._base * 2**attempt))

    async def delete(self, namespace: str, addresses: list[str]) -> DeleteOutcome:
        """Delete addresses of one namespace; return what was confirmed, failed, refused."""
        outcome = DeleteOutcome()
        by_bucket: dict[str, dict[str, str]] = defaultdict(dict)  # bucket -> key -> address
        for address in addresses:
            try:
                namespace_key(namespace, address)
            except OutsideNamespace as exc:
                outcome.refused[address] = str(exc)
                log.error("delete refused", address=address, reason=str(exc))
                continue
            bucket, key = split_s3_uri(address)
            by_bucket[bucket][key] = address
        tasks = []
        for bucket, keys in by_bucket.items():
            items = list(keys.items())
            for i in range(0, len(items), self._batch):
                tasks.append(self._delete_batch(bucket, dict(items[i:i + self._batch])))
        for part in await asyncio.gather(*tasks):
            outcome.merge(part)
        return outcome

    async def _delete_batch(self, bucket: str, keys: dict[str, str]) -> DeleteOutcome:
        outcome = DeleteOutcome()
        pending = dict(keys)
        last_error: dict[str, str] = {}
        for attempt in range(self._attempts):
            if not pending:
                break
            if attempt:
                outcome.retries += 1
                await asyncio.sleep(self._backoff(attempt))
            outcome.requests += 1
            try:
                async with self._sem:
                    resp = await asyncio.to_thread(
                        self._client.delete_objects, Bucket=bucket,
                        Delete={"Objects": [{"Key": k} for k in pending], "Quiet": True},
                    )
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", "ClientError"))
                for k in pending:
                    last_error[k] = code
                if code in RETRYABLE:
                    continue
                break
            except BotoCoreError as exc:  # connection trouble: retry the whole request
                for k in pending:
                    last_error[k] = type(exc).__name__
                continue
            # Quiet mode: S3 answers a 200 listing only the keys it failed to delete; every
            # other key of the request is confirmed deleted by the store.
            errors = {e.get("Key", ""): e.get("Code", "Error") for e in resp.get("Errors", [])}
            for k in list(pending):
                if k not in errors:
                    outcome.deleted.append(pending.pop(k))
                else:
                    last_error[k] = errors[k]
                    if errors[k] not in RETRYABLE:
                        outcome.failed[pending.pop(k)] = errors[k]
            if not pending:
                break
        for k, address in pending.items():
            outcome.failed[address] = last_error.get(k, "unconfirmed")
        return outcome
