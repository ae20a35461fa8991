"""Rebuild a fail-closed repository's mirror from the service's export of its whole state.

A repository is fail-closed when the tracker cannot prove its mirror complete (a lost log, a
Redis that went back past what the log still holds): events may be missing, so nothing of it
is deleted. Clearing the flag alone would trust the mirror as it is. The rebuild instead
makes the mirror agree with the service again, in three steps (schemas/README.md, "Rebuild"):

1. **prepare** snapshots the mirror: every live reference (address, ref id, token), the
   open, sealed and unknown tokens, the branches and tags with their ref versions. Only then
   is a random nonce written beside it (``RepoKeys.rebuild``), with the flag's loss counter.
2. **The service exports its whole state** (format 2, :class:`StateExport`) *after* reading
   the nonce, and names it in the export. The nonce is the proof of order, on no clock: every
   reference in the snapshot was applied before the nonce existed, so its event had been
   published, so its effect was in the service before the export began. A snapshot reference
   the export does not list was therefore removed at the service before the export (its
   removal event may be lost). A reference applied after the snapshot is not in it, and the
   rebuild never removes it.
3. **apply** (one plan, :func:`plan`, a pure function) removes those references, drops the
   snapshot tokens the export no longer lists open or sealed (committed or dropped at the
   service) with their references that no commit lists, marks committed every address of
   every exported commit (from its manifest: a commit lost with the log keeps its data, and so
   does a write lost with the log into a commit the mirror applied), and adds everything the
   export lists
   (references, tokens, commits, newer branches and tags, issued uploads). Adding commutes
   with the events still arriving; ranks and ref versions only move forward. The chunks go
   through ``apply.lua`` (op 13, never carried by an event), each guarded by the nonce, the
   flag's loss counter and, after the first, this run's id and count: a new prepare, a new
   loss, another run's chunks or a slot that went back between chunks make it stale.
   The last chunk lifts the flag and records a ``rebuilt`` incident with the counts.

Every address the rebuild leaves unreferenced starts its grace at the rebuild (the Redis
clock of its chunk). A repository whose service gives no export stays fail-closed; ``status``
says what it needs.
"""

from __future__ import annotations

import io
import secrets
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from core.clock import redis_time_ms
from core.gate import applied_regression
from core.registry import conflict_standing, repo_lifecycle, repo_namespace
from schemas.address import canonical_address
from schemas.layout import (
    APPLIED,
    FAIL_CLOSED,
    LIVE_TOKEN_STATES,
    OutsideNamespace,
    RepoKeys,
    TokenState,
)
from schemas.records import BranchRecord, CommitRecord, encode_branch, encode_commit
from tracker.references import RepoState
from tracker.state import ApplyScript, read_repo_state

STATE_EXPORT = "state.json"  # the export's one file (format 2)
FORMAT = 2
CHUNK = 2_000  # ops per apply.lua call


class RebuildError(Exception):
    """The rebuild cannot go on (one line: what is wrong); nothing was lifted."""


# --- the snapshot ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """The mirror at prepare time: what the export may prove removed."""

    refs: frozenset[tuple[str, str, str]]  # (address, ref id, token): live at the snapshot
    tokens: dict[str, str]  # token -> state: open, sealed or "unknown"
    branches: dict[str, int]  # branch -> ref version at the snapshot (-1: none recorded)
    tags: dict[str, int]
    # Commits the mirror knew at the snapshot. "Unknown" is judged against these, never
    # against the mirror at apply time: a retried rebuild (one that stopped between chunks)
    # finds the commit records it wrote itself, and must still mark their manifests.
    commits: frozenset[str] = frozenset()
    # Tokens the mirror already knew committed or dropped: the export's ended tokens other
    # than these are the ones it never learned.
    ended: frozenset[str] = frozenset()

    def to_json(self) -> bytes:
        return orjson.dumps({"refs": sorted(self.refs), "tokens": self.tokens,
                             "branches": self.branches, "tags": self.tags,
                             "commits": sorted(self.commits), "ended": sorted(self.ended)})

    @classmethod
    def from_json(cls, raw: bytes | str) -> Snapshot:
        d = orjson.loads(raw)
        return cls(frozenset(tuple(x) for x in d["refs"]), d["tokens"], d["branches"],
                   d["tags"], frozenset(d["commits"]), frozenset(d.get("ended", ())))


def snapshot_of(state: RepoState) -> Snapshot:
    """The live references of a repository's state (a token the mirror never saw counts as
    live, as everywhere), its live tokens, and its refs' versions. Pure."""
    def live(token: str) -> bool:
        s = state.token_state(token)
        return s is None or s in LIVE_TOKEN_STATES

    refs = frozenset((a, ref, tok) for a, rec in state.addresses.items()
                     for ref, tok in rec.adds.items() if ref not in rec.removes and live(tok))
    tokens = {t: s.value for t, (s, _) in state.tokens.items() if s in LIVE_TOKEN_STATES}
    tokens.update({tok: "unknown" for _, _, tok in refs if state.token_state(tok) is None})
    return Snapshot(refs, tokens,
                    {b: state.ref_versions.get(f"b:{b}", -1) for b in state.branches},
                    {t: state.ref_versions.get(f"t:{t}", -1) for t in state.tags},
                    frozenset(state.commits),
                    frozenset(t for t, (s, _) in state.tokens.items()
                              if s not in LIVE_TOKEN_STATES))


