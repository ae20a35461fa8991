"""The sweep: bulk, parallel deletes of a successful mark, from Spark tasks.

Each task reads mark parts, and for every batch of at most 1,000 keys:

1. **guard** (:func:`guard`): a key outside the namespace, under a reserved prefix or not a
   plain key is refused whatever the mark says (``schemas.layout.namespace_key``);
2. **re-check** against the tracker's current state: the lease must still be ours, a key
   whose record now has a live reference, an unexpired issued upload or a claim is skipped
   (``marked but still referenced online``), and a key whose record (or the state of a token
   it names) changed since the mark's export is skipped (``skipped_changed``: judged again by
   the next mark; a new reference, a commit unknown at mark time, a restarted grace window);
3. **delete** (:func:`delete_batch`): one ``delete_objects`` request (never more than 1,000
   keys), retried with jittered exponential backoff; per-key errors are retried when they are
   transient and reported otherwise. Only keys the store lists under ``Deleted`` count as
   confirmed.

Outcomes per key are written next to the mark (``sweep/part-*.parquet``) for ``explain``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hardelete.clients import redis_sync
from hardelete.settings import Settings
from reconciler.records import token_state, verdict
from reconciler.s3io import Namespace, cached_s3, put_parquet, read_parquet_rows
from reconciler.state import refs_fingerprint
from schemas.layout import RECONCILER_LEASE, OutsideNamespace, RepoKeys, namespace_key

MAX_KEYS_PER_REQUEST = 1000
TRANSIENT_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
                             "503", "500", "ThrottlingException"})

CONFIRMED = "deleted"
FAILED = "failed"
REFUSED = "refused"
SKIPPED_LIVE = "skipped_live"
SKIPPED_CHANGED = "skipped_changed"
SKIPPED_RETAINED = "skipped_retained"
NOT_ATTEMPTED = "not_attempted"


def guard(ns: Namespace, rels: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split namespace-relative keys into (bucket keys that may be deleted, refused rels)."""
    ok: list[str] = []
    refused: list[str] = []
    for rel in rels:
        try:
            namespace_key(ns.uri, ns.address(rel))
        except OutsideNamespace:
            refused.append(rel)
            continue
        ok.append(ns.key(rel))
    return ok, refused


@dataclass
class BatchResult:
    deleted: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # key -> "Code: message"
    refused: list[str] = field(default_factory=list)
    requests: int = 0


def delete_batch(s3: Any, ns: Namespace, keys: list[str], *, attempts: int = 5,
                 base_delay: float = 0.1, sleep: Callable[[float], None] = time.sleep,
                 rng: random.Random | None = None) -> BatchResult:
    """Delete up to 1,000 bucket keys of the namespace; confirmed keys in ``deleted``.

    The final guard lives here: every key is checked against the namespace and the reserved
    prefixes before any request, and more than 1,000 keys is a programming error.
    """
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(keys)} keys in one delete request (at most 1000)")
    rng = rng or random.Random()
    result = BatchResult()
    pending: list[str] = []
    for key in keys:
        rel = ns.rel_of_key(key)
        try:
            if rel is None:
                raise OutsideNamespace(key)
            namespace_key(ns.uri, ns.address(rel))
        except OutsideNamespace:
            result.refused.append(key)
            continue
        pending.append(key)
    attempt = 0
    while pending:
        attempt += 1
        result.requests += 1
        try:
            resp = s3.delete_objects(
                Bucket=ns.bucket,
                Delete={"Objects": [{"Key": k} for k in pending], "Quiet": False})
        except Exception as exc:  # the whole request failed: retry all of it
            if attempt >= attempts:
                for k in pending:
                    result.errors[k] = f"request: {type(exc).__name__}: {exc}"
                return result
            sleep(base_delay * (2 ** (attempt - 1)) * (0.5 + rng.random()))
            continue
        asked = set(pending)
        retry: list[str] = []
        for d in resp.get("Deleted", ()):
            if d.get("Key") in asked:
                result.deleted.append(d["Key"])
        for e in resp.get("Errors", ()):
            key, code = e.get("Key", ""), str(e.get("Code", ""))
            if key not in asked:
                continue
            if code in TRANSIENT_CODES and attempt < attempts:
                retry.append(key)
            else:
                result.errors[key] = f"{code}: {e.get('Message', '')}"
        answered = set(result.deleted) | set(result.errors) | set(retry)
        # A key the store did not mention is not confirmed: ask again, then call it an error.
        silent = [k for k in pending if k not in answered]
        if silent and attempt >= attempts:
            for k in silent:
                result.errors[k] = "no answer from the store"
            silent = []
        pending = retry + silent
        if pending:
            sleep(base_delay * (2 ** (attempt - 1)) * (0.5 + rng.random()))
    return result


# ------------------------------------------------------------------------ online re-check

