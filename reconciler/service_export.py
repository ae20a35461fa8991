"""The service's own list of its uncommitted addresses: a second witness beside the mirror.

lakeFS asks the service itself for the uncommitted set (PrepareGCUncommitted) because a lost
event (dead-lettered, a crash between an operation and its publish, a tracker down longer than
the topic's retention) leaves the mirror without a record of a staged object. The reconciler
keeps the union of this export and the tracker's live set.

Format (contract, see ``reconciler/README.md``): a directory or ``s3://`` prefix holding one
export: ``export.json`` (``{"format": 1, "exported_at": ISO-8601 or epoch ms,
"repository": "R" (optional)}``) beside ``*.parquet`` / ``*.csv`` files with a column
``address`` (``s3://`` URI or namespace-relative key) and optionally ``repository`` (rows of
other repositories are ignored). Given a prefix holding several exports (subdirectories, as
the model service writes them under ``<namespace>_hardelete/exports/``), the newest export
of the repository is used. ``exported_at`` tells freshness: an export made after the run's
cutoff vouches for everything older than the cutoff.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.clients import split_s3_uri
from core.settings import Settings
from reconciler.errors import ReconcileError
from reconciler.mark import KEYS_SCHEMA
from reconciler.s3io import Namespace, cached_s3, list_keys
from reconciler.sparkio import distributed
from schemas.address import address_forms
from schemas.layout import META_PREFIX, OutsideNamespace

EXPORT_META = "export.json"
EXPORTS_PREFIX = META_PREFIX + "exports/"
DATA_SUFFIXES = (".parquet", ".csv", ".csv.gz")


@dataclass
class ServiceExport:
    """One export: where, when (ms), and its data files."""

    location: str
    exported_at_ms: int
    files: list[str] = field(default_factory=list)
    repository: str | None = None

    def as_dict(self, cutoff_ms: int) -> dict[str, Any]:
        return {"location": self.location, "exported_at_ms": self.exported_at_ms,
                "files": len(self.files), "fresh": self.exported_at_ms > cutoff_ms}


def resolve_location(setting: str, ns: Namespace, repo: str) -> str:
    """``--uncommitted-export`` / ``uncommitted_export``: ``namespace`` means the namespace's
    ``_hardelete/exports/``; ``{repo}`` in a path is replaced by the repository id."""
    if setting == "namespace":
        return ns.address(EXPORTS_PREFIX)
    return setting.replace("{repo}", repo)


def _ms(value: Any, where: str) -> int:
    from reconciler.listing import _to_ms

    try:
        return _to_ms(value)
    except (ValueError, TypeError):
        raise ReconcileError(f"{where}: exported_at {value!r} is not a time") from None


def _read_bytes(s3: Any, path: str) -> bytes:
    if path.startswith("s3://"):
        bucket, key = split_s3_uri(path)
        body: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return body
    return Path(path).read_bytes()


def _all_files(s3: Any, location: str) -> list[str]:
    if location.startswith("s3://"):
        bucket, prefix = split_s3_uri(location)
        return [f"s3://{bucket}/{k}" for k in list_keys(s3, bucket, prefix)]
    p = Path(location)
    if p.is_file():
        return [str(p.resolve())]
    if not p.is_dir():
        raise ReconcileError(f"uncommitted export {location!r} is neither a file nor a "
                             "directory")
    return sorted(str(f.resolve()) for f in p.rglob("*") if f.is_file())


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] + "/"


def find_export(s3: Any, location: str, repo: str) -> ServiceExport | None:
    """The newest export of ``repo`` under ``location`` (None: there is none).

    Only metadata is listed and read on the driver; a garbled ``export.json`` fails the run.
    """
    files = _all_files(s3, location)
    metas = [f for f in files if f.rsplit("/", 1)[-1] == EXPORT_META]
    best: ServiceExport | None = None
    for meta_path in metas:
        try:
            meta = orjson.loads(_read_bytes(s3, meta_path))
        except orjson.JSONDecodeError:
            raise ReconcileError(f"uncommitted export {meta_path}: not JSON") from None
        if not isinstance(meta, dict) or "exported_at" not in meta:
            raise ReconcileError(f"uncommitted export {meta_path}: no exported_at")
        owner = meta.get("repository")
        if owner not in (None, "", repo):
            continue
        at = _ms(meta["exported_at"], meta_path)
        if best is None or at > best.exported_at_ms:
            folder = _parent(meta_path)
            data = [f for f in files if _parent(f) == folder and f.endswith(DATA_SUFFIXES)]
            best = ServiceExport(folder, at, data, owner or None)
    return best


def named_export(s3: Any, location: str, repo: str, *, now_ms: int,
                 max_age_ms: float) -> ServiceExport:
    """The export a command line or the settings *named*: it must be there and be usable.

    A named witness that cannot be read is not the same as no witness: the run would go on
    without it and take a staged object whose events were lost for a leak. So every way it
    can be unusable refuses the run with one line (``ReconcileError``): nothing at the
    location, no ``export.json`` (a file or folder that is not an export), only other
    repositories' exports, no data files, a data file without an ``address`` column, an
    export older than ``max_age_ms`` or dated in the future (it would vouch for everything).
    """
    try:
        files = _all_files(s3, location)
    except (OSError, ReconcileError) as exc:
        raise ReconcileError(f"uncommitted export {location}: cannot be read ({exc})") from None
    except Exception as exc:  # botocore: no such bucket, access denied
        raise ReconcileError(f"uncommitted export {location}: cannot be listed "
                             f"({type(exc).__name__}: {exc})") from None
    if not files:
        raise ReconcileError(f"uncommitted export {location}: nothing there")
    if not any(f.rsplit("/", 1)[-1] == EXPORT_META for f in files):
        raise ReconcileError(f"uncommitted export {location}: no {EXPORT_META} (not an "
                             "export; the format is in reconciler/README.md)")
    found = find_export(s3, location, repo)
    if found is None:
        raise ReconcileError(f"uncommitted export {location}: only other repositories' "
                             f"exports, none of {repo!r}")
    if found.exported_at_ms > now_ms + 60_000:
        raise ReconcileError(f"uncommitted export {found.location}: exported_at "
                             f"{found.exported_at_ms} is in the future (now {now_ms})")
    if now_ms - found.exported_at_ms > max_age_ms:
        raise ReconcileError(
            f"uncommitted export {found.location}: exported "
            f"{(now_ms - found.exported_at_ms) / 3_600_000:.1f} h ago, older than "
            f"uncommitted_export_max_age_seconds ({max_age_ms / 1000:g} s)")
    if not found.files:
        raise ReconcileError(f"uncommitted export {found.location}: no data files "
                             f"({', '.join(DATA_SUFFIXES)})")
    try:
        next(iter(_rows(s3, found.files[0])), None)
    except Exception as exc:  # a missing column, not Parquet, not CSV
        raise ReconcileError(f"uncommitted export {found.files[0]}: unreadable "
                             f"({type(exc).__name__}: {exc})") from None
    return found


def _rows(s3: Any, path: str) -> Iterator[tuple[Any, Any]]:
    """(address, repository) rows of one export file."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    data = io.BytesIO(_read_bytes(s3, path))
    if path.endswith(".parquet"):
        pf = pq.ParquetFile(data)
        names = pf.schema_arrow.names
        cols = [c for c in ("address", "repository") if c in names]
        if "address" not in cols:
            raise ValueError(f"uncommitted export file {path}: no column 'address'")
        batches: Any = pf.iter_batches(columns=cols, batch_size=65_536)
    else:
        table = pacsv.read_csv(data, convert_options=pacsv.ConvertOptions(
            column_types={"address": "string", "repository": "string"}))
        cols = [c for c in ("address", "repository") if c in table.column_names]
        if "address" not in cols:
            raise ValueError(f"uncommitted export file {path}: no column 'address'")
        batches = table.select(cols).to_batches(max_chunksize=65_536)
    for batch in batches:
        addresses = batch.column("address").to_pylist()
        repos = (batch.column("repository").to_pylist() if "repository" in cols
                 else [None] * len(addresses))
        yield from zip(addresses, repos, strict=True)