@dataclass(frozen=True)
class Prepared:
    repository: str
    nonce: str
    at_ms: int
    losses: str
    refs: int

    def as_dict(self) -> dict[str, Any]:
        return {"repository": self.repository, "nonce": self.nonce, "at_ms": self.at_ms,
                "losses": self.losses, "snapshot_refs": self.refs}


MARKER = "_hardelete/rebuild/nonce"  # in the namespace: the current prepare, out of Redis


def _marker(namespace: str) -> tuple[str, str]:
    bucket, _, prefix = namespace[5:].partition("/")
    return bucket, prefix + MARKER


def _read_marker(s3: Any, namespace: str) -> str | None:
    bucket, key = _marker(namespace)
    try:
        return str(s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode())
    except Exception as exc:
        if "NoSuchKey" in str(exc) or "404" in str(exc):
            return None
        raise RebuildError(f"the rebuild marker s3://{bucket}/{key} cannot be read "
                           f"({type(exc).__name__}: {exc})") from None


def _write_marker(s3: Any, namespace: str, value: str) -> None:
    bucket, key = _marker(namespace)
    s3.put_object(Bucket=bucket, Key=key, Body=value.encode())


def prepare(r: Any, s3: Any, repo: str) -> Prepared:
    """Snapshot the mirror of a fail-closed ``repo`` and mint the nonce its service's export
    must carry (a new prepare makes every earlier nonce stale).

    The nonce is also written to the namespace (``_hardelete/rebuild/nonce``), which does not
    go back with Redis: a Redis (or a cluster node) restored from an older copy brings back an
    older prepare, whose export must not lift the flag over a loss it predates, nor lift it a
    second time (found by an adversarial review); a rebuild requires both to agree."""
    k = RepoKeys(repo)
    losses = _flag_losses(r, repo)
    namespace = repo_namespace(r, repo)
    if not namespace:
        raise RebuildError(f"{repo}: the mirror has no namespace for it (repository unknown)")
    r.delete(k.rebuild)  # an earlier nonce is stale from here on
    state = read_repo_state(r, repo)
    snap = snapshot_of(state)
    if _flag_losses(r, repo) != losses:
        raise RebuildError(f"{repo}: the log was lost again while the snapshot was read; "
                           "prepare again")
    nonce = secrets.token_hex(16)
    now = redis_time_ms(r)
    # What each stripe had applied before the nonce exists: those events were committed
    # before the service read the nonce, so an export of that incarnation counting fewer
    # comes from a store that lags (found by an adversarial review).
    applied = _applied(r, repo)
    _write_marker(s3, namespace, nonce)
    r.set(k.rebuild_snapshot, snap.to_json())
    # Written last: a nonce exists only once its snapshot is complete.
    r.hset(k.rebuild, mapping={"nonce": nonce, "at_ms": str(now), "losses": losses,
                               "applied": orjson.dumps(applied).decode()})
    return Prepared(repo, nonce, now, losses, len(snap.refs))


def pending(r: Any, repo: str) -> dict[str, str]:
    """The prepared rebuild of ``repo`` (nonce, at_ms, losses), or {}."""
    return dict(r.hgetall(RepoKeys(repo).rebuild) or {})


def broken_stripes(r: Any, repo: str) -> dict[int, str]:
    """The broken stripes of a sequenced repository (stripe -> reason); {} for any other."""
    from core.continuity_store import ContinuityStore

    stripes = sequenced_stripes(r, repo)
    if not stripes:
        return {}
    store = ContinuityStore(r)
    out = {}
    for k in range(stripes):
        reason = store.read(repo, k).broken
        if reason is not None:
            out[k] = reason
    return out


def _applied(r: Any, repo: str) -> list[list[Any]]:
    """Per stripe of a sequenced repository: [its incarnation or None, its highest seq
    applied]."""
    from core.continuity_store import ContinuityStore

    store = ContinuityStore(r)
    out: list[list[Any]] = []
    for k in range(sequenced_stripes(r, repo)):
        d = store.read(repo, k)
        out.append([d.incarnation, d.applied_max])
    return out


