"""The mark: which listed objects are garbage. Pure decisions, then the same on Spark.

Every listed object falls in exactly one category, decided in this order:

==================  =========================================================================
``reserved``        under a reserved metadata prefix (``_hardelete/``, ``_lakefs/``) or not a
                    plain key of the namespace: never marked
``committed``       listed by the manifest of a retained commit: live. The manifests are the
                    committed truth: a tracker record flagged committed that no retained
                    manifest lists is not protected by its flag (``committed_expired`` below)
``uncommitted``     live in the tracker's state (a live reference in an open or sealed token,
                    an unexpired issued upload, a reaper's claim in flight, inside the grace
                    window, or doubt), or listed by the service's own uncommitted export: live
``recent``          not live, but last modified at or after the cutoff: not a candidate yet
``withheld``        would be ``leaked`` or ``unreferenced``, but the repository is fail-closed
                    (its mirror is unproven) and no fresh service export vouches: kept
``leaked``          MARKED: the tracker never heard of it (written with no event)
``unreferenced``    MARKED: the tracker knows it, every reference ended (uncommitted garbage)
``expired_upload``  MARKED: issued for an upload that was never linked, and expired
``committed_expired``  MARKED: committed once, but no retained commit's manifest lists it
``reaped``          MARKED: the tracker says it was reaped, yet the object is there
==================  =========================================================================

The pure functions work on iterables and sets (unit and property tests); :func:`classify_df`
is the same decision as DataFrame joins for the job.
``tests/{unit,integration}/test_mark.py`` checks they agree.
Keys are relative to the storage namespace.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.layout import RESERVED_PREFIXES

RESERVED = "reserved"
COMMITTED = "committed"
UNCOMMITTED = "uncommitted"
RECENT = "recent"
WITHHELD = "withheld"
LEAKED = "leaked"
UNREFERENCED = "unreferenced"
EXPIRED_UPLOAD = "expired_upload"
COMMITTED_EXPIRED = "committed_expired"
REAPED = "reaped"

KEPT_CATEGORIES = (RESERVED, COMMITTED, UNCOMMITTED, RECENT, WITHHELD)
MARKED_CATEGORIES = (LEAKED, UNREFERENCED, EXPIRED_UPLOAD, COMMITTED_EXPIRED, REAPED)
CATEGORIES = KEPT_CATEGORIES + MARKED_CATEGORIES

# Marked only when the mirror is proven (or a fresh service export vouches for it).
WITHHOLDABLE = (LEAKED, UNREFERENCED)

# What the tracker's record says about a non-live address (the ``kind`` column of the export)
# -> the marked category. Unknown kinds are ``unreferenced``.
KIND_TO_CATEGORY = {
    "unreferenced": UNREFERENCED,
    "issued": EXPIRED_UPLOAD,
    "committed": COMMITTED_EXPIRED,
    "reaped": REAPED,
}


def is_plain_key(rel: str) -> bool:
    """A key the sweep may ever touch: not reserved, not empty, no '.'/'..'/empty segments."""
    if not rel or rel.startswith("/") or "//" in rel:
        return False
    if any(part in (".", "..") for part in rel.split("/")):
        return False
    return not any(rel.startswith(p) for p in RESERVED_PREFIXES)


@dataclass(frozen=True, slots=True)
class Listed:
    """One object of the namespace listing."""

    key: str  # relative to the namespace
    size: int
    last_modified_ms: int


@dataclass
class Tally:
    """Count and bytes per category."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def add(self, category: str, size: int, n: int = 1) -> None:
        self.counts[category] = self.counts.get(category, 0) + n
        self.bytes[category] = self.bytes.get(category, 0) + size

    @property
    def marked(self) -> int:
        return sum(self.counts.get(c, 0) for c in MARKED_CATEGORIES)

    @property
    def marked_bytes(self) -> int:
        return sum(self.bytes.get(c, 0) for c in MARKED_CATEGORIES)

    @property
    def listed(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            # every category counted, those of another version (read back) included
            "categories": {c: {"count": self.counts.get(c, 0), "bytes": self.bytes.get(c, 0)}
                           for c in (*CATEGORIES, *sorted(set(self.counts) - set(CATEGORIES)))},
            "listed": self.listed,
            "listed_bytes": sum(self.bytes.values()),
            "marked": self.marked,
            "marked_bytes": self.marked_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tally:
        t = cls()
        for c, v in data.get("categories", {}).items():
            t.counts[c] = int(v["count"])
            t.bytes[c] = int(v["bytes"])
        return t


def classify(obj: Listed, *, cutoff_ms: int, committed: Container[str],
             uncommitted: Container[str], known: Mapping[str, str],
             withhold: bool = False) -> str:
    """The category of one listed object (see the module docstring for the order).

    ``uncommitted``: the tracker's live keys and the service export's, together.
    ``withhold``: the mirror is unproven (fail-closed without a fresh service export):
    what only the mirror's silence makes garbage is kept.
    """
    if not is_plain_key(obj.key):
        return RESERVED
    if obj.key in committed:
        return COMMITTED
    if obj.key in uncommitted:
        return UNCOMMITTED
    if obj.last_modified_ms >= cutoff_ms:
        return RECENT
    kind = known.get(obj.key)
    category = LEAKED if kind is None else KIND_TO_CATEGORY.get(kind, UNREFERENCED)
    if withhold and category in WITHHOLDABLE:
        return WITHHELD
    return category


@dataclass
class MarkResult:
    marked: list[tuple[Listed, str]]
    tally: Tally

    @property
    def marked_keys(self) -> set[str]:
        return {o.key for o, _ in self.marked}


def compute_mark(listing: Iterable[Listed], *, cutoff_ms: int, committed: Container[str],
                 uncommitted: Container[str],
                 known: Mapping[str, str] | None = None,
                 withhold: bool = False) -> MarkResult:
    """listed - committed - uncommitted - reserved, older than the cutoff; with a tally.

    ``known`` maps keys the tracker has a record of to that record's kind (for the category of
    a marked object; absent keys are leaks).
    """
    known = known or {}
    tally = Tally()
    marked: list[tuple[Listed, str]] = []
    for obj in listing:
        category = classify(obj, cutoff_ms=cutoff_ms, committed=committed,
                            uncommitted=uncommitted, known=known, withhold=withhold)
        tally.add(category, obj.size)
        if category in MARKED_CATEGORIES:
            marked.append((obj, category))
    return MarkResult(marked, tally)


# ---------------------------------------------------------------------------------- Spark

LISTING_SCHEMA = "key string, size long, last_modified long"
KEYS_SCHEMA = "key string"
EXPORT_SCHEMA = ("key string, live boolean, kind string, reason string, commit string, "
                 "digest string")
MARK_COLUMNS = ("key", "size", "last_modified", "category", "digest")
MARK_SCHEMA = "key string, size long, last_modified long, category string, digest string"


def _bad_key() -> Any:
    """The Column twin of ``not is_plain_key(key)``."""
    from pyspark.sql import functions as F

    cond = (F.col("key") == "") | F.col("key").startswith("/") | F.col("key").contains("//") \
        | F.col("key").rlike(r"(^|/)\.\.?(/|$)")
    for p in RESERVED_PREFIXES:
        cond = cond | F.col("key").startswith(p)
    return cond


def classify_df(listing: Any, committed: Any, known: Any, cutoff_ms: int,
                service: Any = None, withhold: bool = False,
                known_unique: bool = False) -> Any:
    """The same decision as :func:`classify`, on DataFrames.

    ``listing``: key, size, last_modified (ms). ``committed``: key (retained commits' keys,
    duplicates allowed). ``known``: the tracker export (key, live, kind, ..., digest); a key
    with several rows (two records naming one key) is live. ``service``: keys of the
    service's uncommitted export (live), or None. ``known_unique``: the caller knows each key
    has one row (no extra address forms), which spares a shuffle. Returns the listing with
    ``category`` and ``digest`` (the tracker record's digest at export, None without a record).
    """
    from pyspark.sql import functions as F

    bad_key = _bad_key()
    c = committed.select("key").distinct().withColumn("_committed", F.lit(True))
    digest = F.col("digest") if "digest" in known.columns else F.lit(None).cast("string")
    if known_unique:
        k = known.select("key", F.col("live").alias("_live"), F.col("kind").alias("_kind"),
                         digest.alias("digest"))
    else:
        k = (known.select("key", "live", "kind", digest.alias("digest"))
             .groupBy("key")
             .agg((F.max(F.col("live").cast("int")).cast("boolean")
                   | (F.count(F.lit(1)) > 1)).alias("_live"),
                  F.first("kind").alias("_kind"), F.first("digest").alias("digest")))
    joined = listing.join(c, "key", "left").join(k, "key", "left")
    live = F.coalesce(F.col("_live"), F.lit(False))
    if service is not None:
        svc = service.select("key").distinct().withColumn("_service", F.lit(True))
        joined = joined.join(svc, "key", "left")
        live = live | F.col("_service").isNotNull()
    category = F.when(bad_key, F.lit(RESERVED))
    category = category.when(F.col("_committed").isNotNull(), F.lit(COMMITTED))
    category = category.when(live, F.lit(UNCOMMITTED))
    category = category.when(F.col("last_modified") >= F.lit(cutoff_ms), F.lit(RECENT))
    leaked = F.lit(WITHHELD if withhold else LEAKED)
    category = category.when(F.col("_kind").isNull(), leaked)
    for kind, cat in KIND_TO_CATEGORY.items():
        if withhold and cat in WITHHOLDABLE:
            cat = WITHHELD
        category = category.when(F.col("_kind") == kind, F.lit(cat))
    category = category.otherwise(F.lit(WITHHELD if withhold else UNREFERENCED))
    return joined.select("key", "size", "last_modified", category.alias("category"), "digest")


def mark_df(listing: Any, committed: Any, uncommitted_live: Any, cutoff_ms: int) -> Any:
    """Only the marked keys, as left anti joins (used to double-check :func:`classify_df`)."""
    from pyspark.sql import functions as F

    candidates = listing.filter((F.col("last_modified") < F.lit(cutoff_ms)) & ~_bad_key())
    return (candidates.join(committed.select("key"), "key", "left_anti")
            .join(uncommitted_live.select("key"), "key", "left_anti"))


def tally_df(classified: Any) -> Tally:
    """Aggregate a classified DataFrame into a :class:`Tally` (a handful of rows collected)."""
    from pyspark.sql import functions as F

    tally = Tally()
    rows = classified.groupBy("category").agg(F.count(F.lit(1)).alias("n"),
                                              F.sum("size").alias("b")).collect()
    for row in rows:
        tally.add(row["category"], int(row["b"] or 0), int(row["n"]))
    return tally
