"""Run reports in the namespace: ``<ns>_hardelete/reports/<run_id>/`` (format in README.md)."""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from reconciler.evidence import EvidenceError, KeepSetProof
from reconciler.mark import Tally
from reconciler.s3io import Namespace, get_json, list_dirs, put_json
from reconciler.sweep import SweepStats
from schemas.layout import REPORTS_PREFIX

REPORT_FORMAT = 3  # 2: digests in the mark, retention fingerprint; 3: the keep-set's proof
SUMMARY = "summary.json"


def new_run_id(now_ms: int) -> str:
    """Sortable by time: ``20260101T020000Z-1a2b3c``."""
    stamp = dt.datetime.fromtimestamp(now_ms / 1000, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(3)}"


def iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


def summary_key(ns: Namespace, run_id: str) -> str:
    return ns.report_prefix(run_id) + SUMMARY


def write_summary(s3: Any, ns: Namespace, summary: RunSummary | dict[str, Any]) -> None:
    """``summary.json`` of a run (a stored summary read back as a dict is written as is)."""
    body = summary.to_dict() if isinstance(summary, RunSummary) else summary
    put_json(s3, ns.bucket, summary_key(ns, body["run_id"]), body)


def read_summary(s3: Any, ns: Namespace, run_id: str) -> dict[str, Any] | None:
    try:
        data = get_json(s3, ns.bucket, summary_key(ns, run_id))
    except s3.exceptions.NoSuchKey:
        return None
    except Exception as exc:  # botocore ClientError 404 on some servers
        if "NoSuchKey" in str(exc) or "404" in str(exc):
            return None
        raise
    return data if isinstance(data, dict) else None


def run_ids(s3: Any, ns: Namespace) -> list[str]:
    """Every run id with a report in the namespace, newest first."""
    prefix = ns.key(REPORTS_PREFIX)
    ids = [p[len(prefix):].rstrip("/") for p in list_dirs(s3, ns.bucket, prefix)]
    return sorted(ids, reverse=True)


def previous_runs(s3: Any, ns: Namespace, repo: str,
                  before: str | None = None) -> Iterator[RunSummary]:
    """Summaries of this repository's earlier runs, newest first (one with no run id is not
    a run's)."""
    for rid in run_ids(s3, ns):
        if before is not None and rid >= before:
            continue
        summary = read_summary(s3, ns, rid)
        if summary and summary.get("repository") == repo and summary.get("run_id"):
            yield _earlier_run(summary, ns, rid)


def _earlier_run(summary: dict[str, Any], ns: Namespace, rid: str) -> RunSummary:
    """An earlier run's summary as the blast-radius guard and an optimized run read it: the
    run of its own folder, of this namespace, its sweep's counts whole numbers; anything else
    stops the run (a summary copied from elsewhere or edited would move the guard's usual)."""
    where = f"report {summary_key(ns, rid)}"
    if summary.get("run_id") != rid:
        raise EvidenceError(f"{where}: holds run {summary.get('run_id')!r}, not {rid!r}")
    if summary.get("namespace") != ns.uri:
        raise EvidenceError(f"{where}: a run of namespace {summary.get('namespace')!r}, not "
                            f"{ns.uri}")
    try:
        run = RunSummary.from_dict(summary)
    except (KeyError, TypeError, ValueError) as exc:
        raise EvidenceError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None
    stats = None if run.sweep is None else run.sweep.stats
    if stats is not None and any(type(getattr(stats, f.name)) is not int
                                 for f in fields(stats) if f.name != "samples"):
        raise EvidenceError(f"{where}: its sweep's counts are not whole numbers")
    return run


def is_swept_baseline(summary: RunSummary) -> bool:
    """A run an optimized run may start from: a successful mark whose sweep completed."""
    return summary.success and summary.sweep is not None and summary.sweep.status == "done"


# --- the run summary (summary.json) ------------------------------------------------------------