def continuity_problem(export: ExportContinuity, stripes: list[Any],
                       applied: list[list[Any]]) -> str | None:
    """Why this export cannot start the repository's stripes again (``stripes``: their
    ``core.continuity.Domain`` now; ``applied``: what each had applied at the prepare), or
    None. Pure."""
    for k, d in enumerate(stripes):
        if d.incarnation is not None and d.incarnation != export.incarnation:
            # The rebuild adds the export's state; it cannot undo what the old incarnation
            # applied that the restore took back (a removal, a token's end): refused, the
            # stripe stays broken (found by an adversarial review).
            return (f"stripe {k} is of incarnation {d.incarnation!r}, the export of "
                    f"{export.incarnation!r}: a rebuild across a restore of the service's "
                    "store is not supported (it could not undo what the old incarnation "
                    "removed); the repository stays stopped")
        if k < len(applied) and applied[k][0] == export.incarnation \
                and export.seqs[k] < int(applied[k][1]):
            return (f"stripe {k}: the export counts seq {export.seqs[k]}, but seq "
                    f"{applied[k][1]} was applied before the prepare: the export comes from a "
                    "store that lags (read it from the primary)")
        kept = export.breaks[k] if k < len(export.breaks) else None
        if d.broken is not None and (kept is None or kept < d.epoch):
            # A break the service does not keep would be lost for good with a slot that goes
            # back once the rebuild lifted it (found by an adversarial review).
            return (f"stripe {k} is broken ({d.broken}) and the service does not keep that "
                    "break yet: export again once its relay has recorded it")
    return None


def sequenced_stripes(r: Any, repo: str) -> int:
    """The declared stripes of a sequenced repository; 0 for a repository without seqs."""
    seqd, stripes = r.hmget(RepoKeys(repo).meta, ["sequenced", "stripes"])
    return int(stripes or 1) if seqd in ("1", b"1") else 0


def _flag_losses(r: Any, repo: str) -> str:
    """The fail-closed flag's loss counter ("" for a repository rebuilt because a stripe of
    its continuity broke); RebuildError when there is nothing to rebuild."""
    if r.exists(FAIL_CLOSED):
        raise RebuildError("every repository is fail-closed (hd:failclosed: Redis lost its "
                           "whole state); a rebuild lifts one repository's flag, not that one")
    flag = r.hgetall(RepoKeys(repo).fail_closed)
    if not flag and not broken_stripes(r, repo):
        raise RebuildError(f"{repo} is neither fail-closed nor broken: nothing to rebuild")
    conflict = conflict_standing(r, repo)
    if conflict is not None:  # a rebuild lifts the flag; the overlap would still stand
        raise RebuildError(f"{repo}: {conflict.reason().split('; ')[0]}: a rebuild does not "
                           "resolve it (schemas/README.md, Registry conflicts)")
    return str(flag.get("losses", "")) if flag else ""


# --- the export (format 2) ---------------------------------------------------------------------


@dataclass(frozen=True)
class ExportEntry:
    address: str
    ref_id: str
    size: int


@dataclass(frozen=True)
class ExportContinuity:
    """A sequenced repository's counters, read in the same transaction of the service's store
    as the state it exports: every event of stripe k with seq <= ``seqs[k]`` is in it; and
    the breaks its outbox keeps (per stripe: the tracker's epoch of the kept break, or None)."""

    incarnation: str
    seqs: tuple[int, ...]
    breaks: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, counters: Any) -> ExportContinuity:
        """From ``schemas.outbox.Counters`` (one read of the outbox)."""
        epochs = counters.broken_epochs or (0,) * counters.stripes
        return cls(counters.incarnation, tuple(counters.seqs),
                   tuple(None if why is None else epochs[k]
                         for k, why in enumerate(counters.broken or (None,) * counters.stripes)))


@dataclass(frozen=True)
class StateExport:
    """The service's whole state of one repository (lakeFS: its refs and commit log, plus
    ``PrepareGCUncommitted``'s staged entries, ref ids included)."""

    repository: str
    exported_at_ms: int
    nonce: str
    # The mirror's own records (schemas/records.py), each ref with the version the service
    # gave its last change.
    branches: dict[str, tuple[BranchRecord, int]]  # branch -> (record, ref version)
    tags: dict[str, tuple[str, int]]  # tag -> (commit id, ref version)
    tokens: dict[str, tuple[str, tuple[ExportEntry, ...]]]  # open/sealed -> (state, entries)
    commits: dict[str, CommitRecord]  # id -> record
    issued: dict[str, int]  # unexpired issued upload address -> expires_at (ms)
    location: str = ""
    # Staging tokens the service committed or dropped (token -> state). Optional: a token the
    # mirror never learned (its creation lost with the log) is then judged by what the service
    # says when a reference to it arrives late, not kept as "unknown, so live" for ever.
    ended: dict[str, str] = field(default_factory=dict)
    # The version the service gave the deletion of each branch and tag that no longer exists.
    # Optional: an older event of such a ref delivered after the rebuild (a replayed dead
    # letter) is then stale, and cannot bring the ref back with the commits it retains.
    deleted_branches: dict[str, int] = field(default_factory=dict)
    deleted_tags: dict[str, int] = field(default_factory=dict)
    # A sequenced repository's counters (required to rebuild one: schemas/README.md,
    # "Continuity"); None for a service without seqs.
    continuity: ExportContinuity | None = None

    def to_json(self) -> bytes:
        extra: dict[str, Any] = {}
        if self.continuity is not None:
            extra["continuity"] = {"incarnation": self.continuity.incarnation,
                                   "seqs": list(self.continuity.seqs),
                                   "breaks": list(self.continuity.breaks)
                                   or [None] * len(self.continuity.seqs)}
        return orjson.dumps({**extra,
            "format": FORMAT, "repository": self.repository,
            "exported_at": self.exported_at_ms, "rebuild_nonce": self.nonce,
            "branches": {b: {"head": v.head, "staging_token": v.staging_token,
                             "sealed_tokens": list(v.sealed_tokens),
                             "ref_version": ver} for b, (v, ver) in self.branches.items()},
            "tags": {t: {"commit": c, "ref_version": v} for t, (c, v) in self.tags.items()},
            "tokens": {t: {"state": s, "entries": [
                {"address": e.address, "ref_id": e.ref_id, "size": e.size} for e in es]}
                for t, (s, es) in self.tokens.items()},
            "commits": [{"id": cid, "branch": c.branch, "parents": list(c.parents),
                         "committed_at": c.time, "manifest": c.manifest}
                        for cid, c in self.commits.items()],
            "issued": [{"address": a, "expires_at": t} for a, t in self.issued.items()],
            "ended_tokens": self.ended,
            "deleted_branches": self.deleted_branches, "deleted_tags": self.deleted_tags,
        })


