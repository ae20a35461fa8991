"""The one strict reader of each kind of evidence the mark decides from.

A keep-set that silently shrinks deletes live data: a manifest whose ``address`` column is
binary (``str(b"data/x")`` is the key ``b'data/x'``), an export that names no repository, one
older than the run's cutoff, a truncated file, a row of another namespace. So every input the
mark reads goes through a reader here, which proves, per file:

* **types**: each column is of the expected type, checked once per file from its schema; text
  is text (Parquet ``BYTE_ARRAY`` without the UTF8 annotation, as several Go and Java writers
  store strings, is decoded as strict UTF-8; anything else is refused); no nulls;
* **binding**: an export names its repository and its namespace, and they are this run's; every
  address row lies inside the namespace;
* **freshness**: an export was made after the run's cutoff (it then lists everything older
  that is still uncommitted) and not in the future;
* **completeness**: every file an export declares is there, holds the rows it declares, and no
  other data file is; a Parquet file yields exactly the rows its footer declares.

Anything else raises :class:`EvidenceError`: one line naming the file and what is wrong, and the
run stops before anything is deleted. The mark records what fed its keep-set in a
:class:`KeepSetProof`; a mark without a complete proof is never swept.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.clients import split_s3_uri
from reconciler.errors import ReconcileError
from schemas.address import address_forms, canonical_namespace
from schemas.layout import OutsideNamespace

BATCH_ROWS = 65_536


class EvidenceError(ReconcileError):
    """A piece of evidence is not what the mark may decide from: the run stops."""


# ------------------------------------------------------------------------------ files

def read_bytes(s3: Any, path: str) -> bytes:
    """The bytes of an ``s3://`` object or a local file."""
    if path.startswith("s3://"):
        bucket, key = split_s3_uri(path)
        body: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        return body
    return Path(path).read_bytes()