@dataclass
class TrackerView:
    """What the run read of the tracker: its watermark and the horizon grace is judged at."""

    watermark_ms: int | None
    watermark: str | None
    ignored: bool
    export_started_ms: int | None = None
    grace_ms: int | None = None
    grace_horizon_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"watermark_ms": self.watermark_ms, "watermark": self.watermark,
                             "ignored": self.ignored}
        for name in ("export_started_ms", "grace_ms", "grace_horizon_ms"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrackerView:
        return cls(d.get("watermark_ms"), d.get("watermark"), bool(d.get("ignored")),
                   d.get("export_started_ms"), d.get("grace_ms"), d.get("grace_horizon_ms"))


@dataclass
class SweepOutcome:
    """What became of the sweep: ``not_run``, ``deferred``, ``paused``, ``refused``, ``failed``
    or ``done`` (then with the sweep's counts). A sweep that stopped part-way is ``failed``
    with its counts until then (the deletes the store confirmed), when it had begun deleting."""

    status: str
    reason: str | None = None
    error: str | None = None
    stats: SweepStats | None = None  # done; failed part-way: so far
    seconds: float | None = None
    at: str | None = None
    skipped_retained: int | None = None  # refused: what re-validation had taken out
    samples: dict[str, list[str]] | None = None  # refused

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"status": self.status}
        for name in ("reason", "error"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.stats is not None:
            d.update(self.stats.as_dict())
        for name in ("seconds", "at", "skipped_retained", "samples"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepOutcome:
        counted = {f.name for f in fields(SweepStats)}
        stats = None
        if "confirmed" in d:
            stats = SweepStats(**{k: v for k, v in d.items() if k in counted})
        return cls(str(d.get("status")), d.get("reason"), d.get("error"), stats,
                   d.get("seconds"), d.get("at"),
                   None if stats is not None else d.get("skipped_retained"),
                   None if stats is not None else d.get("samples"))


# The mark section's keys that the tally gives (it recomputes them from the categories).
_TALLY_KEYS = frozenset({"categories", "listed", "listed_bytes", "marked", "marked_bytes"})


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


@dataclass
class MarkSection:
    """The mark's part of the summary: the tally by category and the Parquet parts holding the
    marked keys (the sweep's input). Keys written by another version are kept in ``extra``.

    ``stored``: the totals (``marked``, ``listed``, ...) as the marking version wrote them,
    when read back. Another version may count a marked category this one does not know: the
    blast-radius guard of ``--sweep-only`` judges the larger of its count and the stored one
    (never fewer than the mark holds), and the stored totals are written back unchanged.
    """

    tally: Tally
    parts: list[str]
    extra: dict[str, Any] = field(default_factory=dict)
    stored: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def marked(self) -> int:
        return max(self.tally.marked, _count(self.stored.get("marked")) or 0)

    @property
    def listed(self) -> int:
        stored = _count(self.stored.get("listed"))
        return self.tally.listed if stored is None else stored

    def as_dict(self) -> dict[str, Any]:
        return {**self.tally.as_dict(), **self.stored, "parts": list(self.parts), **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MarkSection:
        return cls(Tally.from_dict(d), [str(p) for p in d.get("parts") or ()],
                   {k: v for k, v in d.items() if k not in _TALLY_KEYS | {"parts"}},
                   {k: d[k] for k in _TALLY_KEYS - {"categories"} if k in d})


@dataclass
class UncommittedSection:
    """The tracker's uncommitted export at the mark: its counts (``ExportResult.as_dict``) and
    the bucket keys of its Parquet parts (an optimized run re-checks the previous run's set)."""

    counts: dict[str, Any]
    part_keys: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    _COUNTS = ("parts", "addresses", "live", "outside_namespace", "extra_forms", "rows",
               "live_by_reason", "by_kind")

    def as_dict(self) -> dict[str, Any]:
        return {**self.counts, "part_keys": list(self.part_keys), **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UncommittedSection:
        return cls({k: d[k] for k in cls._COUNTS if k in d},
                   [str(k) for k in d.get("part_keys") or ()],
                   {k: v for k, v in d.items() if k not in cls._COUNTS and k != "part_keys"})


@dataclass
class ListingSection:
    """How the mark listed the namespace: ``s3`` (its slices; an optimized run only those
    newer than its baseline's ``last_read_slice``) or an ``inventory``; ``details`` are the
    counts and names shown (units, slices, files, the baseline run)."""

    source: str
    last_read_slice: str | None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, **self.details, "last_read_slice": self.last_read_slice}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ListingSection:
        return cls(str(d.get("source")), d.get("last_read_slice"),
                   {k: v for k, v in d.items() if k not in ("source", "last_read_slice")})


@dataclass
class RetentionSection:
    """The mark's retention: what it retained (the plan's counts), under which policy and
    options, the fingerprint of its inputs and where its retained commits were written. The
    sweep reads it back to judge retention again when the inputs changed since the mark."""

    counts: dict[str, Any]  # RetentionPlan.as_dict
    policy: dict[str, Any]
    expire_older_than_days: float | None
    # None: a summary written before the mark recorded them (the sweep then uses the
    # defaults, as it did)
    expiration_mode: str | None = None
    delete_expired_refs: bool | None = None
    fingerprint: str | None = None
    retained_key: str | None = None
    committed_keys: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # --delete-expired-refs: where the refs listed for the service to delete were written
    expired_refs_key: str | None = None

    _OWN = ("policy", "expire_older_than_days", "expiration_mode", "delete_expired_refs",
            "fingerprint", "retained_key", "committed_keys", "expired_refs_key")
    _COUNTS = ("commits", "retained", "manifests", "expired_commits", "refs_pointing_to_expired",
               "refs_to_delete")

    def as_dict(self) -> dict[str, Any]:
        own = {"policy": self.policy, "expire_older_than_days": self.expire_older_than_days,
               **{k: getattr(self, k) for k in self._OWN[2:] if getattr(self, k) is not None}}
        return {**self.counts, **own, **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RetentionSection:
        return cls({k: d[k] for k in cls._COUNTS if k in d}, dict(d.get("policy") or {}),
                   d.get("expire_older_than_days"), d.get("expiration_mode"),
                   d.get("delete_expired_refs"), d.get("fingerprint"), d.get("retained_key"),
                   d.get("committed_keys"),
                   {k: v for k, v in d.items() if k not in cls._OWN and k not in cls._COUNTS},
                   d.get("expired_refs_key"))

    def dropped_live_refs(self) -> bool:
        """A mark of a version whose --delete-expired-refs made retention ignore the refs at
        expired snapshots, live ones included (issue 33): it recorded the option but wrote no
        list of refs. Its retained set may lack a live ref's commit, so the sweep judges it
        again whatever the fingerprint says."""
        return bool(self.delete_expired_refs) and self.expired_refs_key is None


@dataclass
class Divergence:
    """One cross-check between the mark and the online state: how many keys and a sample, or
    the error that kept it from being made."""

    count: int = 0
    sample: list[str] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        return {"count": self.count, "sample": list(self.sample)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Divergence:
        return cls(_count(d.get("count")) or 0, [str(k) for k in d.get("sample") or ()],
                   d.get("error"))


@dataclass
class CrossCheck:
    """The cross-checks by name (``live_in_redis_missing_from_store``,
    ``committed_missing_from_store``, ``unreferenced_online_not_marked``,
    ``marked_but_referenced_online``)."""

    checks: dict[str, Divergence] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Divergence:
        return self.checks[name]

    def __setitem__(self, name: str, value: Divergence) -> None:
        self.checks[name] = value

    def as_dict(self) -> dict[str, Any]:
        return {name: d.as_dict() for name, d in self.checks.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CrossCheck:
        return cls({str(k): Divergence.from_dict(v) for k, v in d.items()
                    if isinstance(v, dict)})


@dataclass
class ServiceExportSection:
    """The service's uncommitted export the mark used (``found``), or that none was named."""

    found: bool
    location: str | None = None
    exported_at_ms: int | None = None
    files: int | None = None
    rows: int | None = None
    fresh: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"found": self.found, "location": self.location}
        for name in ("exported_at_ms", "files", "rows", "fresh"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServiceExportSection:
        return cls(bool(d.get("found")), d.get("location"), d.get("exported_at_ms"),
                   d.get("files"), d.get("rows"), d.get("fresh"))


FAIL_CLOSED_NOTE = ("the mirror is unproven: leaked, unreferenced and expired-upload objects are "
                    "kept (category withheld) until it is rebuilt; an uncommitted export, even "
                    "a fresh one, does not vouch for commits lost in the gap")


@dataclass
class FailClosedSection:
    """The repository was fail-closed at the mark: why, and that its leaks were withheld."""

    reason: str
    fresh_export: bool
    withheld: bool = True
    note: str = FAIL_CLOSED_NOTE

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "fresh_export": self.fresh_export,
                "withheld": self.withheld, "note": self.note}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailClosedSection:
        return cls(str(d.get("reason")), bool(d.get("fresh_export")),
                   d.get("withheld") is not False, str(d.get("note") or FAIL_CLOSED_NOTE))


@dataclass
class Revalidation:
    """What the sweep found when it judged the mark again against what is true now."""

    retention_changed: bool | None = None
    fingerprint_at_mark: str | None = None
    fingerprint_now: str | None = None
    fail_closed: str | None = None  # fail-closed now, not at the mark: refused
    newly_retained_commits: int | None = None
    new_manifests: int | None = None
    skipped_retained: int | None = None
    parts: list[str] | None = None  # the re-written mark, when retention changed
    changed_after_mark: Divergence | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    _OWN = ("retention_changed", "fingerprint_at_mark", "fingerprint_now", "fail_closed",
            "newly_retained_commits", "new_manifests", "skipped_retained", "parts")

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self._OWN if getattr(self, k) is not None}
        if self.changed_after_mark is not None:
            d["changed_after_mark"] = self.changed_after_mark.as_dict()
        return {**d, **self.extra}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Revalidation:
        changed = d.get("changed_after_mark")
        return cls(**{k: d.get(k) for k in cls._OWN},
                   changed_after_mark=Divergence.from_dict(changed)
                   if isinstance(changed, dict) else None,
                   extra={k: v for k, v in d.items()
                          if k not in cls._OWN and k != "changed_after_mark"})


@dataclass
class BlastRadiusSection:
    """The blast-radius guard's figures and verdict (``reconciler/blast_radius.py``)."""

    would_delete: int
    listed: int
    history: list[int]
    usual: float | None
    floor: int
    max_share: float
    max_growth: float
    problems: list[str]
    allowed_by_flag: bool

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlastRadiusSection:
        return cls(int(d.get("would_delete") or 0), int(d.get("listed") or 0),
                   [int(x) for x in d.get("history") or ()], d.get("usual"),
                   int(d.get("floor") or 0), float(d.get("max_share") or 0),
                   float(d.get("max_growth") or 0), [str(p) for p in d.get("problems") or ()],
                   bool(d.get("allowed_by_flag")))


# The summary's keys, in the order it is written; any other key of a stored summary (written by
# another version) is kept as it was.
_SECTIONS = ("uncommitted", "retention", "listing", "service_export", "fail_closed", "keepset",
             "mark", "marked_at_ms", "crosscheck", "revalidation", "blast_radius")


def _stored(value: Any) -> Any:
    """A section as stored: a typed record's ``as_dict``; an empty dict or None is absent."""
    if value is None:
        return None
    return (value.as_dict() if hasattr(value, "as_dict") else value) or None


@dataclass
class RunSummary:
    """One reconciler run: what lands in ``summary.json`` (written by :func:`write_summary`,
    the only serialisation). Each phase fills its part: the cutoff and the tracker view, the
    mark's sections (from the typed records' ``as_dict``), the sweep's outcome."""

    run_id: str
    repository: str
    namespace: str
    mode: str
    dry_run: bool
    started_at: str | None
    now_ms: int
    format: int = REPORT_FORMAT
    success: bool = False
    status: str = "running"
    error: str | None = None
    mode_note: str | None = None
    updated_at: str | None = None
    finished_at: str | None = None
    timings: dict[str, float] | None = None
    cutoff_ms: int | None = None
    cutoff: str | None = None
    cutoff_source: str | None = None
    tracker: TrackerView | None = None
    uncommitted: UncommittedSection | None = None
    retention: RetentionSection | None = None
    listing: ListingSection | None = None
    service_export: ServiceExportSection | None = None
    fail_closed: FailClosedSection | None = None
    keepset: KeepSetProof | None = None
    mark: MarkSection | None = None
    marked_at_ms: int | None = None
    crosscheck: CrossCheck = field(default_factory=CrossCheck)
    revalidation: Revalidation = field(default_factory=Revalidation)
    blast_radius: BlastRadiusSection | None = None
    sweep: SweepOutcome | None = None
    metrics: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def marked(self) -> int:
        return 0 if self.mark is None else self.mark.marked

    @property
    def listed(self) -> int:
        return 0 if self.mark is None else self.mark.listed

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": self.format, "run_id": self.run_id, "repository": self.repository,
            "namespace": self.namespace, "mode": self.mode, "dry_run": self.dry_run,
            "started_at": self.started_at, "now_ms": self.now_ms, "success": self.success,
            "status": self.status, "error": self.error}
        optional: dict[str, Any] = {
            "mode_note": self.mode_note, "updated_at": self.updated_at,
            "finished_at": self.finished_at, "timings": self.timings,
            "cutoff_ms": self.cutoff_ms, "cutoff": self.cutoff,
            "cutoff_source": self.cutoff_source,
            "tracker": _stored(self.tracker),
            **{name: _stored(getattr(self, name)) for name in _SECTIONS},
            "sweep": _stored(self.sweep), "metrics": self.metrics}
        optional["marked_at_ms"] = self.marked_at_ms
        d.update({k: v for k, v in optional.items() if v is not None})
        d.update({k: v for k, v in self.extra.items() if k not in d})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSummary:
        known = {f.name for f in fields(cls)} - {"extra"}
        s = cls(str(d["run_id"]), str(d.get("repository")), str(d.get("namespace")),
                str(d.get("mode")), bool(d.get("dry_run")), d.get("started_at"),
                int(d.get("now_ms") or 0), int(d.get("format") or 0),
                bool(d.get("success")), str(d.get("status")), d.get("error"))
        for name in known - {"run_id", "repository", "namespace", "mode", "dry_run",
                             "started_at", "now_ms", "format", "success", "status", "error",
                             *_TYPED}:
            if d.get(name) is not None:
                setattr(s, name, d[name])
        for name, record in _TYPED.items():
            if isinstance(d.get(name), dict):
                setattr(s, name, record.from_dict(d[name]))
        s.extra = {k: v for k, v in d.items() if k not in known}
        return s


# The sections stored as typed records (each with as_dict/from_dict).
_TYPED: dict[str, Any] = {"tracker": TrackerView, "uncommitted": UncommittedSection,
                          "listing": ListingSection, "retention": RetentionSection,
                          "mark": MarkSection, "sweep": SweepOutcome,
                          "keepset": KeepSetProof, "service_export": ServiceExportSection,
                          "fail_closed": FailClosedSection, "crosscheck": CrossCheck,
                          "revalidation": Revalidation, "blast_radius": BlastRadiusSection}
