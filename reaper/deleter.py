"""The reaper's bulk deleter: the one deleter core (``core.gate.delete_keys``) run in
threads, several requests in flight.

The outcome separates what the store *confirmed* deleted (listed under ``Deleted``) from what
failed, what was refused (outside the namespace or under a reserved prefix: never attempted)
and what the caller's recheck kept right before the request (held, fail-closed, paused, not
owned, or no longer garbage by the judgment), so reports count only confirmed deletes.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.clients import split_s3_uri
from core.gate import S3_MAX_KEYS, TRANSIENT_CODES, RetryPolicy, delete_keys
from core.logs import get_logger
from schemas.layout import OutsideNamespace, namespace_key

RETRYABLE = TRANSIENT_CODES
# addresses -> {address: reason to keep}; called right before every request (in a thread)
AddressRecheck = Callable[[list[str]], Mapping[str, str]]
log = get_logger(__name__)


@dataclass
class DeleteOutcome:
    deleted: list[str] = field(default_factory=list)  # addresses the store confirmed
    failed: dict[str, str] = field(default_factory=dict)  # address -> last error code
    refused: dict[str, str] = field(default_factory=dict)  # address -> why it was not attempted
    kept: dict[str, str] = field(default_factory=dict)  # address -> reason the recheck kept it
    requests: int = 0
    retries: int = 0

    def merge(self, other: DeleteOutcome) -> None:
        self.deleted += other.deleted
        self.failed.update(other.failed)
        self.refused.update(other.refused)
        self.kept.update(other.kept)
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
        self._policy = RetryPolicy(max_attempts, base_delay, max_delay)
        self._rng = random.Random()

    async def delete(self, namespace: str, addresses: list[str],
                     recheck: AddressRecheck | None = None) -> DeleteOutcome:
        """Delete addresses of one namespace; return what was confirmed, failed, refused, kept.

        ``recheck`` (addresses -> reasons to keep) runs right before every request.
        """
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
                tasks.append(self._delete_batch(bucket, dict(items[i:i + self._batch]), recheck))
        for part in await asyncio.gather(*tasks):
            outcome.merge(part)
        return outcome

    async def _delete_batch(self, bucket: str, keys: dict[str, str],
                            recheck: AddressRecheck | None) -> DeleteOutcome:
        key_recheck = None
        if recheck is not None:
            def key_recheck(batch: list[str]) -> dict[str, str]:
                keep = recheck([keys[k] for k in batch])
                return {k: keep[keys[k]] for k in batch if keys[k] in keep}

        async with self._sem:
            res = await asyncio.to_thread(delete_keys, self._client, bucket, list(keys),
                                          policy=self._policy, recheck=key_recheck,
                                          rng=self._rng)
        return DeleteOutcome(
            deleted=[keys[k] for k in res.deleted],
            failed={keys[k]: code for k, code in res.codes.items()},
            kept={keys[k]: why for k, why in res.kept.items()},
            requests=res.requests, retries=res.retries)
