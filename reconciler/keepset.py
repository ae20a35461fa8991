"""The committed keep-set kept in the namespace, so that an optimized run (seed 002, flow 2)
reads only the manifests of commits new since its baseline.

Every mark writes its committed keep-set (the distinct namespace-relative keys of the retained
manifests, and the manifests' own keys) as Parquet parts (column ``key``) and a descriptor,
``<report>/keepset.json``: the run, repository, namespace, when, the retained commits, every
retained manifest with the ETag it had when it was read, and the parts with their row counts
and ETags. The descriptor's digest is sealed in the tracker's Redis
(``hd:{R}:keepseal:<run_id>``): a descriptor or part edited, added or replaced since, or a seal
gone with a Redis that went back, makes the keep-set unusable.

The keep-set of a set of manifests M is a function of M and of the manifests' contents alone
(``K(M) = union of keys(m)``; retention decides M, never K directly). So with the baseline's
``K(M_b)`` and the manifests retained now ``M_n``:

* ``M_b`` a subset of ``M_n``, every manifest of ``M_b`` still the object it was (same ETag):
  ``K(M_n) = K(M_b) | K(M_n - M_b)`` exactly; only ``M_n - M_b`` is read (the fast path: new
  commits on top of the baseline's retained set; a longer retention; a merge);
* anything else (a manifest of the baseline no longer retained: a reset, a deleted ref, an
  expiration, a shorter retention; a manifest rewritten; a baseline missing, unsealed, too old,
  of another repository, namespace or format): the keep-set could shrink, and which keys leave
  it would need per-manifest knowledge; the run falls back to a clean run and says why
  (:func:`plan_incremental`, pure).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from reconciler.errors import ReconcileError
from reconciler.s3io import Namespace
from schemas.layout import REPORTS_PREFIX

# Bump when the keys a manifest gives change (canonical forms, own-key rule): an older
# keep-set is then not reused.
KEEPSET_FORMAT = 1
KEEPSET_SEAL_TTL_S = 8 * 86_400

Manifest = tuple[str, str]  # (bucket, key)


class KeepSetUnusable(ReconcileError):
    """A stored keep-set that may not be reused: the optimized run falls back to a clean run."""


@dataclass(frozen=True, slots=True)
class KeepSetPart:
    key: str  # bucket key of a Parquet object with one text column ``key``
    rows: int
    etag: str
    unit: str = ""  # the slice id of every key in it, or "" (keys in no data/<slice>/)


# The slice a namespace-relative key lies in (the listing's ``data/<slice>/`` unit), or "".
SLICE_RE = r"^data/([^/]+)/"


def unit_of(key: str) -> str:
    """The part group of a key: its slice id (:data:`SLICE_RE`), or "" for any other key."""
    m = re.match(SLICE_RE, key)
    return m.group(1) if m else ""


@dataclass(frozen=True)
class StoredKeepSet:
    """A run's committed keep-set as stored in its report (``keepset.json``)."""

    run_id: str
    repository: str
    namespace: str
    made_at_ms: int
    manifests: Mapping[Manifest, str]  # each retained manifest -> its ETag when read
    retained: tuple[str, ...]
    parts: tuple[KeepSetPart, ...]
    keys: int
    format: int = KEEPSET_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "run_id": self.run_id, "repository": self.repository,
                "namespace": self.namespace, "made_at_ms": self.made_at_ms,
                "manifests": [[b, k, e] for (b, k), e in sorted(self.manifests.items())],
                "retained": list(self.retained), "keys": self.keys,
                "parts": [{"key": p.key, "rows": p.rows, "etag": p.etag, "unit": p.unit}
                          for p in self.parts]}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> StoredKeepSet:
        """Strict: every field of its type, or :class:`KeepSetUnusable`."""
        def bad(what: str) -> KeepSetUnusable:
            return KeepSetUnusable(f"{where}: {what}")

        if not isinstance(d, dict):
            raise bad("not a JSON object")
        for name, typ in (("format", int), ("run_id", str), ("repository", str),
                          ("namespace", str), ("made_at_ms", int), ("keys", int),
                          ("manifests", list), ("retained", list), ("parts", list)):
            if type(d.get(name)) is not typ:
                raise bad(f"field {name!r} missing or not {typ.__name__}")
        manifests: dict[Manifest, str] = {}
        for m in d["manifests"]:
            if not (isinstance(m, list) and len(m) == 3 and all(type(x) is str for x in m)):
                raise bad(f"manifest entry {m!r} is not [bucket, key, etag]")
            manifests[(m[0], m[1])] = m[2]
        if not all(type(c) is str for c in d["retained"]):
            raise bad("a retained commit id is not text")
        parts = []
        for p in d["parts"]:
            if not (isinstance(p, dict) and type(p.get("key")) is str
                    and type(p.get("rows")) is int and p["rows"] >= 0
                    and type(p.get("etag")) is str and type(p.get("unit")) is str):
                raise bad(f"part entry {p!r} is not {{key, rows, etag, unit}}")
            parts.append(KeepSetPart(p["key"], p["rows"], p["etag"], p["unit"]))
        return cls(d["run_id"], d["repository"], d["namespace"], d["made_at_ms"], manifests,
                   tuple(d["retained"]), tuple(parts), d["keys"], d["format"])