def parse_export(raw: bytes, namespace: str, repo: str, where: str) -> StateExport:
    """Read and check a format-2 export; any problem raises :class:`RebuildError` naming it.
    Addresses are put in the namespace's canonical form (a row outside it is an error: it
    could protect nothing)."""
    def fail(what: str) -> RebuildError:
        return RebuildError(f"state export {where}: {what}")

    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise fail(f"not JSON ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise fail(f"not a format-{FORMAT} state export (format "
                   f"{d.get('format') if isinstance(d, dict) else None!r})")
    if d.get("repository") != repo:
        raise fail(f"is for repository {d.get('repository')!r}, not {repo!r}")

    def version(raw: Any, what: str) -> int:
        # A ref version is compared in the apply script and written back as JSON: an integer
        # Lua and JSON both hold exactly, never a bool, a float or a string.
        if type(raw) is not int or not 0 <= raw <= 2 ** 53:
            raise fail(f"{what}: ref version {raw!r} is not an integer from 0 to 2^53")
        return raw

    def addr(raw_address: Any) -> str:
        try:
            return canonical_address(namespace, raw_address)
        except OutsideNamespace as exc:
            raise fail(str(exc)) from None

    try:
        branches = {str(b): (BranchRecord(None if v["head"] is None else str(v["head"]),
                                          str(v["staging_token"]),
                                          tuple(map(str, v.get("sealed_tokens") or ()))),
                             version(v["ref_version"], f"branch {b!r}"))
                    for b, v in d["branches"].items()}
        tags = {str(t): (str(v["commit"]), version(v["ref_version"], f"tag {t!r}"))
                for t, v in d["tags"].items()}
        tokens: dict[str, tuple[str, tuple[ExportEntry, ...]]] = {}
        for t, v in d["tokens"].items():
            if v["state"] not in (TokenState.OPEN, TokenState.SEALED):
                raise fail(f"token {t!r} has state {v['state']!r} (open or sealed only)")
            tokens[str(t)] = (str(v["state"]), tuple(
                ExportEntry(addr(e["address"]), str(e["ref_id"]), int(e["size"]))
                for e in v["entries"]))
        commits = {str(c["id"]): CommitRecord(tuple(map(str, c["parents"])),
                                              float(c["committed_at"]), str(c["branch"]),
                                              addr(c["manifest"]))
                   for c in d["commits"]}
        issued = {addr(i["address"]): int(i["expires_at"]) for i in d["issued"]}
        ended: dict[str, str] = {}
        for t, state in (d.get("ended_tokens") or {}).items():
            if state not in (TokenState.COMMITTED, TokenState.DROPPED):
                raise fail(f"ended token {t!r} has state {state!r} (committed or dropped only)")
            if str(t) in tokens:
                raise fail(f"token {t!r} is listed both open or sealed and ended")
            ended[str(t)] = str(state)
        deleted: dict[str, dict[str, int]] = {}
        for what, live in (("branches", branches), ("tags", tags)):
            kind = {"branches": "branch", "tags": "tag"}[what]
            deleted[what] = {str(n): version(v, f"deleted {kind} {n!r}")
                             for n, v in (d.get(f"deleted_{what}") or {}).items()}
            both = sorted(set(deleted[what]) & set(live))
            if both:
                raise fail(f"{what} {both[:3]} are listed both live and deleted")
        exported_at = int(d["exported_at"])
        nonce = str(d["rebuild_nonce"])
        continuity = None
        if d.get("continuity") is not None:
            c = d["continuity"]
            inc, seqs = c["incarnation"], c["seqs"]
            if type(inc) is not str or not inc or len(inc) > 128:
                raise fail(f"continuity: incarnation {inc!r} is not a string of 1 to 128 "
                           "characters")
            if type(seqs) is not list or not 1 <= len(seqs) <= 64 or any(
                    type(s) is not int or not 0 <= s <= 2 ** 53 - 1 for s in seqs):
                raise fail(f"continuity: seqs {seqs!r} is not a list of 1 to 64 integers "
                           "from 0 to 2^53-1")
            breaks = c.get("breaks") or [None] * len(seqs)
            if type(breaks) is not list or len(breaks) != len(seqs) or any(
                    b is not None and (type(b) is not int or not 0 <= b <= 2 ** 53 - 1)
                    for b in breaks):
                raise fail(f"continuity: breaks {breaks!r} is not one epoch (or null) per "
                           "stripe")
            continuity = ExportContinuity(inc, tuple(seqs), tuple(breaks))
    except RebuildError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise fail(f"malformed ({type(exc).__name__}: {exc})") from None
    return StateExport(repo, exported_at, nonce, branches, tags, tokens, commits, issued, where,
                       ended, deleted["branches"], deleted["tags"], continuity)


def read_export(s3: Any, location: str, namespace: str, repo: str) -> StateExport:
    """The export at ``location``: an ``s3://`` folder or local folder holding ``state.json``,
    or that file itself."""
    path = location if location.endswith(STATE_EXPORT) else location.rstrip("/") + "/" + \
        STATE_EXPORT
    try:
        if path.startswith("s3://"):
            bucket, _, key = path[5:].partition("/")
            raw: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        else:
            raw = Path(path).read_bytes()
    except Exception as exc:
        raise RebuildError(f"state export {location}: cannot read {path} "
                           f"({type(exc).__name__}: {exc})") from None
    return parse_export(raw, namespace, repo, location)


def write_export(s3: Any, location: str, export: StateExport) -> str:
    """Write ``export`` as ``state.json`` under ``location`` (s3:// or local); returns the
    folder. The model service and the tests use it."""
    folder = location if location.endswith("/") else location + "/"
    body = export.to_json()
    if folder.startswith("s3://"):
        bucket, _, prefix = folder[5:].partition("/")
        s3.put_object(Bucket=bucket, Key=prefix + STATE_EXPORT, Body=body)
    else:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / STATE_EXPORT).write_bytes(body)
    return folder


