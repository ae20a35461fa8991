"""The sweep: bulk, parallel deletes of a successful mark, from Spark tasks.

Each task reads mark parts, and for every batch of at most 1,000 keys (two batches at a time,
so that one batch's re-check and outcome rows overlap the other's request):

1. **guard** (:func:`guard`): a key outside the namespace, under a reserved prefix or not a
   plain key is refused whatever the mark says (``schemas.layout.namespace_key``);
2. **re-check** against the tracker's current state: the lease must still be ours, a key
   whose record now has a live reference, an unexpired issued upload or a claim is skipped
   (``marked but still referenced online``), and a key whose record (or the state of a token
   it names) changed since the mark's export is skipped (``skipped_changed``: judged again by
   the next mark; a new reference, a commit unknown at mark time, a restarted grace window);
3. **delete**: through the one deleter (``core.deleter``): one request of at most 1,000
   keys, the re-check again right before it and before each retry (jittered exponential
   backoff; per-key errors retried when transient, reported otherwise). Only keys the store
   lists under ``Deleted`` (each version, on a versioned bucket) count as confirmed.

Outcomes per key are written next to the mark (``sweep/part-*.parquet``) for ``explain``, batch
by batch as each is done. A task that must stop (the lease lost, the refs moved, an error) writes
its batch's rows, stops its part and returns its counts with the reason: it does not fail, so
Spark kills no other task between a confirmed delete and its row. The driver then raises
:class:`SweepStopped` with every task's counts; when a task died nonetheless (its worker lost),
with the counts of the rows written so far (:func:`outcome_stats`). Either way the report counts
every delete the store confirmed, and only those (SPEC safety 6).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.clients import redis_sync
from core.clock import redis_time_ms
from core.deleter import Deleter, Plan, RetryPolicy
from core.facts import RepoFacts
from core.gate import Evidence, keep_reasons, read_evidence
from core.settings import Settings
from reconciler.s3io import Namespace, cached_s3, list_keys, put_parquet, read_parquet_rows
from reconciler.state import record_digest, refs_fingerprint
from schemas.layout import RECONCILER_LEASE, OutsideNamespace, namespace_key
from schemas.liveness import Keep
from schemas.records import token_state

MAX_KEYS_PER_REQUEST = 1000

CONFIRMED = "deleted"
FAILED = "failed"
REFUSED = "refused"
SKIPPED_LIVE = "skipped_live"
SKIPPED_GUARD = "skipped_guard"
GUARD_REASONS = frozenset({Keep.HELD, Keep.PAUSED, Keep.FAIL_CLOSED, Keep.NOT_OWNER})
# What a service export may vouch for in a fail-closed repository: nothing since an adversarial
# review showed a commit lost in the gap makes its objects look leaked, and an uncommitted
# export cannot tell (kept for the rebuild of issue 20, whose export covers commits too).
VOUCHED_CATEGORIES: frozenset[str] = frozenset()
SKIPPED_CHANGED = "skipped_changed"
CHANGED_AFTER_MARK = "changed after the mark"  # the re-check's reason (a record moved since)
STOPPED = "sweep stopped"  # the re-check's reason when the lease was lost or the refs moved
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


# ------------------------------------------------------------------------ online re-check

@dataclass(frozen=True)
class _AddressesOf:
    """The addresses of a container of namespace-relative keys (without copying it)."""

    rels: Container[str]
    ns: Namespace

    def __contains__(self, address: object) -> bool:
        return (isinstance(address, str) and address.startswith(self.ns.uri)
                and address[len(self.ns.uri):] in self.rels)


def judge_rels(r: Any, repo: str, ns: Namespace, rels: list[str], *, cutoff_ms: int,
               now_ms: int, horizon_ms: int | None = None, grace_ms: int = 0,
               vouched: Container[str] = (), facts: RepoFacts | None = None) -> dict[str, str]:
    """rel -> reason, for the rels that must be kept right now: the guards (holds,
    fail-closed, pause, namespace ownership, ``core.gate.Gate``) and the tracker's
    record judged again (``schemas.liveness.judge``, path ``reconciler``).

    ``vouched``: rels whose garbage verdict a fresh service export vouched for at the mark
    (leaked / unreferenced / expired uploads of a fail-closed repository, SPEC safety 10): the
    fail-closed guard does not keep them; every other guard and the record still do.

    ``facts``: the repository's durable holds and pauses, proven current right before the read
    (``core/facts.py``); without them every rel is kept."""
    return _judge_read(r, repo, ns, rels, cutoff_ms=cutoff_ms, now_ms=now_ms,
                       horizon_ms=horizon_ms, grace_ms=grace_ms, vouched=vouched,
                       facts=facts)[0]


def _judge_read(r: Any, repo: str, ns: Namespace, rels: list[str], *, cutoff_ms: int,
                now_ms: int, horizon_ms: int | None, grace_ms: int,
                vouched: Container[str], facts: RepoFacts | None
                ) -> tuple[dict[str, str], Evidence, dict[str, str]]:
    """:func:`judge_rels`, with the one evidence read it judged (and rel -> its address)."""
    by_address = {ns.address(rel): rel for rel in rels}
    proof = facts.prove(by="reconciler sweep") if facts is not None else None
    evidence = read_evidence(r, repo, by_address, facts=proof)
    keep = keep_reasons(evidence, repo, ns.uri, path="reconciler", horizon_ms=horizon_ms,
                        grace_ms=grace_ms, cutoff_ms=cutoff_ms, now_ms=now_ms,
                        vouched=_AddressesOf(vouched, ns))
    return ({by_address[a]: why for a, why in keep.items()}, evidence,
            {rel: a for a, rel in by_address.items()})


def still_referenced(r: Any, repo: str, ns: Namespace, rels: list[str], *, cutoff_ms: int,
                     now_ms: int, horizon_ms: int | None = None,
                     grace_ms: int = 0, facts: RepoFacts | None = None) -> set[str]:
    """The rels that must be kept right now (see :func:`judge_rels`)."""
    return set(judge_rels(r, repo, ns, rels, cutoff_ms=cutoff_ms, now_ms=now_ms,
                          horizon_ms=horizon_ms, grace_ms=grace_ms, facts=facts))


def recheck_for(r: Any, repo: str, ns: Namespace, *, cutoff_ms: int,
                horizon_ms: int | None = None, grace_ms: int = 0,
                vouched: Container[str] = (), facts: RepoFacts | None = None
                ) -> Callable[[list[str]], dict[str, str]]:
    """The recheck the deleter runs right before each request (Redis clock).

    ``horizon_ms``/``grace_ms`` make the re-check grace-aware (an address unreferenced less
    than ``grace_ms`` before the horizon is kept, ``young``); without them only ``cutoff_ms``
    bounds (the mark's own reading, until the job passes the horizon it used)."""

    def run(rels: list[str]) -> dict[str, str]:
        now_ms = redis_time_ms(r)
        return judge_rels(r, repo, ns, rels, cutoff_ms=cutoff_ms, now_ms=now_ms,
                          horizon_ms=horizon_ms, grace_ms=grace_ms, vouched=vouched,
                          facts=facts)

    return run


@dataclass
class SweepStats:
    marked: int = 0
    marked_bytes: int = 0
    confirmed: int = 0
    confirmed_bytes: int = 0
    failed: int = 0
    refused: int = 0
    skipped_live: int = 0  # the record is live now: the mark diverges from the online state
    skipped_guard: int = 0  # a hold, pause, fail-closed state or ownership check keeps it
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
                     "refused", "skipped_live", "skipped_guard", "skipped_changed",
                     "skipped_retained", "requests"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for what, lst in other.samples.items():
            for text in lst:
                self.sample(what, text)

    def as_dict(self) -> dict[str, Any]:
        return {"marked": self.marked, "marked_bytes": self.marked_bytes,
                "confirmed": self.confirmed, "confirmed_bytes": self.confirmed_bytes,
                "failed": self.failed, "refused": self.refused,
                "skipped_live": self.skipped_live, "skipped_guard": self.skipped_guard,
                "skipped_changed": self.skipped_changed,
                "skipped_retained": self.skipped_retained, "requests": self.requests,
                "samples": self.samples}


def _count_kept(stats: SweepStats, rel: str, why: str) -> None:
    """A guard (hold, pause, fail-closed, ownership) keeping a key is the operator's will, not
    a divergence of the mark from the online state: counted apart, it never gates the sweep."""
    if why in GUARD_REASONS:
        stats.skipped_guard += 1
        stats.sample("skipped_guard", f"{rel}: {why}")
    else:
        stats.skipped_live += 1
        stats.sample("skipped_live", f"{rel}: {why}")


class RetentionMoved(RuntimeError):
    """Branches, tags, commits or policy changed while the sweep ran: it stops."""


class SweepStopped(RuntimeError):
    """The sweep stopped part-way: ``error`` says why, ``stats`` what it did until then, the
    deletes the store confirmed among them (None: not known, the rows could not be read)."""

    def __init__(self, error: str, stats: SweepStats | None) -> None:
        super().__init__(error)
        self.error = error
        self.stats = stats


@dataclass
class PartResult:
    """One task's sweep of one mark part: its counts, and why it stopped (None: it did not)."""

    stats: SweepStats
    error: str | None = None


def outcome_stats(rows: Iterable[tuple[Any, ...]]) -> SweepStats:
    """The counts of outcome rows (``key``, ``size``, ``outcome``, ``error``), as the tasks
    count them while they sweep (``requests`` excepted: no row holds it)."""
    stats = SweepStats()
    counted = (FAILED, REFUSED, SKIPPED_LIVE, SKIPPED_GUARD, SKIPPED_CHANGED)
    for key, size, outcome, error in rows:
        rel, size = str(key), int(size or 0)
        stats.marked += 1
        stats.marked_bytes += size
        if outcome == CONFIRMED:
            stats.confirmed += 1
            stats.confirmed_bytes += size
        elif outcome == SKIPPED_GUARD and error == STOPPED:
            continue  # not sent: the sweep stopped first (no count but ``marked``)
        elif outcome in counted:
            setattr(stats, outcome, getattr(stats, outcome) + 1)
            stats.sample(outcome, f"{rel}: {error}" if error else rel)
    return stats


def _batches(rows: Iterable[tuple[Any, ...]]) -> Iterator[list[tuple[str, str, int, str | None]]]:
    batch: list[tuple[str, str, int, str | None]] = []
    for row in rows:
        batch.append((str(row[0]), str(row[1]), int(row[2] or 0),
                      None if row[3] is None else str(row[3])))
        if len(batch) >= MAX_KEYS_PER_REQUEST:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What one sweep does, from the job to every Spark task: whose mark, under which lease,
    judged at which cutoff, checked against which refs, deleting or only re-checking.

    ``lease_id``: the value the repository's reconciler lease must hold for every batch.
    ``refs``: the :func:`reconciler.state.refs_fingerprint` the mark was re-validated
    against; every batch checks it is unchanged (else it stops: :class:`RetentionMoved`).
    ``report_run_id``: whose report the outcome rows go to (default: ``lease_id``).
    ``delete=False`` only re-checks the mark against the online state (dry run).
    """

    repo: str
    lease_id: str
    ns: Namespace
    cutoff_ms: int
    recheck: bool = True
    delete: bool = True
    refs: str | None = None
    export_vouched: bool = False
    report_run_id: str | None = None
    grace_ms: int = 0  # the repository's grace: bounds a sequenced one by its continuity horizon

    @property
    def outcome_prefix(self) -> str:
        return self.ns.report_prefix(self.report_run_id or self.lease_id) + "sweep/"


def sweep_part(settings: Settings, plan: SweepPlan, mark_key: str,
               out_prefix: str) -> PartResult:
    """Sweep one mark part; each batch's per-key outcomes go to ``<out_prefix>BBBBB.parquet``
    (``BBBBB``: the batch's number in the part) as soon as it is done. Runs inside a task,
    :data:`BATCHES_IN_FLIGHT` batches at a time.

    An error stops the part, not the task: no batch is taken up after it, the batches in
    flight end as they would (each request re-checked right before it), and the counts so
    far come back with it (see the module docstring). ``delete=False`` only re-checks the
    mark against the online state (dry run) and writes nothing.
    """
    ns, delete = plan.ns, plan.delete
    stats = SweepStats()
    r = None
    try:
        s3 = cached_s3(settings)
        # the one deleter, on a client that never retries by itself (it does, re-judging)
        deleter = Deleter.for_settings(settings, cached_s3(settings, retries=False))
        r = redis_sync(settings) if plan.recheck else None
        rows = read_parquet_rows(s3, ns.bucket, mark_key, ["key", "category", "size", "digest"])

        def one(index: int, batch: list[tuple[str, str, int, str | None]]
                ) -> tuple[SweepStats, BaseException | None]:
            part = SweepStats()
            out: dict[str, list[Any]] = {"key": [], "category": [], "size": [],
                                         "outcome": [], "error": []}

            def record(rel: str, cat: str, size: int, outcome: str,
                       error: str | None = None) -> None:
                out["key"].append(rel)
                out["category"].append(cat)
                out["size"].append(size)
                out["outcome"].append(outcome)
                out["error"].append(error)

            failure: BaseException | None = None
            try:
                _sweep_batch(deleter, r, plan, batch, part, record)
            except Exception as exc:
                failure = exc
            if out["key"] and delete:
                try:  # the batch's rows, also when it stopped the sweep
                    put_parquet(s3, ns.bucket, f"{out_prefix}{index:05d}.parquet", out)
                except Exception as exc:
                    failure = failure or exc
            return part, failure

        failure = _in_flight(one, _batches(rows), stats)
    except Exception as exc:
        return PartResult(stats, f"{type(exc).__name__}: {exc}")
    finally:
        if r is not None:
            r.close()
    if failure is not None:
        return PartResult(stats, f"{type(failure).__name__}: {failure}")
    return PartResult(stats)


# Batches one task sweeps at a time: one batch's re-check, confirmation and outcome rows run
# while another's request is at the store (each request still re-checked right before it).
BATCHES_IN_FLIGHT = 2


def _in_flight(one: Callable[[int, Any], tuple[SweepStats, BaseException | None]],
               batches: Iterable[Any], stats: SweepStats) -> BaseException | None:
    """Run ``one(index, batch)`` over ``batches``, :data:`BATCHES_IN_FLIGHT` at a time, their
    counts merged into ``stats``; once a failure is known no batch is taken up. The first
    failure, or None. Every batch taken up is waited for and counted, whatever happens."""
    from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

    failure: BaseException | None = None
    pending: set[Future[tuple[SweepStats, BaseException | None]]] = set()

    def merge(done: Iterable[Future[tuple[SweepStats, BaseException | None]]]) -> None:
        nonlocal failure
        for future in done:
            part, error = future.result()
            stats.merge(part)
            failure = failure or error

    with ThreadPoolExecutor(BATCHES_IN_FLIGHT) as pool:
        try:
            for index, batch in enumerate(batches):
                while len(pending) >= BATCHES_IN_FLIGHT:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    merge(done)
                if failure is not None:
                    break
                pending.add(pool.submit(one, index, batch))
        finally:
            done, pending = wait(pending)
            merge(done)
    return failure


def changed_since_mark(evidence: Evidence, addresses: Mapping[str, str],
                       digests: Mapping[str, str | None]) -> set[str]:
    """The rels whose tracker record (or a state of a token it names) is not the one the
    mark judged, in the records and token states of ``evidence`` (pure): ``digests`` maps
    rel -> the record's digest at the export (None: no record), ``addresses`` rel -> its
    address in ``evidence``."""
    states = {t: token_state(v) for t, v in evidence.token_states.items()}
    return {rel for rel, digest in digests.items()
            if record_digest(evidence.fields.get(addresses[rel]) or None, states) != digest}


def _stop(r: Any, repo: str, lease_id: str, refs: str | None) -> BaseException | None:
    """Why the sweep must stop now (the lease lost, the refs moved), or None: checked at each
    batch's start and again right before each of its requests."""
    holder = r.get(RECONCILER_LEASE + repo)
    if holder != lease_id:
        return RuntimeError(f"reconciler lease lost (held by {holder!r}): sweep stopped")
    if refs is not None and refs_fingerprint(r, repo) != refs:
        # Retention was re-judged for the refs of the sweep's start; they moved since.
        return RetentionMoved("branches, tags, commits or retention changed during the sweep: "
                              "it stopped; sweep again with --sweep-only (the mark is "
                              "re-validated)")
    return None


def _judge_batch(r: Any, plan: SweepPlan, facts: RepoFacts | None, vouched: Container[str],
                 digests: dict[str, str | None]) -> tuple[dict[str, str], set[str]]:
    """(rel -> reason to keep now, rels whose record changed since the mark) of a batch, from
    one read of the evidence: the records judged are the records compared with the mark's.

    Live now, the record included: a reference that came after the mark's snapshot (a copy
    back into a branch) changed it, and only that object is skipped; the same record judged
    live means the mark missed what was there (skipped_live: refused). A key a guard keeps
    is not asked whether it changed."""
    kept, evidence, addresses = _judge_read(
        r, plan.repo, plan.ns, list(digests), cutoff_ms=plan.cutoff_ms,
        now_ms=redis_time_ms(r), horizon_ms=None, grace_ms=plan.grace_ms, vouched=vouched,
        facts=facts)
    changed = changed_since_mark(evidence, addresses, {
        rel: d for rel, d in digests.items() if kept.get(rel) not in GUARD_REASONS})
    return kept, changed


def _sweep_batch(deleter: Deleter, r: Any, plan: SweepPlan,
                 batch: list[tuple[str, str, int, str | None]],
                 stats: SweepStats, record: Callable[..., None]) -> None:
    repo, lease_id, ns = plan.repo, plan.lease_id, plan.ns
    delete, refs, export_vouched = plan.delete, plan.refs, plan.export_vouched
    info = {rel: (cat, size) for rel, cat, size, _ in batch}
    vouched = frozenset(rel for rel, cat, _, _ in batch if cat in VOUCHED_CATEGORIES) \
        if export_vouched else frozenset()
    kept: dict[str, str] = {}
    changed: set[str] = set()
    facts = RepoFacts(r, deleter.client, repo, ns.uri) if r is not None else None
    if r is not None:
        why_stop = _stop(r, repo, lease_id, refs)
        if why_stop is not None:
            raise why_stop
    # Counted once taken up: a batch the sweep stopped at its start was not (no rows).
    stats.marked += len(batch)
    stats.marked_bytes += sum(b[2] for b in batch)
    if r is not None and not delete:
        # Only re-checking (the pre-check pass, a dry run): judged here. A deleting pass is
        # judged by the deleter's re-check right before each request (the same judgment,
        # below), so once, not twice, per request.
        kept, changed = _judge_batch(r, plan, facts, vouched,
                                     {rel: d for rel, _, _, d in batch})
    for rel, why in sorted(kept.items()):
        if rel in changed and why not in GUARD_REASONS:
            continue  # counted below, with the other changed records
        _count_kept(stats, rel, why)
        record(rel, info[rel][0], info[rel][1],
               SKIPPED_GUARD if why in GUARD_REASONS else SKIPPED_LIVE, why)
    live = set(kept)
    for rel in sorted(changed):
        stats.skipped_changed += 1
        stats.sample("skipped_changed", f"{rel}: {kept[rel]}" if rel in kept else rel)
        record(rel, info[rel][0], info[rel][1], SKIPPED_CHANGED, kept.get(rel))
    ok, refused = guard(ns, [rel for rel in info if rel not in live and rel not in changed])
    for rel in refused:
        stats.refused += 1
        stats.sample("refused", rel)
        record(rel, info[rel][0], info[rel][1], REFUSED)
    if not ok or not delete:
        return
    stop: list[BaseException] = []
    digests = {rel: d for rel, _, _, d in batch}

    def recheck(rels: list[str]) -> dict[str, str]:
        """Right before every request, retries included: the lease, the refs, the guards
        and the record judged again, and whether it changed since the mark. A request held
        or throttled may be answered after the refs moved (a branch at an old commit retains
        its data again) or a reference came and went (grace restarts): the retry must see
        it, not only the first request."""
        assert r is not None
        try:
            why_stop = _stop(r, repo, lease_id, refs)
            if why_stop is None:
                keep, moved = _judge_batch(r, plan, facts, vouched,
                                           {rel: digests[rel] for rel in rels})
        except Exception as exc:  # unread evidence stops the part, as it always did
            why_stop = exc
        if why_stop is not None:
            stop.append(why_stop)
            return dict.fromkeys(rels, STOPPED)
        for rel in moved:  # (a live reason too: changed since the mark is what counts)
            keep[rel] = CHANGED_AFTER_MARK
        return keep

    def address_recheck(addresses: list[str]) -> dict[str, str]:
        by_rel = {a[len(ns.uri):]: a for a in addresses}
        return {by_rel[rel]: why for rel, why in recheck(list(by_rel)).items()}

    res = deleter.delete(Plan(ns.uri, recheck=None if r is None else address_recheck,
                              retry=RetryPolicy(attempts=5, base_delay=0.1)),
                         [f"s3://{ns.bucket}/{key}" for key in ok])  # (ok: bucket keys)
    stats.requests += res.requests
    for address, why in res.kept.items():  # kept by the re-check right before the request
        rel = address[len(ns.uri):]
        if why == CHANGED_AFTER_MARK:
            stats.skipped_changed += 1
            stats.sample("skipped_changed", f"{rel}: {why}")
            record(rel, info[rel][0], info[rel][1], SKIPPED_CHANGED, why)
        elif why == STOPPED:
            record(rel, info[rel][0], info[rel][1], SKIPPED_GUARD, why)
        else:
            _count_kept(stats, rel, why)
            record(rel, info[rel][0], info[rel][1],
                   SKIPPED_GUARD if why in GUARD_REASONS else SKIPPED_LIVE, why)
    for address in res.refused:
        rel = address[len(ns.uri):]
        stats.refused += 1
        stats.sample("refused", rel)
        record(rel, info.get(rel, ("", 0))[0], info.get(rel, ("", 0))[1], REFUSED)
    for address in res.deleted:
        rel = address[len(ns.uri):]
        stats.confirmed += 1
        stats.confirmed_bytes += info[rel][1]
        record(rel, info[rel][0], info[rel][1], CONFIRMED)
    for address, err in res.failed.items():
        rel = address[len(ns.uri):]
        stats.failed += 1
        stats.sample("failed", f"{rel}: {err}")
        record(rel, info[rel][0], info[rel][1], FAILED, err)
    if stop:
        raise stop[0]  # as the next batch's start would


def sweep(spark: Any, settings: Settings, plan: SweepPlan, mark_parts: list[str]) -> SweepStats:
    """Sweep every mark part in parallel Spark tasks (each given the one typed ``plan``); the
    merged stats come back. Outcomes go to the plan's report, as
    ``sweep/part-<mark part>-<this sweep>-<batch>.parquet``. A sweep that stops part-way
    raises :class:`SweepStopped` with what it did until then.
    """
    ns, delete = plan.ns, plan.delete
    total = SweepStats()
    if not mark_parts:
        return total
    prefix = plan.outcome_prefix
    # This sweep's rows apart from an earlier sweep's of the same run (``--sweep-only``).
    token = uuid.uuid4().hex[:6]
    items = [(k, f"{prefix}part-{i:05d}-{token}-") for i, k in enumerate(mark_parts)]

    def run(it: Iterator[tuple[str, str]]) -> Iterator[PartResult]:
        for mark_key, out_prefix in it:
            yield sweep_part(settings, plan, mark_key, out_prefix)

    parts = spark.sparkContext.parallelize(items, max(1, min(len(items), 64))).mapPartitions(run)
    try:
        results = parts.collect()
    except Exception as exc:
        # A task died (its worker lost, Spark gave up on it) and its counts with it; the rows
        # every task wrote, batch by batch, say what the store confirmed.
        error = f"{type(exc).__name__}: {exc}"
        if not delete:
            raise SweepStopped(error, None) from exc
        try:
            stats = written_outcomes(settings, ns, prefix, token)
        except Exception as unread:
            raise SweepStopped(f"{error}; its outcome rows could not be read back "
                               f"({type(unread).__name__}: {unread})", None) from exc
        raise SweepStopped(error, stats) from exc
    for res in results:
        total.merge(res.stats)
    stopped = [res.error for res in results if res.error is not None]
    if stopped:
        raise SweepStopped(stopped[0], total)
    return total


def written_outcomes(settings: Settings, ns: Namespace, prefix: str, token: str) -> SweepStats:
    """The counts of the outcome rows one sweep (``token``) wrote under ``prefix``."""
    s3 = cached_s3(settings)
    keys = [k for k in list_keys(s3, ns.bucket, prefix)
            if k.rsplit("/", 1)[-1].startswith("part-") and f"-{token}-" in k
            and k.endswith(".parquet")]
    return outcome_stats(row for k in keys for row in read_parquet_rows(
        s3, ns.bucket, k, ["key", "size", "outcome", "error"]))