@dataclass(frozen=True)
class KeepSetPlan:
    """How an optimized run gets its committed keep-set: ``reuse`` the baseline's parts and
    read ``new_manifests`` only, or (``reason``) a clean run."""

    reuse: bool
    reason: str | None = None
    baseline: StoredKeepSet | None = None
    new_manifests: tuple[Manifest, ...] = ()


def plan_incremental(baseline: StoredKeepSet | None, *, repository: str, namespace: str,
                     now_ms: int, max_age_ms: int,
                     manifests_now: Mapping[Manifest, str]) -> KeepSetPlan:
    """Reuse the baseline's keep-set only where ``K(M_now) = K(M_b) | K(M_now - M_b)`` holds
    (module docstring); otherwise the reason for a clean run. Pure."""
    def clean(reason: str) -> KeepSetPlan:
        return KeepSetPlan(False, reason, baseline)

    if baseline is None:
        return clean("the baseline stored no keep-set")
    if baseline.format != KEEPSET_FORMAT:
        return clean(f"the baseline's keep-set is of format {baseline.format}, this "
                     f"reconciler's is {KEEPSET_FORMAT}")
    if baseline.repository != repository or baseline.namespace != namespace:
        return clean(f"the baseline's keep-set is of {baseline.repository!r} at "
                     f"{baseline.namespace}, not {repository!r} at {namespace}")
    age = now_ms - baseline.made_at_ms
    if age < 0:
        return clean("the baseline's keep-set was made after now")
    if age > max_age_ms:
        return clean(f"the baseline's keep-set is {age / 3_600_000:.1f} h old (limit "
                     f"{max_age_ms / 3_600_000:g} h)")
    gone = [m for m in baseline.manifests if m not in manifests_now]
    if gone:
        return clean(f"{len(gone)} manifest(s) the baseline retained are not retained now (a "
                     "reset, a deleted ref, an expiration or a shorter retention): the "
                     f"keep-set may shrink (first: s3://{gone[0][0]}/{gone[0][1]})")
    changed = [m for m, etag in baseline.manifests.items() if manifests_now[m] != etag]
    if changed:
        return clean(f"{len(changed)} manifest(s) the baseline read changed since (first: "
                     f"s3://{changed[0][0]}/{changed[0][1]})")
    new = tuple(m for m in manifests_now if m not in baseline.manifests)
    return KeepSetPlan(True, None, baseline, new)


# ------------------------------------------------------------------------------ storage

def descriptor_key(ns: Namespace, run_id: str) -> str:
    return ns.report_prefix(run_id) + "keepset.json"


def parts_prefix(ns: Namespace, run_id: str) -> str:
    return ns.report_prefix(run_id) + "keepset/"


def _part_pattern(ns: Namespace) -> re.Pattern[str]:
    return re.compile(re.escape(ns.key(REPORTS_PREFIX)) + r"[0-9A-Za-z-]+/keepset/[^/]+\.parquet")


def descriptor_bytes(stored: StoredKeepSet) -> bytes:
    return orjson.dumps(stored.to_dict(), option=orjson.OPT_SORT_KEYS)


def seal_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_descriptor(s3: Any, r: Any, seal_key: str, ns: Namespace,
                     stored: StoredKeepSet) -> str:
    """Store the descriptor and its seal; the descriptor's bucket key."""
    data = descriptor_bytes(stored)
    key = descriptor_key(ns, stored.run_id)
    s3.put_object(Bucket=ns.bucket, Key=key, ContentType="application/json", Body=data)
    r.set(seal_key, seal_of(data), ex=KEEPSET_SEAL_TTL_S)
    return key


def read_stored(s3: Any, r: Any, seal_key: str, ns: Namespace, repo: str,
                run_id: str) -> StoredKeepSet:
    """A run's stored keep-set, proven: its descriptor as sealed, of this repository and
    namespace, its parts under a report's ``keepset/`` (their ETags: :func:`check_parts`).
    Anything else raises :class:`KeepSetUnusable` (the run falls back to a clean run)."""
    key = descriptor_key(ns, run_id)
    where = f"keep-set s3://{ns.bucket}/{key}"
    try:
        data: bytes = s3.get_object(Bucket=ns.bucket, Key=key)["Body"].read()
    except Exception as exc:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code"))
        if code in ("404", "NoSuchKey", "NotFound"):
            raise KeepSetUnusable(f"{where}: not there (the baseline stored none)") from None
        raise
    sealed = r.get(seal_key)
    if sealed is None:
        raise KeepSetUnusable(f"{where}: its seal is gone (expired, or Redis went back)")
    if sealed != seal_of(data):
        raise KeepSetUnusable(f"{where}: not the descriptor the run sealed")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise KeepSetUnusable(f"{where}: not JSON") from None
    stored = StoredKeepSet.from_dict(raw, where)
    if stored.run_id != run_id or stored.repository != repo or stored.namespace != ns.uri:
        raise KeepSetUnusable(f"{where}: of run {stored.run_id!r}, repository "
                              f"{stored.repository!r}, namespace {stored.namespace}")
    pattern = _part_pattern(ns)
    for part in stored.parts:
        if not pattern.fullmatch(part.key):
            raise KeepSetUnusable(f"{where}: part {part.key} is not under a report's keepset/")
    return stored


