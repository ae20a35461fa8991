"""The reconciler's reads of the tracker's Redis state, its export, and the run lease.

Everything here runs on the driver and stays memory-flat in the number of addresses: the export
SCANs the address hashes in batches (pipelined HGETALL) and writes Parquet chunks to the
namespace, never holding more than one chunk. The commit graph, branches, tags, staging-token
states and claims are metadata (small) and are read whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from reconciler.errors import LeaseBusy, ReconcileError
from reconciler.records import token_state, verdict
from reconciler.retention import RetentionPolicy
from reconciler.s3io import Namespace, put_parquet
from schemas.address import address_forms, canonical_namespace
from schemas.layout import (
    NAMESPACES,
    RECONCILER_LEASE,
    REF_ADD,
    REPOS,
    RETIRED,
    OutsideNamespace,
    RepoKeys,
)
from schemas.records import (
    CommitRecord,
    RecordError,
    RepoMeta,
    decode_branch,
    decode_commit,
    decode_meta,
)


def tracker_watermark_ms(r: Any) -> int | None:
    """Up to when (ms) the tracker has applied everything the broker held, over all partitions
    (the tracker's own definition); None when unknown."""
    from core.clock import tracker_horizon_ms

    value: int | None = tracker_horizon_ms(r)
    return value


def _escape_glob(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def commit_time_seconds(t: float) -> float:
    """Commit times are epoch seconds; a value that can only be milliseconds is converted."""
    return t / 1000.0 if t > 1e11 else t


@dataclass
class CommittedState:
    """A repository's committed metadata as the tracker recorded it."""

    repo: str
    namespace: Namespace
    default_branch: str | None
    policy: RetentionPolicy
    expire_older_than_days: float | None
    commits: dict[str, CommitRecord]
    branch_heads: dict[str, str]
    tags: dict[str, str]
    staging_tokens: set[str] = field(default_factory=set)
    # A digest of every retention input as read (repository meta, commits, branches, tags):
    # the sweep compares it with the mark's to know whether retention must be judged again.
    fingerprint: str = ""


def _meta(raw: dict[str, str], repo: str) -> RepoMeta:
    try:
        meta = decode_meta(raw, repo)
    except RecordError as exc:
        raise ReconcileError(str(exc)) from None
    if meta is None:
        raise ReconcileError(f"repository {repo!r} is unknown to the tracker "
                             f"(no {RepoKeys(repo).meta})")
    return meta


def _namespace(meta: RepoMeta) -> Namespace:
    try:
        return Namespace(meta.namespace)
    except ValueError as exc:
        raise ReconcileError(str(exc)) from None


def load_namespace(r: Any, repo: str) -> Namespace:
    return _namespace(_meta(r.hgetall(RepoKeys(repo).meta), repo))


def load_repo(r: Any, repo: str) -> CommittedState:
    """Read the repository's metadata, commit graph, branches and tags; raise if garbled."""
    keys = RepoKeys(repo)
    # One transaction: the fingerprint and the state are of the same moment.
    pipe = r.pipeline(transaction=True)
    for name in (keys.meta, keys.commits, keys.branches, keys.tags):
        pipe.hgetall(name)
    raw_meta, raw_commits, raw_branches, raw_tags = (x or {} for x in pipe.execute())
    meta = _meta(raw_meta, repo)
    namespace = _namespace(meta)
    fingerprint = retention_fingerprint(raw_meta, raw_commits, raw_branches, raw_tags)
    # No retention configured: keep everything (doubt keeps).
    default_days = math.inf if meta.default_retention_days is None else meta.default_retention_days
    try:
        policy = RetentionPolicy(default_days, meta.branch_retention_days)
    except ValueError as exc:
        raise ReconcileError(str(exc)) from None

    # The tracker's records through the one codec (schemas.records); a garbled one fails the
    # run, naming it.
    commits: dict[str, CommitRecord] = {}
    heads: dict[str, str] = {}
    staging: set[str] = set()
    try:
        for cid, raw in raw_commits.items():
            c = decode_commit(raw, cid)
            commits[cid] = replace(c, time=commit_time_seconds(c.time))
        for branch, raw in raw_branches.items():
            b = decode_branch(raw, branch)
            if b.head:
                heads[branch] = b.head
            if b.staging_token:
                staging.add(b.staging_token)
            staging.update(b.sealed_tokens)
    except RecordError as exc:
        raise ReconcileError(str(exc)) from None
    tags = {str(k): str(v) for k, v in raw_tags.items()}
    return CommittedState(repo, namespace, meta.default_branch or None, policy,
                          meta.expire_older_than_days, commits, heads, tags, staging, fingerprint)


def retention_fingerprint(*hashes: dict[str, str]) -> str:
    """A digest of raw Redis hashes (order-independent within each hash)."""
    h = hashlib.blake2b(digest_size=16)
    for one in hashes:
        h.update(orjson.dumps(sorted(one.items())))
        h.update(b"\x00")
    return h.hexdigest()


def refs_fingerprint(r: Any, repo: str) -> str:
    """A cheap digest of what moves when retention may change (repository meta, branches,
    tags, number of commits): read before every sweep batch. A new branch, tag or commit, a
    moved head or a new policy changes it; the commit records themselves are not re-read."""
    keys = RepoKeys(repo)
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(keys.meta)
    pipe.hgetall(keys.branches)
    pipe.hgetall(keys.tags)
    pipe.hlen(keys.commits)
    meta, branches, tags, n = pipe.execute()
    return retention_fingerprint(meta or {}, branches or {}, tags or {}, {"n": str(n)})


def record_digest(fields: Mapping[str, str] | None,
                  token_states: dict[str, str | None]) -> str | None:
    """A digest of an address record and of the states of the tokens its references name.

    The mark stores it per marked key; the sweep recomputes it right before the delete: a
    record that changed since the mark (a new reference, a commit that took it, a token that
    moved, a restarted grace window) is kept and judged again by the next mark. None: no record.
    """
    if not fields:
        return None
    tokens = sorted({v for k, v in fields.items() if k.startswith(REF_ADD)})
    h = hashlib.blake2b(digest_size=12)
    h.update(orjson.dumps(sorted(fields.items())))
    h.update(orjson.dumps([(t, token_states.get(t)) for t in tokens]))
    return h.hexdigest()


def retired_problem(r: Any, repo: str, namespace: Namespace) -> str | None:
    """Why ``repo`` is not a live repository that owns its namespace, or None."""
    if r.hexists(RETIRED, repo):
        return f"repository {repo!r} is retired ({RETIRED}): the reconciler never runs for it"
    if not r.sismember(REPOS, repo):
        return f"repository {repo!r} is not a live repository (not in {REPOS})"
    registry = r.hgetall(NAMESPACES) or {}
    if registry:
        try:
            ns = canonical_namespace(namespace.uri)
        except OutsideNamespace as exc:
            return str(exc)
        owner = registry.get(ns)
        if owner != repo:
            return (f"namespace {ns} is not registered to repository {repo!r} in {NAMESPACES} "
                    f"(owner: {owner!r}): retired or unknown, refused")
    return None


# ------------------------------------------------------------------------------ export

EXPORT_COLUMNS = ("key", "live", "kind", "reason", "commit", "digest")


@dataclass
class ExportResult:
    parts: list[str]  # bucket keys of the Parquet chunks
    addresses: int = 0
    live: int = 0
    outside: int = 0
    extra_forms: int = 0  # rows for another form of an address (non-canonical or with %)
    rows: int = 0  # rows written to the parts (each form of each address)
    by_reason: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"parts": len(self.parts), "addresses": self.addresses, "live": self.live,
                "outside_namespace": self.outside, "extra_forms": self.extra_forms,
                "rows": self.rows,
                "live_by_reason": self.by_reason,
                "by_kind": self.by_kind}


def scan_addresses(r: Any, repo: str, batch: int = 1000) -> Iterator[list[tuple[str, dict[str,
                                                                                          str]]]]:
    """(address, hash) in batches: SCAN the address keys, HGETALL them in one pipeline."""
    keys = RepoKeys(repo)
    prefix = keys.address_prefix
    pattern = _escape_glob(prefix) + "*"
    pending: list[str] = []

    def flush(names: list[str]) -> list[tuple[str, dict[str, str]]]:
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        values = pipe.execute()
        return [(n[len(prefix):], v or {}) for n, v in zip(names, values, strict=True) if v]

    for name in r.scan_iter(match=pattern, count=batch):
        pending.append(name)
        if len(pending) >= batch:
            yield flush(pending)
            pending = []
    if pending:
        yield flush(pending)


def load_token_states(r: Any, repo: str) -> dict[str, str | None]:
    return {t: token_state(v) for t, v in r.hscan_iter(RepoKeys(repo).tokens, count=1000)}


def load_claims(r: Any, repo: str) -> set[str]:
    return {m for m, _ in r.zscan_iter(RepoKeys(repo).claims, count=1000)}


def export_addresses(r: Any, s3: Any, repo: str, namespace: Namespace, dest_prefix: str, *,
                     cutoff_ms: int, now_ms: int,
                     commit_ids: set[str], chunk_rows: int = 200_000,
                     grace_ms: int | None = None, horizon_ms: int | None = None,
                     progress: Any = None) -> ExportResult:
    """Write every address record of ``repo`` with its verdict to Parquet chunks.

    ``dest_prefix`` is a bucket key prefix (``.../uncommitted/``). Raises on any Redis or S3
    error: the caller must then fail the run.
    """
    import pyarrow as pa

    schema = pa.schema([("key", pa.string()), ("live", pa.bool_()), ("kind", pa.string()),
                        ("reason", pa.string()), ("commit", pa.string()),
                        ("digest", pa.string())])
    token_states = load_token_states(r, repo)
    claims = load_claims(r, repo)
    result = ExportResult(parts=[])
    cols: dict[str, list[Any]] = {c: [] for c in EXPORT_COLUMNS}
    frozen_ids = frozenset(commit_ids)

    def write() -> None:
        key = f"{dest_prefix}part-{len(result.parts):05d}.parquet"
        put_parquet(s3, namespace.bucket, key, cols, schema)
        result.parts.append(key)
        for c in cols.values():
            c.clear()

    for batch in scan_addresses(r, repo):
        for address, fields in batch:
            try:
                forms = address_forms(namespace.uri, address)
            except OutsideNamespace:
                result.outside += 1
                continue
            v = verdict(fields, token_states=token_states, cutoff_ms=cutoff_ms, now_ms=now_ms,
                        claimed=address in claims,
                        commit_ids=frozen_ids, grace_ms=grace_ms or 0, horizon_ms=horizon_ms)
            digest = record_digest(fields, token_states)
            result.addresses += 1
            result.by_kind[v.kind] = result.by_kind.get(v.kind, 0) + 1
            if v.live:
                result.live += 1
                result.by_reason[v.reason] = result.by_reason.get(v.reason, 0) + 1
            result.extra_forms += sum(1 for form in forms if form != address)
            result.rows += len(forms)
            for form in forms:
                # A non-canonical or ambiguous (``%``) record protects each form it may name;
                # only the tracker's own key form may be marked (the sweep re-reads that key).
                cols["key"].append(form[len(namespace.uri):])
                cols["live"].append(v.live or form != address)
                cols["kind"].append(v.kind)
                cols["reason"].append(v.reason if form == address or v.live else "doubt")
                cols["commit"].append(v.commit)
                cols["digest"].append(digest)
        if len(cols["key"]) >= chunk_rows:
            write()
        if progress is not None:
            progress(result.addresses)
    if cols["key"] or not result.parts:
        write()  # always at least one (possibly empty) part: the export is complete
    return result


# ------------------------------------------------------------------------------- lease

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    """One reconciler per repository: ``SET NX PX`` with the run id, renewed in a thread."""

    def __init__(self, r: Any, repo: str, run_id: str, ttl_ms: int = 60_000) -> None:
        self.r = r
        self.key = RECONCILER_LEASE + repo
        self.run_id = run_id
        self.ttl_ms = ttl_ms
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        if not self.r.set(self.key, self.run_id, nx=True, px=self.ttl_ms):
            holder = self.r.get(self.key)
            raise LeaseBusy(f"another reconciler (run {holder}) holds {self.key}; "
                            "try again when it finishes")
        self._thread = threading.Thread(target=self._renew_loop, name="reconciler-lease",
                                        daemon=True)
        self._thread.start()

    def renew(self) -> bool:
        ok = bool(self.r.eval(_RENEW, 1, self.key, self.run_id, self.ttl_ms))
        if not ok:
            self.lost.set()
        return ok

    def held(self) -> bool:
        return not self.lost.is_set() and self.r.get(self.key) == self.run_id

    def _renew_loop(self) -> None:
        interval = self.ttl_ms / 3000.0
        while not self._stop.wait(interval):
            try:
                if not self.renew():
                    return
            except Exception:  # Redis blip: try again; the lease expires if it persists
                if self._stop.wait(min(interval, 1.0)):
                    return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):  # else it expires on its own
            self.r.eval(_RELEASE, 1, self.key, self.run_id)

    def check(self) -> None:
        if not self.held():
            raise ReconcileError(f"lost the reconciler lease {self.key}")