def still_referenced(r: Any, repo: str, ns: Namespace, rels: list[str], *, cutoff_ms: int,
                     now_ms: int) -> set[str]:
    """The rels whose tracker record is live right now (one pipeline per batch)."""
    keys = RepoKeys(repo)
    pipe = r.pipeline(transaction=False)
    for rel in rels:
        pipe.hgetall(keys.address(ns.address(rel)))
    records = pipe.execute()
    tokens: set[str] = set()
    for rec in records:
        for k, v in (rec or {}).items():
            if k.startswith("+"):
                tokens.add(v)
    token_list = sorted(tokens)
    states = dict(zip(token_list, r.hmget(keys.tokens, token_list), strict=True)) \
        if token_list else {}
    token_states = {t: token_state(v) for t, v in states.items()}
    claims_pipe = r.pipeline(transaction=False)
    for rel in rels:
        claims_pipe.zscore(keys.claims, ns.address(rel))
    claimed = claims_pipe.execute()
    live: set[str] = set()
    for rel, rec, claim in zip(rels, records, claimed, strict=True):
        if not rec:
            continue
        v = verdict(rec, token_states=token_states, cutoff_ms=cutoff_ms, now_ms=now_ms,
                    claimed=claim is not None)
        if v.live:
            live.add(rel)
    return live