def check_parts(s3: Any, ns: Namespace, parts: tuple[KeepSetPart, ...], where: str) -> None:
    """Each part is still the object written (its ETag); :class:`KeepSetUnusable` if not."""
    from concurrent.futures import ThreadPoolExecutor

    def etag(part: KeepSetPart) -> str | None:
        try:
            return str(s3.head_object(Bucket=ns.bucket, Key=part.key)["ETag"])
        except Exception as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code"))
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    with ThreadPoolExecutor(8) as pool:
        for part, now in zip(parts, pool.map(etag, parts), strict=True):
            if now != part.etag:
                raise KeepSetUnusable(f"{where}: part {part.key} is "
                                      f"{'gone' if now is None else 'rewritten'}")


def manifest_etags(s3: Any, manifests: list[Manifest]) -> dict[Manifest, str]:
    """Each manifest's ETag, read before the manifests are (a manifest rewritten after this
    gives another ETag to the next run, which then does not reuse this keep-set)."""
    from concurrent.futures import ThreadPoolExecutor

    def etag(m: Manifest) -> str:
        try:
            return str(s3.head_object(Bucket=m[0], Key=m[1])["ETag"])
        except Exception as exc:
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code"))
            what = ("NoSuchKey: not there" if code in ("404", "NoSuchKey", "NotFound")
                    else f"{type(exc).__name__}: {exc}")
            raise ReconcileError(f"manifest s3://{m[0]}/{m[1]}: {what} (a retained commit's "
                                 "manifest must be readable)") from None

    with ThreadPoolExecutor(16) as pool:
        return dict(zip(manifests, pool.map(etag, manifests), strict=True))


def write_parts(settings: Any, ns: Namespace, run_id: str, keys_df: Any) -> list[KeepSetPart]:
    """Write a DataFrame of ``key`` as Parquet parts from the tasks, one part per slice (and
    one for the keys in no slice), so that an optimized run reads only the parts of the
    slices it lists; their rows, ETags and units."""
    import uuid

    from pyspark.sql import functions as F

    from reconciler.s3io import cached_s3

    prefix = parts_prefix(ns, run_id)
    token = uuid.uuid4().hex[:6]

    def write(index: int, rows: Iterator[Any]) -> Iterator[tuple[str, int, str, str]]:
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        ctx = TaskContext.get()
        attempt = ctx.attemptNumber() if ctx else 0
        s3 = cached_s3(settings)
        keys: list[str] = []
        unit = ""
        seq = 0

        def flush() -> tuple[str, int, str, str]:
            nonlocal seq
            buf = io.BytesIO()
            pq.write_table(pa.table({"key": pa.array(keys, pa.string())}), buf,
                           compression="zstd")
            key = f"{prefix}part-{index:05d}-{attempt}-{seq:04d}-{token}.parquet"
            seq += 1
            etag = s3.put_object(Bucket=ns.bucket, Key=key, Body=buf.getvalue())["ETag"]
            out = (key, len(keys), str(etag), unit)
            keys.clear()
            return out

        for row in rows:
            if keys and (row["unit"] != unit or len(keys) >= PART_ROWS):
                yield flush()
            unit = row["unit"]
            keys.append(row["key"])
        if keys:
            yield flush()

    df = (keys_df.select("key").withColumn("unit", F.regexp_extract("key", SLICE_RE, 1))
          .repartition("unit").sortWithinPartitions("unit"))
    # The regex in Spark and :func:`unit_of` must agree: a part read for a slice must hold
    # every key of the keep-set in that slice.
    out = df.rdd.mapPartitionsWithIndex(write).collect()
    return sorted((KeepSetPart(k, n, e, u) for k, n, e, u in out), key=lambda p: p.key)


PART_ROWS = 1_000_000


def parts_df(spark: Any, settings: Any, ns: Namespace, parts: tuple[KeepSetPart, ...]) -> Any:
    """The keys of stored parts, read inside tasks by the strict reader (each part exactly its
    recorded rows, one text column without nulls)."""
    from reconciler.evidence import keepset_part_keys
    from reconciler.mark import KEYS_SCHEMA
    from reconciler.s3io import cached_s3
    from reconciler.sparkio import distributed

    def produce(item: dict[str, Any]) -> Iterator[tuple[str]]:
        where = f"keep-set part s3://{ns.bucket}/{item['key']}"
        # IfMatch: the part read is the one whose ETag the descriptor sealed
        data = cached_s3(settings).get_object(Bucket=ns.bucket, Key=item["key"],
                                              IfMatch=item["etag"])["Body"].read()
        for keys in keepset_part_keys(data, where, int(item["rows"])):
            yield from zip(keys)

    return distributed(spark, [(p.key, p.rows, p.etag) for p in parts],
                       "key string, rows long, etag string",
                       produce, KEYS_SCHEMA)
