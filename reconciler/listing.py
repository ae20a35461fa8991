"""The namespace listing, distributed: slices listed with boto3 inside Spark tasks.

Units of listing (namespace-relative prefixes), discovered on the driver with delimiter
listings (small: one entry per prefix, never per object):

* ``data/<slice>/`` - each time slice of seed 002 (reverse-sorted time ids: the
  lexicographically smallest slice is the newest);
* ``data/`` shallow - objects directly under ``data/`` (not in a slice);
* ``<dir>/`` - every other top-level prefix, except the reserved metadata prefixes;
* the namespace root, shallow - objects directly under the namespace.

Each unit is listed (paginated ``list_objects_v2``) inside a Spark task; rows are
``(key, size, last_modified_ms)`` with namespace-relative keys. Nothing is collected on the
driver. An S3-Inventory-style input (Parquet or CSV files with ``key``, ``size``,
``last_modified``) can replace the live listing (:func:`inventory_df`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from core.clients import split_s3_uri
from core.settings import Settings
from reconciler.mark import LISTING_SCHEMA
from reconciler.s3io import Namespace, cached_s3, list_dirs, list_keys
from reconciler.sparkio import distributed
from schemas.layout import DATA_PREFIX, RESERVED_PREFIXES


@dataclass(frozen=True, slots=True)
class Unit:
    """One listing unit: a namespace-relative prefix, listed recursively or shallow."""

    prefix: str
    shallow: bool = False
    slice: str | None = None  # slice id for data/<slice>/ units


def discover_units(s3: Any, ns: Namespace) -> list[Unit]:
    """The listing units of a namespace (see the module docstring)."""
    units: list[Unit] = [Unit("", shallow=True)]
    for cp in list_dirs(s3, ns.bucket, ns.prefix):
        rel = cp[len(ns.prefix):]
        if any(rel.startswith(p) for p in RESERVED_PREFIXES):
            continue
        if rel == DATA_PREFIX:
            units.append(Unit(DATA_PREFIX, shallow=True))
            for scp in list_dirs(s3, ns.bucket, ns.key(DATA_PREFIX)):
                srel = scp[len(ns.prefix):]
                units.append(Unit(srel, slice=srel[len(DATA_PREFIX):].rstrip("/")))
        else:
            units.append(Unit(rel))
    return units


def select_optimized(units: Sequence[Unit], last_read_slice: str | None) -> list[Unit]:
    """Seed 002 flow 2: only slices newer than or equal to the previous run's newest slice.

    Slice ids sort newest first, so "newer or equal" is ``slice <= last_read_slice``. Without a
    previous slice every slice is listed.
    """
    slices = [u for u in units if u.slice is not None]
    if last_read_slice is None:
        return slices
    return [u for u in slices if u.slice is not None and u.slice <= last_read_slice]


def newest_slice(units: Sequence[Unit]) -> str | None:
    ids = [u.slice for u in units if u.slice is not None]
    return min(ids) if ids else None


def _ms(value: dt.datetime) -> int:
    return int(value.timestamp() * 1000)


def list_unit(s3: Any, ns: Namespace, unit: Unit) -> Iterator[tuple[str, int, int]]:
    """(rel key, size, last_modified ms) of one unit, paginated."""
    kwargs: dict[str, Any] = {"Bucket": ns.bucket, "Prefix": ns.key(unit.prefix)}
    if unit.shallow:
        kwargs["Delimiter"] = "/"
    plen = len(ns.prefix)
    for page in s3.get_paginator("list_objects_v2").paginate(**kwargs,
                                                             PaginationConfig={"PageSize": 1000}):
        for obj in page.get("Contents", ()):
            yield obj["Key"][plen:], int(obj["Size"]), _ms(obj["LastModified"])


def listing_df(spark: Any, settings: Settings, ns: Namespace, units: Sequence[Unit]) -> Any:
    """A DataFrame (key, size, last_modified) of the units, listed inside Spark tasks."""
    items = [(u.prefix, u.shallow) for u in units]

    def produce(item: dict[str, Any]) -> Iterator[tuple[str, int, int]]:
        return list_unit(cached_s3(settings), ns, Unit(item["prefix"], item["shallow"]))

    return distributed(spark, items, "prefix string, shallow boolean", produce, LISTING_SCHEMA)


def raw_listing_count(s3: Any, ns: Namespace) -> tuple[int, int]:
    """Count and bytes of a plain paginated listing of the namespace (the benchmark's bar)."""
    n = b = 0
    for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=ns.bucket, Prefix=ns.prefix, PaginationConfig={"PageSize": 1000}):
        for obj in page.get("Contents", ()):
            n += 1
            b += int(obj["Size"])
    return n, b


# ----------------------------------------------------------------------------- inventory