# --- the plan (pure) ---------------------------------------------------------------------------


@dataclass
class RebuildPlan:
    drop_refs: list[tuple[str, str, str]] = field(default_factory=list)  # address, ref, token
    drop_tokens: list[str] = field(default_factory=list)
    tokens: list[tuple[str, str]] = field(default_factory=list)  # token, open|sealed
    add_refs: list[tuple[str, str, str, int]] = field(default_factory=list)
    commits: list[tuple[str, CommitRecord]] = field(default_factory=list)  # unknown to mirror
    committed: list[str] = field(default_factory=list)  # their manifests' addresses
    branches: list[tuple[str, tuple[BranchRecord, int]]] = field(default_factory=list)
    branches_gone: list[tuple[str, int]] = field(default_factory=list)  # name, snapshot's v
    # name, the version of its deletion at the service (a tombstone, whether the mirror
    # knew the ref or not)
    branches_deleted: list[tuple[str, int]] = field(default_factory=list)
    known_deleted: int = 0  # of the deleted branches and tags, those the snapshot held
    tags: list[tuple[str, str, int]] = field(default_factory=list)
    tags_gone: list[tuple[str, int]] = field(default_factory=list)
    tags_deleted: list[tuple[str, int]] = field(default_factory=list)
    issued: list[tuple[str, int]] = field(default_factory=list)  # address, ttl ms

    def counts(self) -> dict[str, int]:
        return {"refs_removed": len(self.drop_refs), "tokens_dropped": len(self.drop_tokens),
                "refs_added": len(self.add_refs), "tokens": len(self.tokens),
                "commits_added": len(self.commits), "addresses_committed": len(self.committed),
                "branches": len(self.branches),
                "branches_removed": len(self.branches_gone), "tags": len(self.tags),
                "tags_removed": len(self.tags_gone),
                "refs_deleted": self.known_deleted,
                "tombstones": len(self.branches_deleted) + len(self.tags_deleted),
                "issued": len(self.issued)}


