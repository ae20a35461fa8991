"""The service's own list of its uncommitted addresses: a second witness beside the mirror.

lakeFS asks the service itself for the uncommitted set (PrepareGCUncommitted) because a lost
event (dead-lettered, a crash between an operation and its publish, a tracker down longer than
the topic's retention) leaves the mirror without a record of a staged object. The reconciler
keeps the union of this export and the tracker's live set.

Format 2 (contract, see ``reconciler/README.md``): a directory or ``s3://`` prefix holding one
export: ``export.json`` (``{"format": 2, "repository": "R", "namespace": "s3://b/p/",
"exported_at": epoch ms or ISO-8601 with a zone, "files": [{"name": "part-0.parquet",
"rows": N}]}``) beside exactly the declared ``*.parquet`` / ``*.csv`` / ``*.csv.gz`` files,
each with a text column ``address`` (``s3://`` URI or namespace-relative key) and optionally
``repository``. Given a prefix holding several exports (subdirectories, as the model service
writes them under ``<namespace>_hardelete/exports/``), the newest export of the repository is
used. Every file is read by the strict readers of ``reconciler.evidence``: an export that is
not this repository's, not of its namespace, not made after the run's cutoff, incomplete or
of the wrong types stops the run.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from core.clients import split_s3_uri
from core.settings import Settings
from reconciler.errors import ReconcileError
from reconciler.evidence import (
    EXPORT_META,
    EvidenceError,
    ExportFile,
    ExportMeta,
    Source,
    check_export_binding,
    check_export_files,
    export_keys,
    parse_export_meta,
    read_bytes,
)
from reconciler.mark import KEYS_SCHEMA
from reconciler.s3io import Namespace, cached_s3, list_keys
from reconciler.sparkio import distributed
from schemas.layout import META_PREFIX

EXPORTS_PREFIX = META_PREFIX + "exports/"

@dataclass
class ServiceExport:
    """One export: its folder, its ``export.json`` and the paths of its data files."""

    location: str
    meta: ExportMeta

    @property
    def exported_at_ms(self) -> int:
        return self.meta.exported_at_ms

    def path(self, name: str) -> str:
        return self.location + name

    def source(self) -> Source:
        return Source("service_export", len(self.meta.files), self.meta.rows,
                      location=self.location)

    def as_dict(self, cutoff_ms: int) -> dict[str, Any]:
        return {"location": self.location, "exported_at_ms": self.exported_at_ms,
                "files": len(self.meta.files), "rows": self.meta.rows,
                "fresh": self.exported_at_ms > cutoff_ms}


def resolve_location(setting: str, ns: Namespace, repo: str) -> str:
    """``--uncommitted-export`` / ``uncommitted_export``: ``namespace`` means the namespace's
    ``_hardelete/exports/``; ``{repo}`` in a path is replaced by the repository id."""
    if setting == "namespace":
        return ns.address(EXPORTS_PREFIX)
    return setting.replace("{repo}", repo)


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


def find_export(s3: Any, location: str, repo: str) -> tuple[ServiceExport | None, list[str]]:
    """The newest export of ``repo`` under ``location`` (None: there is none), and the files
    of its folder. Every ``export.json`` there is read strictly: one that cannot be read, or
    names no repository (it could be taken for any of them), stops the run."""
    files = _all_files(s3, location)
    best: ServiceExport | None = None
    for meta_path in (f for f in files if f.rsplit("/", 1)[-1] == EXPORT_META):
        meta = parse_export_meta(read_bytes(s3, meta_path), f"uncommitted export {meta_path}")
        if meta.repository != repo:
            continue
        if best is None or meta.exported_at_ms > best.exported_at_ms:
            best = ServiceExport(_parent(meta_path), meta)
    if best is None:
        return None, files
    return best, [f for f in files if _parent(f) == best.location]


def named_export(s3: Any, location: str, repo: str, ns: Namespace, *, now_ms: int,
                 cutoff_ms: int, max_age_ms: float) -> ServiceExport:
    """The export a command line or the settings *named*: it must be there and be usable.

    A named witness that cannot be read is not the same as no witness: the run would go on
    without it and take a staged object whose events were lost for a leak. So every way it
    can be unusable stops the run with one line: nothing at the location, no ``export.json``,
    only other repositories' exports, an export of another namespace, made at or before the
    run's cutoff, older than ``max_age_ms`` or dated in the future, a declared file missing or
    an undeclared one present. Rows are checked as they are read (``export_keys_df``).
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
    found, folder = find_export(s3, location, repo)
    if found is None:
        raise ReconcileError(f"uncommitted export {location}: only other repositories' "
                             f"exports, none of {repo!r}")
    where = f"uncommitted export {found.location}"
    check_export_binding(found.meta, where, repo=repo, ns_uri=ns.uri, cutoff_ms=cutoff_ms,
                         now_ms=now_ms)
    if now_ms - found.exported_at_ms > max_age_ms:
        raise EvidenceError(
            f"{where}: exported {(now_ms - found.exported_at_ms) / 3_600_000:.1f} h ago, "
            f"older than uncommitted_export_max_age_seconds ({max_age_ms / 1000:g} s)")
    check_export_files(found.meta, folder, where)
    return found


def export_keys_df(spark: Any, settings: Settings, ns: Namespace, repo: str,
                   export: ServiceExport) -> Any:
    """Namespace-relative keys the service says are uncommitted, read inside tasks by the
    strict reader (``reconciler.evidence.export_keys``: every form an address may name is
    kept; a row outside the namespace, of another repository, or a row count other than the
    declared one fails the job, and so the run)."""

    def produce(item: dict[str, Any]) -> Iterator[tuple[str]]:
        path = item["path"]
        data = read_bytes(cached_s3(settings), path)
        for key in export_keys(data, path, item["rows"], repo=repo, ns_uri=ns.uri,
                               where=f"uncommitted export {path}"):
            yield (key,)

    items = [(export.path(f.name), f.rows) for f in export.meta.files]
    return distributed(spark, items, "path string, rows long", produce, KEYS_SCHEMA)


def write_export(s3: Any, location: str, addresses: list[str], *, exported_at_ms: int,
                 repository: str, namespace: str) -> str:
    """Write one export (Parquet + ``export.json``, format 2) to ``location`` (``s3://``
    prefix or a local directory); returns the location. Used by the model service and the
    tests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"address": pa.array(addresses, pa.string()),
                      "repository": pa.array([repository] * len(addresses), pa.string())})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    meta = orjson.dumps(ExportMeta(repository, namespace, exported_at_ms,
                                   (ExportFile("part-00000.parquet", len(addresses)),)).as_dict())
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