INVENTORY_COLUMNS = ("key", "size", "last_modified")


def _to_ms(value: Any) -> int:
    """Inventory last_modified: a datetime, epoch seconds or ms, or an ISO-8601 string."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return _ms(value)
    if isinstance(value, int | float):
        return int(value if value > 1e11 else value * 1000)
    if isinstance(value, str):
        text = value.strip()
        try:
            return _to_ms(float(text))
        except ValueError:
            parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
            return _to_ms(parsed)
    raise ValueError(f"inventory last_modified {value!r} is not a time")


def inventory_files(s3: Any, uri: str) -> list[str]:
    """The Parquet/CSV files of an inventory: an s3:// prefix or a local directory/file."""
    suffixes = (".parquet", ".csv", ".csv.gz")
    if uri.startswith("s3://"):
        bucket, prefix = split_s3_uri(uri)
        return [f"s3://{bucket}/{k}" for k in list_keys(s3, bucket, prefix)
                if k.endswith(suffixes)]
    from pathlib import Path

    p = Path(uri)
    if p.is_file():
        return [str(p.resolve())]
    if not p.is_dir():
        raise FileNotFoundError(f"inventory {uri!r} is neither a file nor a directory")
    return sorted(str(f.resolve()) for f in p.rglob("*") if f.name.endswith(suffixes))


def named_inventory(s3: Any, uri: str) -> list[str]:
    """The files of the inventory ``--inventory`` named, checked on the driver before anything
    is listed: missing, empty, or a first file without the inventory's columns refuses the run
    with one line (``ReconcileError``) instead of a task failure deep in Spark."""
    from reconciler.errors import ReconcileError

    try:
        files = inventory_files(s3, uri)
    except Exception as exc:  # a missing path, no such bucket, access denied
        raise ReconcileError(f"inventory {uri}: cannot be read ({exc})") from None
    if not files:
        raise ReconcileError(f"inventory {uri}: no .parquet or .csv files")
    try:
        next(iter(_read_inventory_file(s3, files[0])), None)
    except Exception as exc:
        raise ReconcileError(f"inventory {uri}: unreadable ({type(exc).__name__}: {exc})") \
            from None
    return files


def _read_inventory_file(s3: Any, path: str) -> Iterator[tuple[Any, Any, Any]]:
    import io

    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    if path.startswith("s3://"):
        bucket, key = split_s3_uri(path)
        data: Any = io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    else:
        data = path
    if path.endswith(".parquet"):
        pf = pq.ParquetFile(data)
        missing = [c for c in INVENTORY_COLUMNS if c not in pf.schema_arrow.names]
        if missing:
            raise ValueError(f"inventory file {path}: missing column(s) {missing}")
        batches = pf.iter_batches(columns=list(INVENTORY_COLUMNS), batch_size=65_536)
    else:
        table = pacsv.read_csv(data, convert_options=pacsv.ConvertOptions(
            column_types={"key": "string"}))
        missing = [c for c in INVENTORY_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"inventory file {path}: missing column(s) {missing}")
        batches = table.select(list(INVENTORY_COLUMNS)).to_batches(max_chunksize=65_536)
    for batch in batches:
        yield from zip(*(batch.column(c).to_pylist() for c in INVENTORY_COLUMNS), strict=True)


def inventory_key(raw: str, path: str) -> str:
    """The bucket key of an inventory row in canonical (listing) form.

    S3 Inventory writes CSV keys URL-encoded (form encoding: ``+`` is a space, ``%2B`` a
    plus) and Parquet/ORC keys as they are; a CSV key is decoded so that it compares with
    the listing, the manifests and the tracker's addresses.
    """
    if path.endswith(".parquet"):
        return raw
    from urllib.parse import unquote_plus

    return unquote_plus(raw, errors="strict")


def inventory_df(spark: Any, settings: Settings, ns: Namespace, files: Sequence[str]) -> Any:
    """The listing from inventory files, read inside Spark tasks; keys are bucket keys (as S3
    Inventory writes them: URL-encoded in CSV, see :func:`inventory_key`) and only those
    under the namespace are kept."""
    if not files:
        raise ValueError("the inventory has no .parquet or .csv files")
    plen = len(ns.prefix)
    prefix = ns.prefix

    def produce(item: dict[str, Any]) -> Iterator[tuple[str, int, int]]:
        path = item["path"]
        for raw, size, modified in _read_inventory_file(cached_s3(settings), path):
            if raw is None:
                continue
            key = inventory_key(str(raw), path)
            if not key.startswith(prefix):
                continue
            yield key[plen:], int(size or 0), _to_ms(modified)

    return distributed(spark, [(f,) for f in files], "path string", produce, LISTING_SCHEMA)