def plan(snap: Snapshot, export: StateExport,
         manifests: Mapping[str, Iterable[str]]) -> RebuildPlan:
    """What the rebuild changes. ``manifests``: the addresses of every exported commit (each
    must be there: a commit whose manifest cannot be read keeps the repository fail-closed).

    Every manifest is marked, not only those of commits the snapshot did not know: a commit
    the mirror applied from a new log may have taken writes whose events were lost with the old
    one, and the mirror then holds no reference that its commit could have made committed
    (found by the soak as dead-letter operator, seed 103: such an object was reaped while the
    head commit of main listed it).

    A snapshot reference in a token the export no longer lists, whose address no exported
    commit lists, is removed too: at the service its token is committed or dropped and the
    entry is in no commit (a merge took the other side's version, or it was removed before the
    commit and the removal was lost). Left in place, the late ``commit_created`` of its token
    would make it "committed" again, over an address the reaper may already have taken: an
    incident with nothing lost (the safety soak's three, seed 2)."""
    known = snap.commits
    p = RebuildPlan()
    exported = {t: {(e.address, e.ref_id) for e in es} for t, (_, es) in export.tokens.items()}
    # Only what the snapshot held can be proven removed; and only within a token the export
    # lists (a token it does not list is dropped whole below).
    p.drop_refs = sorted((a, ref, tok) for a, ref, tok in snap.refs
                         if tok in exported and (a, ref) not in exported[tok])
    # Ended at the service and unknown to the snapshot (creation lost with the log): dropped
    # too, so a reference that arrives for it later is not "unknown, so live" for ever (its
    # committed entries are marked from the manifests below). Seed 103's 19 kept objects.
    p.drop_tokens = sorted({t for t in snap.tokens if t not in export.tokens}
                           | (set(export.ended) - snap.ended))
    p.tokens = sorted((t, s) for t, (s, _) in export.tokens.items())
    p.add_refs = sorted((e.address, e.ref_id, t, e.size)
                        for t, (_, es) in export.tokens.items() for e in es)
    p.commits = [(cid, c) for cid, c in sorted(export.commits.items()) if cid not in known]
    missing = [cid for cid in sorted(export.commits) if cid not in manifests]
    if missing:
        raise RebuildError(f"no manifest read for commit(s) {missing[:5]}")
    committed = {a for cid in export.commits for a in manifests[cid]}
    p.committed = sorted(committed)
    dropped = set(p.drop_tokens)
    p.drop_refs = sorted([*p.drop_refs, *((a, ref, tok) for a, ref, tok in snap.refs
                                          if tok in dropped and a not in committed)])
    p.branches = sorted(export.branches.items())
    # Gone at the service: by the version of its deletion when the export gives it (then an
    # older event of the ref, delivered late, is stale: seed 103, a replayed dead letter
    # brought two deleted branches back), else by the snapshot's version.
    p.branches_deleted = sorted(export.deleted_branches.items())
    p.branches_gone = sorted((b, v) for b, v in snap.branches.items()
                             if b not in export.branches and b not in export.deleted_branches)
    p.tags = sorted((t, c, v) for t, (c, v) in export.tags.items())
    p.tags_deleted = sorted(export.deleted_tags.items())
    p.known_deleted = (sum(b in snap.branches for b in export.deleted_branches)
                       + sum(t in snap.tags for t in export.deleted_tags))
    p.tags_gone = sorted((t, v) for t, v in snap.tags.items()
                         if t not in export.tags and t not in export.deleted_tags)
    p.issued = sorted((a, max(0, until - export.exported_at_ms))
                      for a, until in export.issued.items())
    return p


def ops(p: RebuildPlan) -> Iterator[list[Any]]:
    """The plan as apply.lua's compact ops (op 13 for what no event does), in the order that
    keeps the most: tokens and additions before removals."""
    for t, s in p.tokens:
        yield [13, "tok", t, s]
    for a, ref, t, size in p.add_refs:
        yield [4, t, a, size, ref, "", "", "", "rebuilt"]
    # The marks before the records (chunks are atomic and apply in order): a commit record
    # the rebuild wrote means its manifest's addresses were marked (found by a review: a
    # retry used to judge that commit known and mark nothing, then drop its token).
    for a in p.committed:
        yield [13, "comm", a]
    for cid, c in p.commits:
        yield [13, "commit", cid, encode_commit(c)]
    for b, (v, ver) in p.branches:
        yield [13, "branch", b, encode_branch(v), ver]
    for t, commit_id, ver in p.tags:
        yield [13, "tag", t, commit_id, ver]
    for a, ttl in p.issued:
        yield [3, a, ttl]
    for b, ver in p.branches_gone:
        yield [13, "branch_gone", b, ver]
    for t, ver in p.tags_gone:
        yield [13, "tag_gone", t, ver]
    for b, ver in p.branches_deleted:
        yield [13, "branch_deleted", b, ver]
    for t, ver in p.tags_deleted:
        yield [13, "tag_deleted", t, ver]
    for t in p.drop_tokens:
        yield [13, "tok", t, TokenState.DROPPED.value]
    for a, ref, t in p.drop_refs:
        yield [5, t, a, ref]


# --- apply -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RebuildReport:
    repository: str
    export: str
    exported_at_ms: int
    counts: dict[str, int]
    incidents: int

    def as_dict(self) -> dict[str, Any]:
        return {"repository": self.repository, "export": self.export,
                "exported_at_ms": self.exported_at_ms, **self.counts,
                "incidents": self.incidents}