@dataclass
class SweepStats:
    marked: int = 0
    marked_bytes: int = 0
    confirmed: int = 0
    confirmed_bytes: int = 0
    failed: int = 0
    refused: int = 0
    skipped_live: int = 0
    skipped_changed: int = 0
    skipped_retained: int = 0
    requests: int = 0
    samples: dict[str, list[str]] = field(default_factory=dict)

    def sample(self, what: str, text: str, limit: int = 20) -> None:
        lst = self.samples.setdefault(what, [])
        if len(lst) < limit:
            lst.append(text)

    def merge(self, other: SweepStats) -> None:
        for name in ("marked", "marked_bytes", "confirmed", "confirmed_bytes", "failed",
                     "refused", "skipped_live", "skipped_changed", "skipped_retained",
                     "requests"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for what, lst in other.samples.items():
            for text in lst:
                self.sample(what, text)

    def as_dict(self) -> dict[str, Any]:
        return {"marked": self.marked, "marked_bytes": self.marked_bytes,
                "confirmed": self.confirmed, "confirmed_bytes": self.confirmed_bytes,
                "failed": self.failed, "refused": self.refused,
                "skipped_live": self.skipped_live, "skipped_changed": self.skipped_changed,
                "skipped_retained": self.skipped_retained, "requests": self.requests,
                "samples": self.samples}


class RetentionMoved(RuntimeError):
    """Branches, tags, commits or policy changed while the sweep ran: it stops."""


def sweep_part(settings: Settings, repo: str, lease_id: str, ns: Namespace, mark_key: str,
               out_key: str, *, cutoff_ms: int, recheck: bool = True,
               delete: bool = True, refs: str | None = None) -> SweepStats:
    """Sweep one mark part; write per-key outcomes to ``out_key``. Runs inside a task.

    ``delete=False`` only re-checks the mark against the online state (dry run).
    """
    s3 = cached_s3(settings)
    r = redis_sync(settings) if recheck else None
    stats = SweepStats()
    out: dict[str, list[Any]] = {"key": [], "category": [], "size": [], "outcome": [],
                                 "error": []}

    def record(rel: str, cat: str, size: int, outcome: str, error: str | None = None) -> None:
        out["key"].append(rel)
        out["category"].append(cat)
        out["size"].append(size)
        out["outcome"].append(outcome)
        out["error"].append(error)

    rows = read_parquet_rows(s3, ns.bucket, mark_key, ["key", "category", "size", "digest"])
    try:
        batch: list[tuple[str, str, int, str | None]] = []
        for row in rows:
            batch.append((str(row[0]), str(row[1]), int(row[2] or 0),
                          None if row[3] is None else str(row[3])))
            if len(batch) >= MAX_KEYS_PER_REQUEST:
                _sweep_batch(s3, r, repo, lease_id, ns, batch, cutoff_ms, stats, record, delete,
                             refs)
                batch = []
        if batch:
            _sweep_batch(s3, r, repo, lease_id, ns, batch, cutoff_ms, stats, record, delete,
                         refs)
    finally:
        if out["key"] and delete:
            put_parquet(s3, ns.bucket, out_key, out)
        if r is not None:
            r.close()
    return stats


def changed_since_mark(r: Any, repo: str, ns: Namespace,
                       digests: dict[str, str | None]) -> set[str]:
    """The rels whose tracker record (or a state of a token it names) is not the one the
    mark judged: ``digests`` maps rel -> the record's digest at the export (None: no record)."""
    from reconciler.records import token_state
    from reconciler.state import record_digest

    keys = RepoKeys(repo)
    rels = list(digests)
    pipe = r.pipeline(transaction=False)
    for rel in rels:
        pipe.hgetall(keys.address(ns.address(rel)))
    records = pipe.execute()
    tokens = sorted({v for rec in records for k, v in (rec or {}).items()
                     if k.startswith("+")})
    states = ({t: token_state(v) for t, v in zip(tokens, r.hmget(keys.tokens, tokens),
                                                 strict=True)} if tokens else {})
    return {rel for rel, rec in zip(rels, records, strict=True)
            if record_digest(rec or None, states) != digests[rel]}


def _sweep_batch(s3: Any, r: Any, repo: str, lease_id: str, ns: Namespace,
                 batch: list[tuple[str, str, int, str | None]], cutoff_ms: int,
                 stats: SweepStats, record: Callable[..., None], delete: bool,
                 refs: str | None = None) -> None:
    stats.marked += len(batch)
    stats.marked_bytes += sum(b[2] for b in batch)
    info = {rel: (cat, size) for rel, cat, size, _ in batch}
    live: set[str] = set()
    changed: set[str] = set()
    if r is not None:
        holder = r.get(RECONCILER_LEASE + repo)
        if holder != lease_id:
            raise RuntimeError(f"reconciler lease lost (held by {holder!r}): sweep stopped")
        if refs is not None and refs_fingerprint(r, repo) != refs:
            # Retention was re-judged for the refs of the sweep's start; they moved since.
            raise RetentionMoved("branches, tags, commits or retention changed during the "
                                 "sweep: it stopped; sweep again with --sweep-only (the mark "
                                 "is re-validated)")
        sec, usec = r.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        live = still_referenced(r, repo, ns, list(info), cutoff_ms=cutoff_ms, now_ms=now_ms)
        changed = changed_since_mark(r, repo, ns, {rel: d for rel, _, _, d in batch
                                                   if rel not in live})
    for rel in sorted(live):
        stats.skipped_live += 1
        stats.sample("skipped_live", rel)
        record(rel, info[rel][0], info[rel][1], SKIPPED_LIVE)
    for rel in sorted(changed):
        stats.skipped_changed += 1
        stats.sample("skipped_changed", rel)
        record(rel, info[rel][0], info[rel][1], SKIPPED_CHANGED)
    ok, refused = guard(ns, [rel for rel in info if rel not in live and rel not in changed])
    for rel in refused:
        stats.refused += 1
        stats.sample("refused", rel)
        record(rel, info[rel][0], info[rel][1], REFUSED)
    if not ok or not delete:
        return
    res = delete_batch(s3, ns, ok)
    stats.requests += res.requests
    for key in res.refused:
        rel = key[len(ns.prefix):]
        stats.refused += 1
        record(rel, info.get(rel, ("", 0))[0], info.get(rel, ("", 0))[1], REFUSED)
    for key in res.deleted:
        rel = key[len(ns.prefix):]
        stats.confirmed += 1
        stats.confirmed_bytes += info[rel][1]
        record(rel, info[rel][0], info[rel][1], CONFIRMED)
    for key, err in res.errors.items():
        rel = key[len(ns.prefix):]
        stats.failed += 1
        stats.sample("failed", f"{rel}: {err}")
        record(rel, info[rel][0], info[rel][1], FAILED, err)


def sweep(spark: Any, settings: Settings, repo: str, lease_id: str, ns: Namespace,
          mark_parts: list[str], *, cutoff_ms: int, recheck: bool = True, delete: bool = True,
          report_run_id: str | None = None, refs: str | None = None) -> SweepStats:
    """Sweep every mark part in parallel Spark tasks; the merged stats come back.

    ``lease_id`` is the value the repository's reconciler lease must hold for every batch;
    outcomes go to the report of ``report_run_id`` (default: ``lease_id``). ``refs``: the
    :func:`reconciler.state.refs_fingerprint` the mark was re-validated against; every batch
    checks it is unchanged (else :class:`RetentionMoved`).
    """
    total = SweepStats()
    if not mark_parts:
        return total
    prefix = ns.report_prefix(report_run_id or lease_id) + "sweep/"
    items = [(k, f"{prefix}part-{i:05d}.parquet") for i, k in enumerate(mark_parts)]

    def run(it: Iterator[tuple[str, str]]) -> Iterator[SweepStats]:
        for mark_key, out_key in it:
            yield sweep_part(settings, repo, lease_id, ns, mark_key, out_key,
                             cutoff_ms=cutoff_ms, recheck=recheck, delete=delete, refs=refs)

    parts = spark.sparkContext.parallelize(items, max(1, min(len(items), 64))).mapPartitions(run)
    for st in parts.collect():
        total.merge(st)
    return total
