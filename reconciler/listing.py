"""The namespace listing, distributed: slices listed with obstore inside Spark tasks.

Units of listing (namespace-relative prefixes), discovered on the driver with delimiter
listings (small: one entry per prefix, never per object):

* ``data/<slice>/`` - each time slice of seed 002 (reverse-sorted time ids: the
  lexicographically smallest slice is the newest);
* ``data/`` shallow - objects directly under ``data/`` (not in a slice);
* ``<dir>/`` - every other top-level prefix, except the reserved metadata prefixes;
* the namespace root, shallow - objects directly under the namespace.

Each unit is listed inside a Spark task, the units in parallel, directory by directory with
obstore (Rust ``object_store``, ``reconciler.obstoreio``: exact keys, boto3 where obstore
cannot spell one); rows are ``(key, size, last_modified_ms)`` with namespace-relative keys,
streamed from the task to the classification. Nothing is collected on the driver, and a
listing error fails the task and so the run. :func:`list_unit` is the same listing by
boto3 alone, one recursive paginated listing (the reference the tests compare with). An
S3-Inventory-style input (Parquet or CSV files with ``key``, ``size``, ``last_modified``)
can replace the live listing (:func:`inventory_df`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from core.clients import split_s3_uri
from core.settings import Settings
from reconciler.evidence import EvidenceError, inventory_rows, read_bytes
from reconciler.mark import LISTING_SCHEMA
from reconciler.obstoreio import list_tree
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


def list_unit_fast(settings: Settings, s3: Any, ns: Namespace,
                   unit: Unit) -> Iterator[tuple[str, int, int]]:
    """The rows of :func:`list_unit`, listed by obstore directory by directory (exact keys:
    ``reconciler.obstoreio``). Raises on any listing error."""
    plen = len(ns.prefix)
    for key, size, modified in list_tree(settings, s3, ns.bucket, ns.key(unit.prefix),
                                         shallow=unit.shallow):
        yield key[plen:], size, modified


def listing_df(spark: Any, settings: Settings, ns: Namespace, units: Sequence[Unit]) -> Any:
    """A DataFrame (key, size, last_modified) of the units, listed inside Spark tasks."""
    items = [(u.prefix, u.shallow) for u in units]

    def produce(item: dict[str, Any]) -> Iterator[tuple[str, int, int]]:
        return list_unit_fast(settings, cached_s3(settings), ns,
                              Unit(item["prefix"], item["shallow"]))

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
INVENTORY_SUFFIXES = (".parquet", ".csv", ".csv.gz")
INVENTORY_MANIFEST = "manifest.json"


@dataclass(frozen=True, slots=True)
class InventoryFile:
    path: str
    md5: str | None = None  # from the inventory's manifest.json, checked when read


def inventory_files(s3: Any, uri: str, bucket: str | None = None) -> list[InventoryFile]:
    """The data files of an inventory: an s3:// prefix or a local directory/file. Where the
    location holds an S3 Inventory ``manifest.json``, exactly the files it lists (each with its
    MD5, checked as it is read), and its ``sourceBucket`` must be ``bucket``."""
    if uri.startswith("s3://"):
        b, prefix = split_s3_uri(uri)
        paths = [f"s3://{b}/{k}" for k in list_keys(s3, b, prefix)]
    else:
        from pathlib import Path

        p = Path(uri)
        if p.is_file():
            paths = [str(p.resolve())]
        elif not p.is_dir():
            raise FileNotFoundError(f"inventory {uri!r} is neither a file nor a directory")
        else:
            paths = sorted(str(f.resolve()) for f in p.rglob("*") if f.is_file())
    manifests = [f for f in paths if f.rsplit("/", 1)[-1] == INVENTORY_MANIFEST]
    data = [f for f in paths if f.endswith(INVENTORY_SUFFIXES)]
    if not manifests:
        return [InventoryFile(f) for f in data]
    if len(manifests) > 1:
        raise EvidenceError(f"inventory {uri}: {len(manifests)} manifest.json files; name one "
                            "inventory's folder")
    return _manifest_files(s3, manifests[0], data, bucket)


def _manifest_files(s3: Any, manifest: str, data: list[str],
                    bucket: str | None) -> list[InventoryFile]:
    import orjson

    where = f"inventory {manifest}"
    try:
        d = orjson.loads(read_bytes(s3, manifest))
    except orjson.JSONDecodeError:
        raise EvidenceError(f"{where}: not JSON") from None
    files = d.get("files") if isinstance(d, dict) else None
    if not isinstance(files, list) or not files:
        raise EvidenceError(f"{where}: lists no files")
    source = d.get("sourceBucket")
    if bucket is not None and source != bucket:
        raise EvidenceError(f"{where}: an inventory of bucket {source!r}, the namespace's "
                            f"bucket is {bucket!r}")
    by_name = {f.rsplit("/", 1)[-1]: f for f in data}
    out: list[InventoryFile] = []
    for entry in files:
        key = entry.get("key") if isinstance(entry, dict) else None
        md5 = entry.get("MD5checksum") if isinstance(entry, dict) else None
        if not isinstance(key, str) or not isinstance(md5, str):
            raise EvidenceError(f"{where}: file entry {entry!r} has no key and MD5checksum")
        path = by_name.get(key.rsplit("/", 1)[-1])
        if path is None:
            raise EvidenceError(f"{where}: listed file {key} is missing")
        out.append(InventoryFile(path, md5.lower()))
    return out


def named_inventory(s3: Any, uri: str, bucket: str | None = None) -> list[InventoryFile]:
    """The files of the inventory ``--inventory`` named, checked on the driver before anything
    is listed: missing, empty, or a first file that the strict reader refuses stops the run
    with one line (``ReconcileError``) instead of a task failure deep in Spark."""
    from reconciler.errors import ReconcileError

    try:
        files = inventory_files(s3, uri, bucket)
    except EvidenceError:
        raise
    except Exception as exc:  # a missing path, no such bucket, access denied
        raise ReconcileError(f"inventory {uri}: cannot be read ({exc})") from None
    if not files:
        raise ReconcileError(f"inventory {uri}: no .parquet or .csv files")
    try:
        next(iter(_read_inventory_file(s3, files[0], bucket)), None)
    except EvidenceError:
        raise
    except Exception as exc:
        raise ReconcileError(f"inventory {uri}: unreadable ({type(exc).__name__}: {exc})") \
            from None
    return files


def _read_inventory_file(s3: Any, file: InventoryFile,
                         bucket: str | None) -> Iterator[tuple[str, int, int]]:
    """(bucket key, size, last_modified ms) rows of one inventory file, by the strict reader."""
    import hashlib

    data = read_bytes(s3, file.path)
    where = f"inventory file {file.path}"
    if file.md5 is not None and hashlib.md5(data).hexdigest() != file.md5:
        raise EvidenceError(f"{where}: its MD5 is not the one manifest.json declares")
    for raw, size, modified in inventory_rows(data, file.path, where, bucket=bucket):
        yield inventory_key(raw, file.path), size, modified


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


def inventory_df(spark: Any, settings: Settings, ns: Namespace,
                 files: Sequence[InventoryFile]) -> Any:
    """The listing from inventory files, read inside Spark tasks; keys are bucket keys (as S3
    Inventory writes them: URL-encoded in CSV, see :func:`inventory_key`) and only those
    under the namespace are kept."""
    if not files:
        raise ValueError("the inventory has no .parquet or .csv files")
    plen = len(ns.prefix)
    prefix = ns.prefix
    bucket = ns.bucket

    def produce(item: dict[str, Any]) -> Iterator[tuple[str, int, int]]:
        file = InventoryFile(item["path"], item["md5"])
        for key, size, modified in _read_inventory_file(cached_s3(settings), file, bucket):
            if key.startswith(prefix):
                yield key[plen:], size, modified

    return distributed(spark, [(f.path, f.md5) for f in files], "path string, md5 string",
                       produce, LISTING_SCHEMA)