def manifest_addresses(s3: Any, namespace: str, cid: str, commit: CommitRecord) -> list[str]:
    """The addresses a commit's Parquet manifest lists, canonical (a row outside the
    namespace fails the rebuild, as it fails a mark)."""
    import pyarrow.parquet as pq

    bucket, _, key = commit.manifest[5:].partition("/")
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        rows = pq.read_table(io.BytesIO(body), columns=["address"]).column(0).to_pylist()
        return [canonical_address(namespace, a) for a in rows]
    except OutsideNamespace as exc:
        raise RebuildError(f"commit {cid}: manifest {commit.manifest}: {exc}") from None
    except Exception as exc:
        raise RebuildError(f"commit {cid}: manifest {commit.manifest} cannot be read "
                           f"({type(exc).__name__}: {exc})") from None


def rebuild(r: Any, s3: Any, repo: str, location: str, *, max_age_ms: int,
            by: str = "") -> RebuildReport:
    """Apply the service's export at ``location`` to the prepared rebuild of ``repo`` and
    lift its flag. Raises :class:`RebuildError` (nothing lifted) when the export is missing,
    malformed, for another repository or another prepare, older than ``max_age_ms``, or a
    manifest of a commit the mirror does not know cannot be read."""
    k = RepoKeys(repo)
    prepared = pending(r, repo)
    if not prepared.get("nonce"):
        raise RebuildError(f"{repo}: no rebuild prepared: run `hardelete rebuild prepare "
                           f"{repo}`, then have the service export its state with the nonce")
    losses = _flag_losses(r, repo)
    if losses != prepared.get("losses", ""):
        raise RebuildError(f"{repo}: the log was lost again since the rebuild was prepared; "
                           "prepare again")
    namespace, retired = repo_lifecycle(r, repo)
    if not namespace:
        raise RebuildError(f"{repo}: the mirror has no namespace for it (repository unknown)")
    if retired:
        raise RebuildError(f"{repo} is retired: nothing of it changes, nothing to rebuild")
    marker = r.hget(APPLIED, repo)  # Redis Cluster: a node that went back (see below)
    current = _read_marker(s3, namespace)
    if current != prepared["nonce"]:
        raise RebuildError(f"{repo}: the prepared rebuild is not the current one "
                           f"(_hardelete/rebuild/nonce is {current!r}): Redis went back to an "
                           "older prepare, or it was used; prepare again")
    regression = applied_regression(marker, r.hgetall(k.applied))
    if regression is not None and '"regressed"' not in str(marker):
        raise RebuildError(f"{repo}: {regression}; prepare again once the tracker resumed")
    export = read_export(s3, location, namespace, repo)
    if export.nonce != prepared["nonce"]:
        raise RebuildError(f"state export {location}: its rebuild_nonce is not the prepared "
                           "one (exported before the last prepare, or for another): export "
                           "again with the current nonce")
    now = redis_time_ms(r)
    if now - export.exported_at_ms > max_age_ms:
        raise RebuildError(f"state export {location}: exported "
                           f"{(now - export.exported_at_ms) / 1000:.0f} s ago, older than "
                           f"{max_age_ms / 1000:.0f} s")
    stripes = sequenced_stripes(r, repo)
    cont = export.continuity
    if stripes and (cont is None or len(cont.seqs) != stripes):
        raise RebuildError(f"state export {location}: {repo} is sequenced ({stripes} "
                           f"stripe(s)): the export must carry the counters of every stripe, "
                           "read with the state (\"continuity\": {\"incarnation\", \"seqs\"})")
    if stripes and cont is not None:
        from core.continuity_store import ContinuityStore

        store = ContinuityStore(r)
        problem = continuity_problem(
            cont, [store.read(repo, i) for i in range(stripes)],
            orjson.loads(prepared.get("applied") or "[]"))
        if problem is not None:
            raise RebuildError(f"state export {location}: {problem}")
    raw = r.get(k.rebuild_snapshot)
    if raw is None:
        raise RebuildError(f"{repo}: the prepared snapshot is gone (Redis went back?); "
                           "prepare again")
    snap = Snapshot.from_json(raw)
    # Every commit's manifest, known to the mirror or not: a commit the mirror applied may
    # have taken writes whose events were lost with the log (see plan).
    manifests = {cid: manifest_addresses(s3, namespace, cid, c)
                 for cid, c in export.commits.items()}
    p = plan(snap, export, manifests)
    body = list(ops(p))
    incidents = 0
    chunks = [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)] or [[]]
    # After the first chunk, each requires this run's id and the count its previous chunk
    # left: a slot that went back, or another run's chunks, make it stale (a retry is a new
    # run and applies the whole plan again).
    run = secrets.token_hex(8)
    for n, chunk in enumerate(chunks):
        events = [[13, "guard", prepared["nonce"], losses, run, str(n)], *chunk,
                  [13, "chunk", run, str(n + 1)]]
        if n == len(chunks) - 1:
            # Continuity starts again at the export's counters (core.continuity.rebuilt), in
            # the chunk that lifts: the records and their history are proven together.
            if stripes and cont is not None:
                events += [[13, "cont", k, cont.incarnation, seq]
                           for k, seq in enumerate(cont.seqs)]
            record = orjson.dumps({"repository": repo, "address": "", "event_id": "",
                                   "type": "rebuilt", "ref_id": "", "at_ms": now, "by": by,
                                   "export": location, "exported_at_ms": export.exported_at_ms,
                                   **p.counts()}).decode()
            events.append([13, "lift", record])
        compact = [[i, *e] for i, e in enumerate(events)]
        result = _apply(r, repo, compact)
        incidents += max(0, len(result) - 2)
    # Redis Cluster: the marker a node that went back left in hd:applied's slot (it keeps the
    # repository's objects even if the flag is lost with a node) goes with the flag, as a
    # clear does: the mirror is proven again.
    # (Only the marker seen before the rebuild: one a new failover wrote since stays.)
    if marker is not None and '"regressed"' in str(marker):
        r.eval(_HDEL_IF_SAME, 1, APPLIED, repo, marker)
    _write_marker(s3, namespace, f"used:{prepared['nonce']}")  # never lifts again
    return RebuildReport(repo, location, export.exported_at_ms, p.counts(), incidents)


