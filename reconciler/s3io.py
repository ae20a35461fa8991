"""S3 helpers used on the driver and inside Spark tasks: namespaces, JSON and Parquet objects."""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from core.clients import s3_client, split_s3_uri
from core.errors import UserError
from core.settings import Settings
from schemas.layout import REPORTS_PREFIX

_CLIENTS: dict[tuple[Settings, bool], Any] = {}
# A run id becomes a key prefix: only what the product writes (``20260101T020000Z-1a2b3c``,
# ``retired-...``), never a path segment such as ``..`` that S3 keeps and MinIO refuses.
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it can name a run's report, else a :class:`UserError` saying why."""
    if not _RUN_ID.fullmatch(run_id):
        raise UserError(f"{run_id!r} is not a run id (letters, digits, '-' and '_', as "
                        "`hardelete reports list` shows them)")
    return run_id


def cached_s3(settings: Settings, *, retries: bool = True) -> Any:
    """One boto3 client per settings per process (Spark reuses its Python workers);
    ``retries=False``: the one deleter's (``core.deleter``: it retries by itself)."""
    client = _CLIENTS.get((settings, retries))
    if client is None:
        client = _CLIENTS[(settings, retries)] = s3_client(settings, max_pool=16,
                                                            retries=retries)
    return client


@dataclass(frozen=True, slots=True)
class Namespace:
    """A storage namespace ``s3://bucket/prefix/`` and its key arithmetic."""

    uri: str

    def __post_init__(self) -> None:
        if not self.uri.startswith("s3://") or not self.uri.endswith("/"):
            raise ValueError(f"storage namespace {self.uri!r} must be s3://bucket/prefix/")
        bucket, _ = split_s3_uri(self.uri)
        if not bucket:
            raise ValueError(f"storage namespace {self.uri!r} has no bucket")

    @property
    def bucket(self) -> str:
        return split_s3_uri(self.uri)[0]

    @property
    def prefix(self) -> str:
        """Key prefix inside the bucket ('' or ending with '/')."""
        return split_s3_uri(self.uri)[1]

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def rel_of_key(self, key: str) -> str | None:
        return key[len(self.prefix):] if key.startswith(self.prefix) else None

    def rel_of_address(self, address: str) -> str | None:
        """Namespace-relative key of an address (full URI or already relative); None if outside."""
        if address.startswith("s3://"):
            return address[len(self.uri):] if address.startswith(self.uri) else None
        if address.startswith("/") or "://" in address:
            return None
        return address

    def address(self, rel: str) -> str:
        return self.uri + rel

    def report_prefix(self, run_id: str) -> str:
        """Bucket key prefix of one run's report."""
        return self.key(f"{REPORTS_PREFIX}{check_run_id(run_id)}/")


def get_json(s3: Any, bucket: str, key: str) -> Any:
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return orjson.loads(body)


def put_json(s3: Any, bucket: str, key: str, value: Any) -> None:
    s3.put_object(Bucket=bucket, Key=key, ContentType="application/json",
                  Body=orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def put_parquet(s3: Any, bucket: str, key: str, columns: dict[str, list[Any]],
                schema: Any = None) -> int:
    """Write columns as one Parquet object; returns its size in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(columns, schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    data = buf.getvalue()
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    return len(data)


def read_parquet_rows(s3: Any, bucket: str, key: str, columns: Sequence[str],
                      optional: Sequence[str] = ()) -> Iterator[tuple[Any, ...]]:
    """Rows (tuples of ``columns`` then ``optional``) of one Parquet object, batch by batch.

    A missing column or an unreadable file raises: callers building a live set must fail.
    A missing ``optional`` column reads as None.
    """
    import pyarrow.parquet as pq

    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    pf = pq.ParquetFile(io.BytesIO(body))
    names = pf.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"s3://{bucket}/{key}: missing column(s) {missing}")
    present = [c for c in optional if c in names]
    for batch in pf.iter_batches(columns=[*columns, *present], batch_size=65_536):
        n = batch.num_rows
        cols = [batch.column(c).to_pylist() if c in columns or c in present else [None] * n
                for c in [*columns, *optional]]
        yield from zip(*cols, strict=True)


def list_keys(s3: Any, bucket: str, prefix: str) -> Iterator[str]:
    """Keys under a prefix (paginated). Only for small metadata prefixes on the driver."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            yield obj["Key"]


def list_dirs(s3: Any, bucket: str, prefix: str) -> Iterator[str]:
    """Common prefixes one level below ``prefix`` (delimiter listing, paginated)."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix,
                                                               Delimiter="/"):
        for cp in page.get("CommonPrefixes", ()):
            yield cp["Prefix"]


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