def export_keys_df(spark: Any, settings: Settings, ns: Namespace, repo: str,
                   export: ServiceExport) -> Any:
    """Namespace-relative keys the service says are uncommitted (read inside tasks).

    Every form an address may name is kept (``schemas.address.address_forms``); rows of
    other repositories and addresses outside the namespace protect nothing here and are left.
    """

    def produce(item: dict[str, Any]) -> Iterator[tuple[str]]:
        for address, owner in _rows(cached_s3(settings), item["path"]):
            if address is None or owner not in (None, "", repo):
                continue
            try:
                forms = address_forms(ns.uri, str(address))
            except OutsideNamespace:
                continue
            for form in forms:
                yield (form[len(ns.uri):],)

    return distributed(spark, [(f,) for f in export.files], "path string", produce,
                       KEYS_SCHEMA)


def write_export(s3: Any, location: str, addresses: list[str], *, exported_at_ms: int,
                 repository: str | None = None) -> str:
    """Write one export (Parquet + ``export.json``) to ``location`` (``s3://`` prefix or a
    local directory); returns the location. Used by the model service and the tests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"address": pa.array(addresses, pa.string()),
                      "repository": pa.array([repository] * len(addresses), pa.string())})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    meta = orjson.dumps({"format": 1, "exported_at": exported_at_ms, "repository": repository,
                         "rows": len(addresses)})
    if not location.endswith("/"):
        location += "/"
    if location.startswith("s3://"):
        bucket, prefix = split_s3_uri(location)
        s3.put_object(Bucket=bucket, Key=prefix + "part-00000.parquet", Body=buf.getvalue())
        s3.put_object(Bucket=bucket, Key=prefix + EXPORT_META, Body=meta)
    else:
        d = Path(location)
        d.mkdir(parents=True, exist_ok=True)
        (d / "part-00000.parquet").write_bytes(buf.getvalue())
        (d / EXPORT_META).write_bytes(meta)
    return location