_HDEL_IF_SAME = """if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1]) end return 0"""


def _apply(r: Any, repo: str, compact: list[list[Any]]) -> Any:
    keys = RepoKeys(repo)
    args = (ApplyScript.sha, 1, keys.meta, keys.tag + ":", repo, "", orjson.dumps(compact), "")
    try:
        return r.evalsha(*args)
    except Exception as exc:
        if "NOSCRIPT" not in str(exc) and "No matching script" not in str(exc):
            if "hardelete: rebuild is stale" in str(exc):
                raise RebuildError(f"{repo}: {str(exc).split('hardelete: ', 1)[1]}; prepare "
                                   "again") from None
            raise
        r.script_load(ApplyScript.lua)
        return r.evalsha(*args)


# --- self-healing (the tracker's loop) ---------------------------------------------------------


EXPORTS = "_hardelete/exports/"  # where the service writes its exports, in the namespace


def find_state_export(s3: Any, namespace: str, nonce: str) -> str | None:
    """The folder of a state export under the namespace's ``_hardelete/exports/`` that
    carries ``nonce`` (None: none yet). Only exports of this prepare can match."""
    bucket, _, prefix = namespace[5:].partition("/")
    paginator = s3.get_paginator("list_objects_v2")
    found = [o["Key"] for page in paginator.paginate(Bucket=bucket, Prefix=prefix + EXPORTS)
             for o in page.get("Contents", ()) if o["Key"].endswith("/" + STATE_EXPORT)]
    for key in sorted(found, reverse=True):  # newest first (folders named by time)
        try:
            d = orjson.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        except Exception:
            continue  # unreadable: not this prepare's (rebuild would refuse it anyway)
        if isinstance(d, dict) and d.get("rebuild_nonce") == nonce:
            return f"s3://{bucket}/{key[:-len(STATE_EXPORT)]}"
    return None


@dataclass(frozen=True)
class Healed:
    prepared: list[str]
    rebuilt: list[RebuildReport]
    problems: dict[str, str]


def heal(r: Any, s3: Any, *, max_age_ms: int, by: str) -> Healed:
    """One round of self-healing: prepare a rebuild for every fail-closed repository, and
    every sequenced one with a broken stripe, that has none current, and apply a state export
    that carries its nonce when the service has written one. What cannot go on is returned
    per repository (it stays fail-closed, or broken)."""
    from core.guards import fail_closed_repos
    from schemas.layout import REPOS

    prepared: list[str] = []
    rebuilt: list[RebuildReport] = []
    problems: dict[str, str] = {}
    flags: dict[str, Any] = dict(fail_closed_repos(r))
    if "*" in flags:
        return Healed([], [], {"*": "every repository is fail-closed (hd:failclosed): "
                                    "a rebuild does not lift that flag"})
    for repo in sorted(r.smembers(REPOS)):
        repo = repo.decode() if isinstance(repo, bytes) else repo
        if repo not in flags and broken_stripes(r, repo):
            flags[repo] = {}
    for repo, flag in sorted(flags.items()):
        try:
            p = pending(r, repo)
            namespace = repo_namespace(r, repo)
            if (not p.get("nonce") or p.get("losses", "") != str(flag.get("losses", ""))
                    or (namespace and _read_marker(s3, namespace) != p["nonce"])):
                prepare(r, s3, repo)
                prepared.append(repo)
                continue
            location = find_state_export(s3, namespace, p["nonce"]) if namespace else None
            if location is not None:
                rebuilt.append(rebuild(r, s3, repo, location, max_age_ms=max_age_ms, by=by))
        except RebuildError as exc:
            problems[repo] = str(exc)
    return Healed(prepared, rebuilt, problems)