def _parquet(data: bytes, where: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise EvidenceError(f"{where}: not a readable Parquet file ({exc})") from None


# ------------------------------------------------------------------------------ types

TEXT = "text"
INTEGER = "integer"
TIME = "time"
BOOLEAN = "boolean"


def _kind_of(t: Any) -> str | None:
    """The kind of value an Arrow type holds, as the readers know them (None: none of them)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _kind_of(t.value_type)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return TEXT
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_integer(t):
        return INTEGER
    if pa.types.is_timestamp(t):
        return TIME
    if pa.types.is_boolean(t):
        return BOOLEAN
    if pa.types.is_null(t):
        return "null"
    return None


def check_column(schema: Any, name: str, kind: str, where: str) -> None:
    """``name`` is in ``schema`` and holds ``kind`` (binary counts as text: it is decoded)."""
    if name not in schema.names:
        raise EvidenceError(f"{where}: no column {name!r} (columns: {', '.join(schema.names)})")
    got = _kind_of(schema.field(name).type)
    if got == kind or (kind == TEXT and got == "binary"):
        return
    raise EvidenceError(f"{where}: column {name!r} is {schema.field(name).type}, "
                        f"expected {kind}")


def texts(column: Any, where: str, name: str, *, nullable: bool = False) -> list[str | None]:
    """A text column's values: strings as they are, binary decoded as strict UTF-8."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    values: list[Any] = column.to_pylist()
    if _kind_of(column.type) == "binary":
        out: list[str | None] = []
        for i, v in enumerate(values):
            try:
                out.append(None if v is None else v.decode("utf-8", errors="strict"))
            except UnicodeDecodeError:
                raise EvidenceError(f"{where}: column {name!r} row {i} is not UTF-8 text "
                                    f"({v[:60]!r})") from None
        values = out
    if not nullable and None in values:
        raise EvidenceError(f"{where}: column {name!r} has a null value")
    return values


def integers(column: Any, where: str, name: str) -> list[int]:
    values = column.to_pylist()
    if None in values:
        raise EvidenceError(f"{where}: column {name!r} has a null value")
    if any(v < 0 for v in values):
        raise EvidenceError(f"{where}: column {name!r} has a negative value")
    return values  # type: ignore[no-any-return]


# ------------------------------------------------------------------------ the namespace

def namespace_keys(ns_uri: str, address: str, where: str) -> tuple[str, ...]:
    """The namespace-relative keys one address row may name (every form protected); a row
    that lies in no form inside the namespace stops the run: it would protect nothing."""
    try:
        forms = address_forms(ns_uri, address)
    except OutsideNamespace as exc:
        raise EvidenceError(f"{where}: row {address!r} is not an address of {ns_uri} "
                            f"({exc})") from None
    return tuple(form[len(ns_uri):] for form in forms)


# ---------------------------------------------------------------------------- manifests

MANIFEST_ADDRESS = "address"


def manifest_addresses(data: bytes, where: str) -> Iterator[str]:
    """The ``address`` rows of one commit manifest: text, no nulls, exactly the footer's rows."""
    for batch in _manifest_batches(data, where):
        yield from texts(batch, where, MANIFEST_ADDRESS)  # type: ignore[misc]


def _manifest_batches(data: bytes, where: str) -> Iterator[Any]:
    """The ``address`` column of one commit manifest in Arrow batches (its type checked once),
    then a check that they held exactly the rows its footer declares."""
    pf = _parquet(data, where)
    check_column(pf.schema_arrow, MANIFEST_ADDRESS, TEXT, where)
    seen = 0
    for batch in pf.iter_batches(columns=[MANIFEST_ADDRESS], batch_size=BATCH_ROWS):
        seen += batch.num_rows
        yield batch.column(0)
    if seen != pf.metadata.num_rows:
        raise EvidenceError(f"{where}: {seen} rows read, its footer declares "
                            f"{pf.metadata.num_rows}")


def manifest_keys(data: bytes, ns_uri: str, where: str) -> Iterator[str]:
    """Namespace-relative keys a manifest retains (every form of an ambiguous row)."""
    for keys in manifest_key_batches(data, ns_uri, where):
        yield from keys


def manifest_key_batches(data: bytes, ns_uri: str, where: str) -> Iterator[list[str]]:
    """:func:`manifest_keys` a batch at a time. A batch whose every row is the canonical
    spelling of a key of the namespace (``<ns_uri><key>``, no ``%``: the one form
    :func:`namespace_keys` would give, the key itself) is cut in Arrow, without a Python step
    per row; any other batch (another spelling, an escape, a null, a byte that is not UTF-8)
    is read row by row, as every row used to be, with its checks and errors."""
    for column in _manifest_batches(data, where):
        keys = _canonical_keys(column, ns_uri)
        if keys is None:
            values = texts(column, where, MANIFEST_ADDRESS)
            keys = [key for address in values
                    for key in namespace_keys(ns_uri, address, where)]  # type: ignore[arg-type]
        yield keys


def keepset_part_keys(data: bytes, where: str, declared_rows: int) -> Iterator[list[str]]:
    """The keys of one stored keep-set part (``reconciler/keepset.py``): one text column
    ``key`` without nulls, exactly the rows the sealed descriptor declares."""
    pf = _parquet(data, where)
    check_column(pf.schema_arrow, "key", TEXT, where)
    if pf.metadata.num_rows != declared_rows:
        raise EvidenceError(f"{where}: {pf.metadata.num_rows} rows, its descriptor declares "
                            f"{declared_rows}")
    seen = 0
    for batch in pf.iter_batches(columns=["key"], batch_size=BATCH_ROWS):
        seen += batch.num_rows
        yield texts(batch.column(0), where, "key")  # type: ignore[misc]
    if seen != declared_rows:
        raise EvidenceError(f"{where}: {seen} rows read, its descriptor declares "
                            f"{declared_rows}")


def _canonical_keys(column: Any, ns_uri: str) -> list[str] | None:
    """The keys of a column of canonical addresses of ``ns_uri`` (see
    :func:`manifest_key_batches`), or None when any row is not one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if ns_uri != canonical_namespace(ns_uri) or column.null_count:
        return None
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return None  # binary: decoded strictly, row by row
    if len(column) == 0:
        return []
    canonical = pc.and_(pc.starts_with(column, ns_uri),
                        pc.invert(pc.match_substring(column, "%")))
    canonical = pc.and_(canonical, pc.not_equal(column, ns_uri))
    if not pc.all(canonical).as_py():
        return None
    # (start in code points, as Python's len: every row starts with ``ns_uri`` itself)
    return pc.utf8_slice_codeunits(column, len(ns_uri)).to_pylist()  # type: ignore[no-any-return]


# ------------------------------------------------------------------ the service's export

EXPORT_META = "export.json"
EXPORT_FORMAT = 2
DATA_SUFFIXES = (".parquet", ".csv", ".csv.gz")
FUTURE_SLACK_MS = 60_000


@dataclass(frozen=True, slots=True)
class ExportFile:
    name: str  # relative to the export's folder
    rows: int


@dataclass(frozen=True, slots=True)
class ExportMeta:
    """``export.json`` of one export of the service's uncommitted addresses (format 2)."""

    repository: str
    namespace: str
    exported_at_ms: int
    files: tuple[ExportFile, ...]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    def as_dict(self) -> dict[str, Any]:
        return {"format": EXPORT_FORMAT, "repository": self.repository,
                "namespace": self.namespace, "exported_at": self.exported_at_ms,
                "files": [{"name": f.name, "rows": f.rows} for f in self.files]}


def _time_ms(value: Any, where: str, what: str) -> int:
    """Epoch ms (an integer), or ISO-8601 with an explicit offset: never a guess of the unit
    or of the time zone."""
    import datetime as dt

    if type(value) is int:
        return _plausible_ms(value, where, what)
    if isinstance(value, str) and value.strip().isdigit():
        return _plausible_ms(int(value), where, what)
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            return int(parsed.timestamp() * 1000)
    raise EvidenceError(f"{where}: {what} {value!r} is not epoch milliseconds (an integer) "
                        "or ISO-8601 with a time zone")


# Epoch milliseconds of 1973-03-03: a smaller integer time is seconds (or less), and reading
# seconds as milliseconds would make every object look 50 years old.
MIN_EPOCH_MS = 10**11


def _plausible_ms(value: int, where: str, what: str) -> int:
    if value < MIN_EPOCH_MS:
        raise EvidenceError(f"{where}: {what} {value} is not epoch milliseconds (seconds?)")
    return value


def parse_export_meta(raw: bytes, where: str) -> ExportMeta:
    """The strict reading of an ``export.json``; anything else stops the run."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise EvidenceError(f"{where}: not JSON") from None
    if not isinstance(d, dict):
        raise EvidenceError(f"{where}: not a JSON object")
    if d.get("format") != EXPORT_FORMAT:
        raise EvidenceError(
            f"{where}: format {d.get('format')!r}, this reconciler reads format "
            f"{EXPORT_FORMAT} (repository, namespace, exported_at and the files with their "
            "rows: reconciler/README.md)")
    repo = d.get("repository")
    if not isinstance(repo, str) or not repo:
        raise EvidenceError(f"{where}: names no repository (an export must say whose it is)")
    ns = d.get("namespace")
    if not isinstance(ns, str):
        raise EvidenceError(f"{where}: names no namespace (an export must say whose it is)")
    try:
        ns = canonical_namespace(ns)
    except OutsideNamespace:
        raise EvidenceError(f"{where}: namespace {ns!r} is not s3://bucket/prefix/") from None
    files = d.get("files")
    if not isinstance(files, list) or not files:
        raise EvidenceError(f"{where}: declares no files (files: [{{name, rows}}])")
    declared: list[ExportFile] = []
    for f in files:
        name = f.get("name") if isinstance(f, dict) else None
        rows = f.get("rows") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name.endswith(DATA_SUFFIXES) or "/" in name \
                or type(rows) is not int or rows < 0:
            raise EvidenceError(f"{where}: file entry {f!r} is not {{name: a data file in the "
                                "export's folder, rows: a count}}")
        declared.append(ExportFile(name, rows))
    if len({f.name for f in declared}) != len(declared):
        raise EvidenceError(f"{where}: a file is declared twice")
    at = _time_ms(d.get("exported_at"), where, "exported_at")
    return ExportMeta(repo, ns, at, tuple(declared))


def check_export_binding(meta: ExportMeta, where: str, *, repo: str, ns_uri: str,
                         cutoff_ms: int, now_ms: int) -> None:
    """The export is this repository's, of its namespace, and fresh against the cutoff."""
    if meta.repository != repo:
        raise EvidenceError(f"{where}: an export of repository {meta.repository!r}, not "
                            f"{repo!r}")
    if meta.namespace != canonical_namespace(ns_uri):
        raise EvidenceError(f"{where}: an export of namespace {meta.namespace}, the "
                            f"repository's is {ns_uri}")
    if meta.exported_at_ms > now_ms + FUTURE_SLACK_MS:
        raise EvidenceError(f"{where}: exported_at {meta.exported_at_ms} is in the future "
                            f"(now {now_ms}): it would vouch for everything")
    if meta.exported_at_ms <= cutoff_ms:
        # An object staged after the export and older than the cutoff, whose events were
        # lost, is in neither witness: the run would take it for a leak.
        raise EvidenceError(f"{where}: exported at {meta.exported_at_ms}, not after the run's "
                            f"cutoff {cutoff_ms}: it cannot witness what was staged since; "
                            "the service must export again")


def check_export_files(meta: ExportMeta, present: Sequence[str], where: str) -> None:
    """Exactly the declared data files are in the export's folder."""
    names = {p.rsplit("/", 1)[-1] for p in present if p.endswith(DATA_SUFFIXES)}
    declared = {f.name for f in meta.files}
    missing = sorted(declared - names)
    if missing:
        raise EvidenceError(f"{where}: declared file(s) missing: {', '.join(missing)}")
    extra = sorted(names - declared)
    if extra:
        raise EvidenceError(f"{where}: data file(s) not declared: {', '.join(extra)}")


def _table_batches(data: bytes, name: str, columns: Mapping[str, str],
                   where: str) -> tuple[Any, Iterator[Any], int | None]:
    """(schema, batches, footer rows or None) of a Parquet or CSV data file."""
    if name.endswith(".parquet"):
        pf = _parquet(data, where)
        present = [c for c in columns if c in pf.schema_arrow.names]
        return (pf.schema_arrow, pf.iter_batches(columns=present, batch_size=BATCH_ROWS),
                pf.metadata.num_rows)
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise EvidenceError(f"{where}: not gzip ({exc})") from None
    # Times are read as text and parsed strictly (pyarrow's inference takes a time without a
    # zone for UTC, and digits for a plain number of unknown unit).
    types = {c: pa.string() for c, k in columns.items() if k in (TEXT, TIME)}
    try:
        table = pacsv.read_csv(io.BytesIO(data),
                               convert_options=pacsv.ConvertOptions(column_types=types))
    except pa.ArrowException as exc:
        raise EvidenceError(f"{where}: not readable CSV ({exc})") from None
    present = [c for c in columns if c in table.column_names]
    return (table.schema, iter(table.select(present).to_batches(max_chunksize=BATCH_ROWS)),
            None)


def export_keys(data: bytes, name: str, declared_rows: int, *, repo: str, ns_uri: str,
                where: str) -> Iterator[str]:
    """Namespace-relative keys of one export data file: ``address`` text inside the namespace,
    an optional ``repository`` column that is this repository on every row, exactly the
    declared number of rows."""
    schema, batches, footer = _table_batches(
        data, name, {"address": TEXT, "repository": TEXT}, where)
    check_column(schema, "address", TEXT, where)
    has_repo = "repository" in schema.names
    if has_repo:
        check_column(schema, "repository", TEXT, where)
    seen = 0
    for batch in batches:
        addresses = texts(batch.column("address"), where, "address")
        if has_repo:
            owners = set(texts(batch.column("repository"), where, "repository"))
            if owners - {repo}:
                raise EvidenceError(f"{where}: rows of repository "
                                    f"{sorted(str(o) for o in owners - {repo})[0]!r} in an "
                                    f"export of {repo!r}")
        seen += len(addresses)
        for address in addresses:
            yield from namespace_keys(ns_uri, address, where)  # type: ignore[arg-type]
    if seen != declared_rows or (footer is not None and footer != seen):
        raise EvidenceError(f"{where}: {seen} rows read, the export declares {declared_rows}")


# ------------------------------------------------------------------------- inventories

INVENTORY_COLUMNS = ("key", "size", "last_modified")


def inventory_rows(data: bytes, name: str, where: str, *,
                   bucket: str | None = None) -> Iterator[tuple[str, int, Any]]:
    """(raw key, size, last_modified) of one inventory file: text keys, sizes >= 0,
    last_modified a timestamp with its zone (S3 Inventory's is adjusted to UTC), epoch
    milliseconds, or (CSV) ISO-8601 with a time zone; no nulls. An optional ``bucket``
    column must be the namespace's bucket on every row (another bucket's inventory would
    offer its keys, and their ages, as this bucket's)."""
    schema, batches, footer = _table_batches(
        data, name, {"bucket": TEXT, "key": TEXT, "size": INTEGER, "last_modified": TIME},
        where)
    check_column(schema, "key", TEXT, where)
    check_column(schema, "size", INTEGER, where)
    lm_kind = _kind_of(schema.field("last_modified").type) \
        if "last_modified" in schema.names else None
    if lm_kind not in (TIME, INTEGER, TEXT):
        check_column(schema, "last_modified", TIME, where)
    has_bucket = "bucket" in schema.names
    if has_bucket:
        check_column(schema, "bucket", TEXT, where)
    seen = 0
    for batch in batches:
        keys = texts(batch.column("key"), where, "key")
        sizes = integers(batch.column("size"), where, "size")
        modified = _times(batch.column("last_modified"), lm_kind, where)
        if has_bucket and bucket is not None:
            other = {str(b) for b in texts(batch.column("bucket"), where, "bucket")} - {bucket}
            if other:
                raise EvidenceError(f"{where}: rows of bucket {sorted(other)[0]!r}, the "
                                    f"namespace's bucket is {bucket!r}")
        seen += len(keys)
        yield from zip(keys, sizes, modified, strict=True)  # type: ignore[misc]
    if footer is not None and footer != seen:
        raise EvidenceError(f"{where}: {seen} rows read, its footer declares {footer}")


def _times(column: Any, kind: str | None, where: str) -> list[int]:
    """last_modified values as epoch ms."""

    values = column.to_pylist()
    if None in values:
        raise EvidenceError(f"{where}: column 'last_modified' has a null value")
    if kind == TIME:
        if column.type.tz is None:
            # a writer's local time read as UTC would age every object by its offset
            raise EvidenceError(f"{where}: column 'last_modified' is a timestamp without a "
                                "time zone (write it adjusted to UTC)")
        return [int(v.timestamp() * 1000) for v in values]
    if kind == INTEGER:
        return [_plausible_ms(v, where, "last_modified") for v in values]
    return [_time_ms(v, where, "last_modified") for v in values]


# ------------------------------------------------------------------- the keep-set's proof

@dataclass(frozen=True, slots=True)
class Source:
    """One source of the keep-set and what was read of it."""

    kind: str  # tracker_export | manifests | service_export | baseline_keepset
    files: int
    rows: int | None = None  # declared and read (the reader stops the run on a difference)
    keys: int | None = None  # distinct namespace-relative keys it contributed
    location: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "files": self.files}
        for name in ("rows", "keys", "location"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Source:
        return cls(str(d.get("kind")), int(d.get("files") or 0), d.get("rows"), d.get("keys"),
                   d.get("location"))


REQUIRED_SOURCES = ("tracker_export", "manifests")


@dataclass
class KeepSetProof:
    """What fed the mark's keep-set. ``complete`` is set once every reader has finished;
    a mark whose proof is missing or incomplete is never swept."""

    sources: list[Source] = field(default_factory=list)
    complete: bool = False
    stored: str | None = None  # the bucket key of the run's stored keep-set (keepset.json)

    def add(self, source: Source) -> None:
        self.sources.append(source)

    def problem(self) -> str | None:
        """Why a sweep may not rely on this proof, or None."""
        if not self.complete:
            return "the mark's keep-set proof is incomplete (a reader did not finish)"
        kinds = {s.kind for s in self.sources}
        missing = [k for k in REQUIRED_SOURCES if k not in kinds]
        if missing:
            return f"the mark's keep-set proof lacks {', '.join(missing)}"
        return None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"complete": self.complete,
                               "sources": [s.as_dict() for s in self.sources]}
        if self.stored is not None:
            out["stored"] = self.stored
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KeepSetProof:
        sources = d.get("sources")
        return cls([Source.from_dict(s) for s in sources if isinstance(s, dict)]
                   if isinstance(sources, list) else [],
                   d.get("complete") is True,
                   d["stored"] if isinstance(d.get("stored"), str) else None)
