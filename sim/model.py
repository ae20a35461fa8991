"""The model service: an in-process lakeFS-like service that the demo, the tests and the
benchmarks drive, and that knows the ground truth the tracker, reaper and reconciler are
measured against.

Two layers:

* :class:`Model` is synchronous, pure and in memory (no servers): repositories, branches,
  staging tokens (open -> sealed -> committed | dropped), commits, tags and issued upload
  addresses. Every operation returns the :mod:`schemas.events` it produced, as an
  :class:`OpEvents` list that also carries what the operation made (address, commit, uploads),
  and appends them to ``model.events``. :meth:`Model.truth` says which addresses are live and
  which are garbage, and since when. :class:`Workload` generates seeded random operation
  sequences from it (also the raw material of the tracker's property tests).
* :class:`ModelService` wraps a Model and performs the real side effects: it creates the bucket,
  PUTs object bytes and Parquet manifests to S3 and publishes the events through a
  :class:`schemas.publisher.Publisher`, each event only after the operation it describes took
  effect in the store (the contract in ``schemas/README.md``).

Event semantics follow the reference-id rule: every staged entry is a reference with a fresh
``ref_id``; only a write/copy over an entry of the SAME open token, or a delete of such an entry,
removes a reference (naming it). Overwriting or deleting what lives only in a sealed token or a
commit stages a new entry or a tombstone in the open token and removes nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import io
import os
import random
import re
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec

import orjson

from core.clients import split_s3_uri
from core.logs import get_logger
from core.settings import Settings
from schemas import upload_tokens
from schemas.events import (
    MAX_STRIPES,
    AddressIssued,
    BranchCreated,
    BranchDeleted,
    BranchReset,
    CommitCreated,
    Event,
    ObjectCopied,
    ObjectDeleted,
    ObjectWritten,
    RepositoryCreated,
    RepositoryDeleted,
    ServiceEvent,
    TagCreated,
    TagDeleted,
)
from schemas.layout import DATA_PREFIX, MANIFESTS_PREFIX, TokenState
from schemas.records import BranchRecord, CommitRecord

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from schemas.outbox import Outbox
    from schemas.publisher import Publisher
    from tracker.rebuild import StateExport

__all__ = [
    "DEFAULT_MIX",
    "MANIFEST_COLUMNS",
    "PUBLISH_MODES",
    "Branch",
    "Category",
    "Commit",
    "Entry",
    "IssuedAddress",
    "ManualClock",
    "Model",
    "ModelError",
    "ModelService",
    "ObjectKind",
    "ObjectRecord",
    "Op",
    "OpEvents",
    "OpKind",
    "PublishMode",
    "Reference",
    "Repository",
    "StagingToken",
    "StoreCheck",
    "Tombstone",
    "Truth",
    "TruthCounts",
    "Workload",
    "WorkloadSummary",
    "apply_op",
    "manifest_bytes",
    "run_workload",
    "seeded_ids",
    "slice_id",
]

P = ParamSpec("P")
log = get_logger(__name__)
_DEFAULTS = Settings()

# Names end up inside Redis keys (``hd:{repo}:...``), Kafka keys and S3 keys: keep them plain so
# that no name can break a hash tag or a key layout.
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,255}$")


class ModelError(ValueError):
    """An operation the service refuses (unknown repository/branch/path, bad upload token...)."""


def _uuid_hex() -> str:
    return uuid.uuid4().hex


def seeded_ids(seed: int) -> Callable[[], str]:
    """A deterministic id source (uuid4-shaped hex) for reproducible property tests.

    Never use two models with the same seed on one store: addresses would repeat, and an
    address is written once and never reused.
    """
    rng = random.Random(seed)

    def new_id() -> str:
        return uuid.UUID(int=rng.getrandbits(128), version=4).hex

    return new_id


class ManualClock:
    """An injectable clock for tests: returns ``now``, then moves it on by ``step``."""

    def __init__(self, start: float = 1_700_000_000.0, step: float = 0.0) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        t = self.now
        self.now += self.step
        return t

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def slice_id(t: float) -> str:
    """Hourly slice id, reverse-sorted so the newest slice lists first (seed 002)."""
    return f"{9_999_999_999 - int(t // 3600):010d}"


# --- state ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """A staged or committed entry: one reference ``ref_id`` to a physical address."""

    address: str
    size: int
    ref_id: str


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A staged deletion of a path that exists below the open token (sealed or committed)."""


TOMBSTONE = Tombstone()


@dataclass(slots=True)
class StagingToken:
    id: str
    repository: str
    branch: str
    created_at: float
    state: TokenState = TokenState.OPEN
    entries: dict[str, Entry | Tombstone] = field(default_factory=dict)
    ended_at: float | None = None  # when it was committed or dropped


@dataclass(slots=True)
class Branch:
    name: str
    head: str | None
    staging_token: str
    sealed_tokens: list[str] = field(default_factory=list)  # oldest first


@dataclass(frozen=True, slots=True)
class Commit:
    id: str
    repository: str
    branch: str
    parents: tuple[str, ...]  # the first parent is the branch's main ancestry
    time: float
    manifest: str  # s3:// URI of the Parquet manifest
    entries: Mapping[str, Entry]  # the full content of the commit, path -> entry
    sealed_tokens: tuple[str, ...]

    def addresses(self) -> frozenset[str]:
        return frozenset(e.address for e in self.entries.values())


@dataclass(slots=True)
class Repository:
    id: str
    storage_namespace: str
    default_branch: str
    default_retention_days: float
    branch_retention_days: dict[str, float]
    created_at: float
    branches: dict[str, Branch] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commit_ids: list[str] = field(default_factory=list)  # creation order
    # The KV's version of each ref ('b:<branch>', 't:<tag>'): every change bumps it, deletes
    # too, and it survives a delete (seed 004's SetIf). Published as ref_version.
    ref_versions: dict[str, int] = field(default_factory=dict)
    stripes: int = 1  # ordering domains (repository_created.stripes)

    def bump(self, ref: str) -> int:
        v = self.ref_versions[ref] = self.ref_versions.get(ref, 0) + 1
        return v

    @property
    def bucket(self) -> str:
        return split_s3_uri(self.storage_namespace)[0]

    @property
    def prefix(self) -> str:
        return split_s3_uri(self.storage_namespace)[1]

    def retention_days(self, branch: str) -> float:
        return self.branch_retention_days.get(branch, self.default_retention_days)


@dataclass(slots=True)
class IssuedAddress:
    address: str
    repository: str
    token_id: str
    signed_token: str
    issued_at: float
    expires_at: float
    linked_at: float | None = None


class ObjectKind(StrEnum):
    UPLOADED = "uploaded"  # bytes written to an issued address (linked or not)
    LEAKED = "leaked"  # bytes the service wrote without any event: only the reconciler sees them


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """Bytes that exist (or are about to, once the service layer PUTs them) in the store."""

    address: str
    repository: str
    size: int
    written_at: float
    kind: ObjectKind


@dataclass(slots=True)
class Reference:
    ref_id: str
    repository: str
    address: str
    token: str
    path: str
    added_at: float
    removed_at: float | None = None  # removed by a delete or same-token overwrite naming it


class OpEvents(list[Event]):
    """The events one operation produced, in publish order, plus what the operation made.

    It is a plain list of events for everyone who only wants those; the service layer also
    reads ``uploads`` (bytes to PUT) and ``commit`` (a manifest to write).
    """

    __slots__ = ("address", "commit", "ref_id", "signed_token", "uploads")

    def __init__(
        self,
        events: Iterable[Event] = (),
        *,
        address: str | None = None,
        ref_id: str | None = None,
        signed_token: str | None = None,
        commit: Commit | None = None,
        uploads: tuple[ObjectRecord, ...] = (),
    ) -> None:
        super().__init__(events)
        self.address = address
        self.ref_id = ref_id
        self.signed_token = signed_token
        self.commit = commit
        self.uploads = uploads


# --- ground truth -----------------------------------------------------------------------------


class Category(StrEnum):
    COMMITTED = "committed"
    SUPERSEDED = "superseded"
    STAGED_LIVE = "staged_live"
    ISSUED_UNEXPIRED = "issued_unexpired"
    ONLINE_GARBAGE = "online_garbage"
    LEAKED = "leaked"


@dataclass(frozen=True, slots=True)
class TruthCounts:
    objects: int
    committed: int
    superseded: int
    staged_live: int
    issued_unexpired: int
    online_garbage: int
    leaked: int


@dataclass(frozen=True, slots=True)
class Truth:
    """Which addresses are live and which are garbage at ``now``.

    The categories partition every address the model knows (issued, referenced or written), in
    this priority order (an address belongs to the first that applies):

    * ``committed``: in the entries of some commit. Terminal for the online path.
    * ``superseded``: a live reference of a token when that token was committed, but shadowed
      in the commit by a newer entry of a later token (a sealed token's entry overwritten or
      deleted in the open token). The tracker rightly counts it committed (it cannot see the
      manifest), so the online reaper never deletes it; it is reconciler garbage.
    * ``staged_live``: referenced by a live reference of an open or sealed token.
    * ``issued_unexpired``: an issued upload address whose token has not expired.
    * ``leaked``: bytes written with no event at all.
    * ``online_garbage``: everything else the service ever told the tracker about: exactly what
      the online reaper may delete, ``garbage_since[address]`` being when it became garbage
      (last reference ended, or the issued token expired, whichever is later).

    ``objects`` are the addresses whose bytes exist in the store; an issued address never
    uploaded is categorised but is not an object. ``live_referenced`` is every address an open
    or sealed token references, committed ones included (what the reconciler must keep).
    """

    now: float
    issued_ttl_respected: bool
    objects: frozenset[str]
    committed: frozenset[str]
    superseded: frozenset[str]
    staged_live: frozenset[str]
    issued_unexpired: frozenset[str]
    online_garbage: frozenset[str]
    leaked: frozenset[str]
    garbage_since: Mapping[str, float]
    live_referenced: frozenset[str]

    def partition(self) -> dict[Category, frozenset[str]]:
        return {
            Category.COMMITTED: self.committed,
            Category.SUPERSEDED: self.superseded,
            Category.STAGED_LIVE: self.staged_live,
            Category.ISSUED_UNEXPIRED: self.issued_unexpired,
            Category.ONLINE_GARBAGE: self.online_garbage,
            Category.LEAKED: self.leaked,
        }

    @property
    def known(self) -> frozenset[str]:
        return frozenset().union(*self.partition().values())

    def category(self, address: str) -> Category | None:
        for cat, members in self.partition().items():
            if address in members:
                return cat
        return None

    def due(self, grace_seconds: float) -> frozenset[str]:
        """Online garbage whose grace window has passed at ``now``: what a caught-up reaper
        must have deleted."""
        return frozenset(a for a, t in self.garbage_since.items() if t + grace_seconds <= self.now)

    def counts(self) -> TruthCounts:
        return TruthCounts(
            objects=len(self.objects),
            committed=len(self.committed),
            superseded=len(self.superseded),
            staged_live=len(self.staged_live),
            issued_unexpired=len(self.issued_unexpired),
            online_garbage=len(self.online_garbage),
            leaked=len(self.leaked),
        )


# --- the pure model ---------------------------------------------------------------------------


class Model:
    """A synchronous, in-memory lakeFS-like service that records the events it would publish."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        upload_secret: str = _DEFAULTS.upload_token_secret,
        upload_ttl_seconds: float = _DEFAULTS.upload_ttl_seconds,
        new_id: Callable[[], str] = _uuid_hex,
        outbox: Outbox | None = None,
    ) -> None:
        self.clock = clock
        # With an outbox every operation's events get their seqs in one outbox transaction
        # (schemas/outbox.py), and a relay publishes them (ModelService publishes nothing).
        # The model's own state is in memory: the harness does not model a failed commit.
        self.outbox = outbox
        self.upload_secret = upload_secret
        self.upload_ttl_seconds = upload_ttl_seconds
        self.new_id = new_id
        self.repositories: dict[str, Repository] = {}
        self.tokens: dict[str, StagingToken] = {}
        self.commits: dict[str, Commit] = {}
        self._generations: dict[str, int] = {}  # commit -> generation (merge base)
        self.references: dict[str, Reference] = {}
        self.issued: dict[str, IssuedAddress] = {}  # by address
        self.objects: dict[str, ObjectRecord] = {}  # by address
        self.events: list[Event] = []
        # Upload token ids not yet linked: linking forgets the id, which makes a token single use.
        self._unused_upload_tokens: dict[str, str] = {}
        self.retired: dict[str, str] = {}  # deleted repository id -> namespace (never reused)

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> Model:
        return cls(upload_secret=settings.upload_token_secret,
                   upload_ttl_seconds=settings.upload_ttl_seconds, **kwargs)

    # -- lookups --

    def repository(self, repo: str) -> Repository:
        try:
            return self.repositories[repo]
        except KeyError:
            raise ModelError(f"no repository {repo!r}") from None

    def commit_graph(self, repo: str) -> dict[str, CommitRecord]:
        """The repository's commits as the mirror records them (retention's input)."""
        return {c.id: CommitRecord(c.parents, c.time, c.branch, c.manifest)
                for c in self.commits.values() if c.repository == repo}

    def branch(self, repo: str, branch: str) -> Branch:
        r = self.repository(repo)
        try:
            return r.branches[branch]
        except KeyError:
            raise ModelError(f"{repo}: no branch {branch!r}") from None

    def branch_entries(self, repo: str, branch: str) -> dict[str, Entry]:
        """What a reader of the branch sees: head commit, then sealed tokens, then open token."""
        b = self.branch(repo, branch)
        view: dict[str, Entry] = dict(self.commits[b.head].entries) if b.head else {}
        for tid in [*b.sealed_tokens, b.staging_token]:
            _overlay(view, self.tokens[tid].entries)
        return view

    def lookup(self, repo: str, branch: str, path: str) -> Entry | None:
        b = self.branch(repo, branch)
        staged = self.tokens[b.staging_token].entries.get(path)
        if staged is not None:
            return staged if isinstance(staged, Entry) else None
        return self._below_open(b, path)

    def resolve(self, repo: str, ref: str) -> str | None:
        """A branch (its head, maybe None), a tag or a commit id of this repository."""
        r = self.repository(repo)
        if ref in r.branches:
            return r.branches[ref].head
        if ref in r.tags:
            return r.tags[ref]
        commit = self.commits.get(ref)
        if commit is not None and commit.repository == repo:
            return ref
        raise ModelError(f"{repo}: no branch, tag or commit {ref!r}")

    # -- repositories and branches --

    def create_repository(
        self,
        repo: str,
        storage_namespace: str,
        *,
        default_branch: str = "main",
        default_retention_days: float = 7.0,
        branch_retention_days: Mapping[str, float] | None = None,
        stripes: int = 1,
    ) -> OpEvents:
        _check_name("repository", repo, _REPO_RE)
        if not 1 <= stripes <= MAX_STRIPES:
            raise ModelError(f"stripes must be 1..{MAX_STRIPES}, got {stripes}")
        _check_name("branch", default_branch, _REF_RE)
        if repo in self.repositories:
            raise ModelError(f"repository {repo!r} exists")
        if repo in self.retired:
            raise ModelError(f"repository id {repo!r} was deleted; ids are never reused")
        ns = storage_namespace
        if not ns.startswith("s3://") or not ns.endswith("/") or not split_s3_uri(ns)[0]:
            raise ModelError(f"storage namespace must look like s3://bucket/prefix/, got {ns!r}")
        for other in self.repositories.values():
            # Overlapping namespaces would let one repository's garbage collection delete the
            # other's data.
            if ns.startswith(other.storage_namespace) or other.storage_namespace.startswith(ns):
                raise ModelError(f"namespace {ns} overlaps repository {other.id}'s")
        if default_retention_days < 0:
            raise ModelError("default_retention_days must be >= 0")
        now = self.clock()
        r = Repository(repo, ns, default_branch, float(default_retention_days),
                       dict(branch_retention_days or {}), now, stripes=stripes)
        self.repositories[repo] = r
        token = self._new_token(repo, default_branch, now)
        r.branches[default_branch] = Branch(default_branch, None, token.id)
        return self._emit([
            RepositoryCreated(repository=repo, emitted_at=now, storage_namespace=ns,
                              default_branch=default_branch,
                              default_retention_days=r.default_retention_days,
                              branch_retention_days=dict(r.branch_retention_days),
                              stripes=stripes),
            BranchCreated(repository=repo, emitted_at=now, branch=default_branch,
                          staging_token=token.id, ref_version=r.bump("b:" + default_branch)),
        ])

    def delete_repository(self, repo: str) -> OpEvents:
        """Retire a repository: its namespace may serve a new repository, its id never again.
        Its data stays where it is (nothing of a retired repository is deleted online)."""
        r = self.repository(repo)
        del self.repositories[repo]
        self.retired[repo] = r.storage_namespace
        return self._emit([RepositoryDeleted(repository=repo, emitted_at=self.clock(),
                                             storage_namespace=r.storage_namespace)])

    def create_branch(self, repo: str, branch: str, source: str | None = None) -> OpEvents:
        """A branch starting at ``source`` (branch, tag or commit; default branch by default).
        Like lakeFS, it starts from the source's head commit, not its uncommitted changes."""
        r = self.repository(repo)
        _check_name("branch", branch, _REF_RE)
        if branch in r.branches:
            raise ModelError(f"{repo}: branch {branch!r} exists")
        head = self.resolve(repo, source or r.default_branch)
        now = self.clock()
        token = self._new_token(repo, branch, now)
        r.branches[branch] = Branch(branch, head, token.id)
        return self._emit([BranchCreated(repository=repo, emitted_at=now, branch=branch,
                                         staging_token=token.id, source_commit=head,
                                         ref_version=r.bump("b:" + branch))])

    def reset_branch(self, repo: str, branch: str) -> OpEvents:
        """Throw the uncommitted changes away: open and sealed tokens are dropped."""
        b = self.branch(repo, branch)
        now = self.clock()
        dropped = self._end_tokens(b, TokenState.DROPPED, now)
        token = self._new_token(repo, branch, now)
        b.staging_token, b.sealed_tokens = token.id, []
        return self._emit([BranchReset(repository=repo, emitted_at=now, branch=branch,
                                       dropped_tokens=dropped, staging_token=token.id,
                                       head=b.head,
                                       ref_version=self.repository(repo).bump("b:" + branch))])

    def delete_branch(self, repo: str, branch: str) -> OpEvents:
        r = self.repository(repo)
        b = self.branch(repo, branch)
        if branch == r.default_branch:
            raise ModelError(f"{repo}: cannot delete the default branch {branch!r}")
        now = self.clock()
        dropped = self._end_tokens(b, TokenState.DROPPED, now)
        del r.branches[branch]
        return self._emit([BranchDeleted(repository=repo, emitted_at=now, branch=branch,
                                         dropped_tokens=dropped, last_head=b.head,
                                         ref_version=r.bump("b:" + branch))])

    def create_tag(self, repo: str, tag: str, ref: str) -> OpEvents:
        r = self.repository(repo)
        _check_name("tag", tag, _REF_RE)
        if tag in r.tags:
            raise ModelError(f"{repo}: tag {tag!r} exists")
        commit_id = self.resolve(repo, ref)
        if commit_id is None:
            raise ModelError(f"{repo}: {ref!r} has no commit to tag")
        r.tags[tag] = commit_id
        return self._emit([TagCreated(repository=repo, emitted_at=self.clock(), tag=tag,
                                      commit_id=commit_id, ref_version=r.bump("t:" + tag))])

    def delete_tag(self, repo: str, tag: str) -> OpEvents:
        r = self.repository(repo)
        if r.tags.pop(tag, None) is None:
            raise ModelError(f"{repo}: no tag {tag!r}")
        return self._emit([TagDeleted(repository=repo, emitted_at=self.clock(), tag=tag,
                                      ref_version=r.bump("t:" + tag))])

    # -- addresses and uploads --

    def issue_address(self, repo: str, ttl_seconds: float | None = None) -> OpEvents:
        """GetPhysicalAddress: a fresh address and a signed, single-use, expiring token."""
        r = self.repository(repo)
        ttl = self.upload_ttl_seconds if ttl_seconds is None else ttl_seconds
        if ttl <= 0:
            raise ModelError("ttl_seconds must be > 0")
        now = self.clock()
        address = self._new_address(r, now)
        token = upload_tokens.UploadToken(self.new_id(), address, now + ttl)
        signed = upload_tokens.sign(token, self.upload_secret)
        self.issued[address] = IssuedAddress(address, repo, token.token_id, signed, now,
                                             token.expires_at)
        self._unused_upload_tokens[token.token_id] = address
        return self._emit([AddressIssued(repository=repo, emitted_at=now, address=address,
                                         ttl_seconds=ttl)],
                          address=address, signed_token=signed)

    def upload(self, repo: str, address: str, size: int) -> OpEvents:
        """A client uploads bytes to an address it was issued. No event: nothing is staged."""
        self.repository(repo)
        issued = self.issued.get(address)
        if issued is None or issued.repository != repo:
            raise ModelError(f"{repo}: {address} was not issued by this repository")
        _check_size(size)
        if address in self.objects:
            raise ModelError(f"{address} already written: addresses are never reused")
        record = ObjectRecord(address, repo, size, self.clock(), ObjectKind.UPLOADED)
        self.objects[address] = record
        return OpEvents(address=address, uploads=(record,))

    def link(self, repo: str, branch: str, path: str, address: str, signed_token: str,
             size: int | None = None) -> OpEvents:
        """LinkPhysicalAddress: verify the token (signature, address, expiry, single use), then
        stage the uploaded address at ``path`` in the branch's open token."""
        b = self.branch(repo, branch)
        _check_path(path)
        now = self.clock()
        try:
            token = upload_tokens.verify(signed_token, self.upload_secret, address=address,
                                         now=now)
        except upload_tokens.UploadTokenError as exc:
            raise ModelError(f"link {address}: {exc}") from None
        if self._unused_upload_tokens.get(token.token_id) != address:
            raise ModelError(f"link {address}: upload token already used")
        issued = self.issued[address]
        if issued.repository != repo:
            raise ModelError(f"link {address}: issued by repository {issued.repository}")
        obj = self.objects.get(address)
        if obj is None:
            raise ModelError(f"link {address}: nothing was uploaded there")
        del self._unused_upload_tokens[token.token_id]
        issued.linked_at = now
        event = self._stage(repo, b, path, address, obj.size if size is None else size, now)
        return self._emit([event], address=address, ref_id=event.ref_id)

    def write(self, repo: str, branch: str, path: str, size: int) -> OpEvents:
        """Upload through the service: issue an address, upload, link. ``.address`` is the new
        address; the bytes themselves are the service layer's job."""
        self.branch(repo, branch)  # fail before issuing anything
        _check_path(path)
        _check_size(size)
        issued = self.issue_address(repo)
        assert issued.address is not None and issued.signed_token is not None
        uploaded = self.upload(repo, issued.address, size)
        linked = self.link(repo, branch, path, issued.address, issued.signed_token)
        return OpEvents([*issued, *linked], address=issued.address, ref_id=linked.ref_id,
                        uploads=uploaded.uploads)

    def overwrite(self, repo: str, branch: str, path: str, size: int) -> OpEvents:
        """A write over a path the branch already has. Replaces (names) the old reference only
        when the old entry is staged in the same open token."""
        if self.lookup(repo, branch, path) is None:
            raise ModelError(f"{repo}/{branch}: no {path!r} to overwrite")
        return self.write(repo, branch, path, size)

    def unlinked_upload(self, repo: str, size: int) -> OpEvents:
        """A client is issued an address and uploads, but never links it."""
        issued = self.issue_address(repo)
        assert issued.address is not None
        uploaded = self.upload(repo, issued.address, size)
        return OpEvents(issued, address=issued.address, signed_token=issued.signed_token,
                        uploads=uploaded.uploads)

    def leak(self, repo: str, size: int) -> OpEvents:
        """Bytes the service writes with NO event at all (a crash between upload and publish,
        a bug): invisible to the tracker, the reconciler's case."""
        r = self.repository(repo)
        _check_size(size)
        now = self.clock()
        record = ObjectRecord(self._new_address(r, now), repo, size, now, ObjectKind.LEAKED)
        self.objects[record.address] = record
        return OpEvents(address=record.address, uploads=(record,))

    # -- staging --

    def delete(self, repo: str, branch: str, path: str) -> OpEvents:
        """Delete ``path`` from the branch. If it is staged in the open token, that reference
        ends (ObjectDeleted names it). If it lives only in a sealed token or the head commit,
        a tombstone is staged and no event is published: no staged reference ends."""
        b = self.branch(repo, branch)
        token = self.tokens[b.staging_token]
        staged = token.entries.get(path)
        below = self._below_open(b, path)
        if isinstance(staged, Entry):
            now = self.clock()
            self.references[staged.ref_id].removed_at = now
            if below is not None:
                token.entries[path] = TOMBSTONE
            else:
                del token.entries[path]
            return self._emit([ObjectDeleted(repository=repo, emitted_at=now, branch=branch,
                                             staging_token=token.id, path=path,
                                             address=staged.address, ref_id=staged.ref_id)])
        if staged is not None or below is None:
            raise ModelError(f"{repo}/{branch}: no {path!r} to delete")
        token.entries[path] = TOMBSTONE
        return self._emit([])

    def copy(self, repo: str, src_branch: str, src_path: str, dst_branch: str,
             dst_path: str) -> OpEvents:
        """Shallow copy: a new reference to the source's address in the destination's open
        token (the source may be staged, sealed or committed)."""
        source = self.lookup(repo, src_branch, src_path)
        if source is None:
            raise ModelError(f"{repo}/{src_branch}: no {src_path!r} to copy")
        b = self.branch(repo, dst_branch)
        _check_path(dst_path)
        now = self.clock()
        event = self._stage(repo, b, dst_path, source.address, source.size, now,
                            source_read_at=now)
        return self._emit([event], address=source.address, ref_id=event.ref_id)

    # -- commits --

    def commit(self, repo: str, branch: str, *, at: float | None = None) -> OpEvents:
        """Seal the open token, commit it with any sealed ones (head entries + staged changes,
        oldest token first) and give the branch a new open token. ``at`` back-dates the commit
        (for retention tests); the model clock still times the tokens' end."""
        b = self.branch(repo, branch)
        entries = self.branch_entries(repo, branch)
        parents = (b.head,) if b.head else ()
        return self._make_commit(repo, b, entries, parents, at)

    def seal(self, repo: str, branch: str) -> OpEvents:
        """A commit that failed after sealing (seed 004): the open token joins the sealed
        tokens, a new token opens, and the next commit takes both. Nothing is published (no
        commit happened); writes to the new token name it, which is all the tracker needs."""
        b = self.branch(repo, branch)
        now = self.clock()
        self.tokens[b.staging_token].state = TokenState.SEALED
        b.sealed_tokens.append(b.staging_token)
        b.staging_token = self._new_token(repo, branch, now).id
        self.repository(repo).bump("b:" + branch)  # the KV changed the branch (no event)
        return self._emit([])

    def merge(self, repo: str, source: str, dest: str, *, at: float | None = None) -> OpEvents:
        """Merge ``source``'s head into ``dest``: a commit on dest with parents [dest head,
        source head] that also commits dest's staged changes. Three-way by path against the
        merge base: what the source changed since the base is taken, and the source wins
        conflicts."""
        if source == dest:
            raise ModelError(f"{repo}: cannot merge {source!r} into itself")
        src = self.branch(repo, source)
        dst = self.branch(repo, dest)
        if src.head is None:
            raise ModelError(f"{repo}/{source}: nothing committed to merge")
        entries = self.branch_entries(repo, dest)
        base = self._merge_base(dst.head, src.head)
        base_entries = self.commits[base].entries if base else {}
        src_entries = self.commits[src.head].entries
        for path in sorted(set(base_entries) | set(src_entries)):
            theirs = src_entries.get(path)
            if theirs != base_entries.get(path):
                if theirs is None:
                    entries.pop(path, None)
                else:
                    entries[path] = theirs
        parents = (dst.head, src.head) if dst.head else (src.head,)
        return self._make_commit(repo, dst, entries, parents, at)

    # -- ground truth --

    def truth(self, now: float | None = None, issued_ttl_respected: bool = True) -> Truth:
        """Classify every known address at ``now`` (model clock by default).

        ``issued_ttl_respected=False`` ignores the upload-token protection: unlinked uploads
        are garbage from when they were issued (what a consumer that does not honour
        ``address_issued`` would do; the safe tracker respects it)."""
        now = self.clock() if now is None else now
        committed: set[str] = set()
        for c in self.commits.values():
            committed.update(e.address for e in c.entries.values())
        live: set[str] = set()
        taken: set[str] = set()  # live in a token when it was committed
        ended: dict[str, float] = {}  # address -> last end among its ended references
        for ref in self.references.values():
            token = self.tokens[ref.token]
            if ref.removed_at is not None:
                end = ref.removed_at
            elif token.state in (TokenState.OPEN, TokenState.SEALED):
                live.add(ref.address)
                continue
            elif token.state is TokenState.COMMITTED:
                taken.add(ref.address)
                continue
            else:
                assert token.ended_at is not None
                end = token.ended_at
            ended[ref.address] = max(ended.get(ref.address, end), end)
        superseded = taken - committed
        staged = live - committed - superseded
        issued_live = {
            a for a, i in self.issued.items() if issued_ttl_respected and i.expires_at > now
        } - committed - superseded - staged
        leaked = {a for a, o in self.objects.items() if o.kind is ObjectKind.LEAKED}
        known = set(self.issued) | {r.address for r in self.references.values()}
        known |= set(self.objects)
        garbage = known - committed - superseded - staged - issued_live - leaked
        since: dict[str, float] = {}
        for a in garbage:
            times = [ended[a]] if a in ended else []
            issued = self.issued.get(a)
            if issued is not None:
                times.append(issued.expires_at if issued_ttl_respected else issued.issued_at)
            since[a] = max(times)
        return Truth(
            now=now,
            issued_ttl_respected=issued_ttl_respected,
            objects=frozenset(self.objects),
            committed=frozenset(committed),
            superseded=frozenset(superseded),
            staged_live=frozenset(staged),
            issued_unexpired=frozenset(issued_live),
            online_garbage=frozenset(garbage),
            leaked=frozenset(leaked),
            garbage_since=since,
            live_referenced=frozenset(live),
        )

    def reconciler_garbage(
        self,
        retained_commit_ids: Iterable[str],
        *,
        repository: str | None = None,
        now: float | None = None,
        issued_ttl_respected: bool = True,
        grace_seconds: float = 0.0,
        horizon: float | None = None,
    ) -> frozenset[str]:
        """Objects in the namespace(s) that neither a retained commit, nor a live staged
        reference, nor an unexpired issued address protects, nor the grace window: what one
        reconciler run with these retained commits must delete (before its age cutoff).

        Grace binds the reconciler as it binds the reaper (SPEC safety 2): online garbage that
        became garbage less than ``grace_seconds`` before ``horizon`` (what the tracker has
        processed; default ``now``) is kept, since a copy published inside the window is legal.
        """
        truth = self.truth(now, issued_ttl_respected)
        horizon = truth.now if horizon is None else horizon
        # The raw protections, not the categories: a superseded or committed address may also
        # be live in a token or still covered by its upload token.
        keep = set(truth.live_referenced)
        if issued_ttl_respected:
            keep.update(a for a, i in self.issued.items() if i.expires_at > truth.now)
        for cid in retained_commit_ids:
            keep.update(e.address for e in self.commits[cid].entries.values())
        keep.update(a for a, since in truth.garbage_since.items()
                    if since + grace_seconds > horizon)
        return frozenset(
            a for a, o in self.objects.items()
            if a not in keep and (repository is None or o.repository == repository)
        )

    def uncommitted_addresses(self, repo: str, now: float | None = None) -> frozenset[str]:
        """The service's own list of its uncommitted addresses (lakeFS PrepareGCUncommitted):
        every address a live reference of an open or sealed token of ``repo`` names, and every
        issued upload address whose token has not expired. Independent of any event."""
        now = self.clock() if now is None else now
        out = {ref.address for ref in self.references.values()
               if ref.repository == repo and ref.removed_at is None
               and self.tokens[ref.token].state in (TokenState.OPEN, TokenState.SEALED)}
        out.update(a for a, i in self.issued.items()
                   if i.repository == repo and i.expires_at > now)
        return frozenset(out)

    def state_export(self, repo: str, nonce: str, now: float | None = None) -> StateExport:
        """The service's whole state of ``repo`` for a rebuild (tracker/rebuild.py, format 2):
        branches and tags with their ref versions, the live references of every open or
        sealed token, every commit, every unexpired issued upload address. ``nonce`` is the
        prepared rebuild's: the service reads it before it exports."""
        from tracker.rebuild import ExportEntry, StateExport

        now = self.clock() if now is None else now
        r = self.repository(repo)
        tokens: dict[str, tuple[str, list[ExportEntry]]] = {}
        for b in r.branches.values():
            for tid in (*b.sealed_tokens, b.staging_token):
                tokens[tid] = (self.tokens[tid].state.value, [])
        for ref in self.references.values():
            if ref.repository == repo and ref.removed_at is None and ref.token in tokens:
                tokens[ref.token][1].append(ExportEntry(ref.address, ref.ref_id,
                                                        self.objects[ref.address].size
                                                        if ref.address in self.objects else 0))
        return StateExport(
            repository=repo, exported_at_ms=int(now * 1000), nonce=nonce,
            branches={n: (BranchRecord(b.head, b.staging_token, tuple(b.sealed_tokens)),
                          r.ref_versions.get(f"b:{n}", 0))
                      for n, b in r.branches.items()},
            tags={t: (c, r.ref_versions.get(f"t:{t}", 0)) for t, c in r.tags.items()},
            deleted_branches={ref[2:]: v for ref, v in r.ref_versions.items()
                              if ref.startswith("b:") and ref[2:] not in r.branches},
            deleted_tags={ref[2:]: v for ref, v in r.ref_versions.items()
                          if ref.startswith("t:") and ref[2:] not in r.tags},
            tokens={t: (s, tuple(es)) for t, (s, es) in tokens.items()},
            commits=self.commit_graph(repo),
            # Every unexpired ticket, linked or not: the address stays protected until it
            # expires whatever became of its references (truth's issued_unexpired), and the
            # rebuilt mirror may never have seen its address_issued (lost with the log).
            issued={a: int(i.expires_at * 1000) for a, i in self.issued.items()
                    if i.repository == repo and i.expires_at > now},
            ended={t.id: t.state.value for t in self.tokens.values() if t.repository == repo
                   and t.state in (TokenState.COMMITTED, TokenState.DROPPED)})

    # -- internals --

    def _emit(self, events: list[Event], **products: Any) -> OpEvents:
        if self.outbox is not None and events:
            with self.outbox.transaction() as tx:
                events = [tx.emit(e, stripe=self._stripe_of(e))
                          if isinstance(e, ServiceEvent) else e for e in events]
        self.events.extend(events)
        return OpEvents(events, **products)

    def _stripe_of(self, event: Event) -> int:
        """The event's ordering domain within its repository: by branch (tag, address), so a
        branch's events share a counter; the lifecycle events in stripe 0."""
        r = self.repositories.get(event.repository)
        if r is None or r.stripes == 1:
            return 0
        name = getattr(event, "branch", None) or getattr(event, "tag", None) or \
            getattr(event, "address", None)
        return zlib.crc32(name.encode()) % r.stripes if isinstance(name, str) else 0

    def _new_token(self, repo: str, branch: str, now: float) -> StagingToken:
        token = StagingToken(self.new_id(), repo, branch, now)
        self.tokens[token.id] = token
        return token

    def _new_address(self, r: Repository, now: float) -> str:
        return f"{r.storage_namespace}{DATA_PREFIX}{slice_id(now)}/{self.new_id()}"

    def _end_tokens(self, b: Branch, state: TokenState, now: float) -> list[str]:
        ids = [*b.sealed_tokens, b.staging_token]
        for tid in ids:
            self.tokens[tid].state = state
            self.tokens[tid].ended_at = now
        return ids

    def _below_open(self, b: Branch, path: str) -> Entry | None:
        for tid in reversed(b.sealed_tokens):
            value = self.tokens[tid].entries.get(path)
            if value is not None:
                return value if isinstance(value, Entry) else None
        return self.commits[b.head].entries.get(path) if b.head else None

    def _stage(self, repo: str, b: Branch, path: str, address: str, size: int, now: float,
               source_read_at: float | None = None) -> ObjectWritten | ObjectCopied:
        token = self.tokens[b.staging_token]
        previous = token.entries.get(path)
        replaced = previous if isinstance(previous, Entry) else None
        if replaced is not None:
            # Same open token: this write ends the old reference, and says so by its id.
            self.references[replaced.ref_id].removed_at = now
        ref_id = self.new_id()
        if ref_id in self.references:
            raise ModelError(f"id source repeated reference id {ref_id}")
        token.entries[path] = Entry(address, size, ref_id)
        self.references[ref_id] = Reference(ref_id, repo, address, token.id, path, now)
        common: dict[str, Any] = {
            "repository": repo, "emitted_at": now, "branch": b.name, "staging_token": token.id,
            "path": path, "address": address, "size": size, "ref_id": ref_id,
            "replaces_ref_id": replaced.ref_id if replaced else None,
            "replaces_address": replaced.address if replaced else None,
        }
        if source_read_at is None:
            return ObjectWritten(**common)
        return ObjectCopied(source_read_at=source_read_at, **common)

    def _make_commit(self, repo: str, b: Branch, entries: dict[str, Entry],
                     parents: tuple[str, ...], at: float | None) -> OpEvents:
        r = self.repository(repo)
        now = self.clock()
        sealed = self._end_tokens(b, TokenState.COMMITTED, now)
        cid = self.new_id()
        commit = Commit(
            id=cid, repository=repo, branch=b.name, parents=parents,
            time=now if at is None else at,
            manifest=f"{r.storage_namespace}{MANIFESTS_PREFIX}{cid}.parquet",
            entries=dict(sorted(entries.items())), sealed_tokens=tuple(sealed),
        )
        self.commits[cid] = commit
        r.commit_ids.append(cid)
        token = self._new_token(repo, b.name, now)
        b.head, b.staging_token, b.sealed_tokens = cid, token.id, []
        return self._emit([CommitCreated(
            repository=repo, emitted_at=now, branch=b.name, commit_id=cid,
            parents=list(parents), sealed_tokens=sealed, staging_token=token.id,
            committed_at=commit.time, manifest=commit.manifest, ref_version=r.bump("b:" + b.name),
        )], commit=commit)

    def _merge_base(self, a: str | None, b: str) -> str | None:
        """The first commit, breadth first from ``b``, that is an ancestor of ``a``.

        ``a``'s ancestors are walked only as deep as needed (highest generation first): a
        commit is an ancestor of ``a`` only if its generation is at most ``a``'s, so once every
        ancestor of ``a`` down to a commit's generation is known, membership is exact. The
        whole history was walked per merge before, which made a long run quadratic."""
        if a is None:
            return None
        gen = self._generation
        known: set[str] = {a}
        heap: list[tuple[int, str]] = [(-gen(a), a)]

        def is_ancestor_of_a(cid: str) -> bool:
            g = gen(cid)
            while heap and -heap[0][0] >= g:
                _, c = heapq.heappop(heap)
                for p in self.commits[c].parents:
                    if p not in known:
                        known.add(p)
                        heapq.heappush(heap, (-gen(p), p))
            return cid in known

        seen: set[str] = set()
        frontier = [b]
        while frontier:
            nxt: list[str] = []
            for cid in frontier:
                if is_ancestor_of_a(cid):
                    return cid
                if cid not in seen:
                    seen.add(cid)
                    nxt.extend(self.commits[cid].parents)
            frontier = nxt
        return None

    def _generation(self, cid: str) -> int:
        """Longest path to a root (roots are 0); memoised, computed without recursion."""
        memo = self._generations
        if cid in memo:
            return memo[cid]
        stack = [cid]
        while stack:
            c = stack[-1]
            missing = [p for p in self.commits[c].parents if p not in memo]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            memo[c] = 1 + max((memo[p] for p in self.commits[c].parents), default=-1)
        return memo[cid]


def _overlay(view: dict[str, Entry], staged: Mapping[str, Entry | Tombstone]) -> None:
    for path, value in staged.items():
        if isinstance(value, Entry):
            view[path] = value
        else:
            view.pop(path, None)


def _check_name(what: str, name: str, pattern: re.Pattern[str]) -> None:
    if not pattern.match(name):
        raise ModelError(f"invalid {what} name {name!r}")


def _check_path(path: str) -> None:
    if not path:
        raise ModelError("path must not be empty")


def _check_size(size: int) -> None:
    if size < 0:
        raise ModelError(f"size must be >= 0, got {size}")


# --- seeded random workloads ------------------------------------------------------------------


class OpKind(StrEnum):
    CREATE_REPOSITORY = "create_repository"
    CREATE_BRANCH = "create_branch"
    WRITE = "write"
    OVERWRITE = "overwrite"
    DELETE = "delete"
    COPY = "copy"  # within a branch
    COPY_BRANCH = "copy_branch"  # across branches
    COMMIT = "commit"
    SEAL = "seal"  # a commit that failed after sealing
    MERGE = "merge"
    RESET = "reset"
    DELETE_BRANCH = "delete_branch"
    TAG = "tag"
    DELETE_TAG = "delete_tag"
    UNLINKED = "unlinked"  # issued and uploaded, never linked
    ISSUE = "issue"  # issued, never uploaded
    LEAK = "leak"  # written with no event


DEFAULT_MIX: Mapping[OpKind, float] = {
    OpKind.WRITE: 30, OpKind.OVERWRITE: 14, OpKind.DELETE: 8, OpKind.COPY: 5,
    OpKind.COPY_BRANCH: 4, OpKind.COMMIT: 10, OpKind.SEAL: 2, OpKind.MERGE: 4, OpKind.RESET: 3,
    OpKind.CREATE_BRANCH: 4, OpKind.DELETE_BRANCH: 2, OpKind.TAG: 3, OpKind.DELETE_TAG: 1,
    OpKind.UNLINKED: 4, OpKind.ISSUE: 0, OpKind.LEAK: 2,
}


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a workload; :func:`apply_op` runs it on a Model.

    Fields by kind: ``branch``/``path`` are the target (the source for copies, whose target is
    ``to_branch``/``to_path``); ``source`` is the branch a new branch starts from, the branch
    merged into ``branch``, or the ref a tag names; ``name`` is the namespace of a new
    repository or the name of a tag.
    """

    kind: OpKind
    repo: str
    branch: str = ""
    path: str = ""
    size: int = 0
    to_branch: str = ""
    to_path: str = ""
    source: str = ""
    name: str = ""
    at: float | None = None
    retention_days: float = 7.0


def apply_op(model: Model, op: Op) -> OpEvents:
    k, m = op.kind, model
    if k is OpKind.CREATE_REPOSITORY:
        return m.create_repository(op.repo, op.name, default_retention_days=op.retention_days)
    if k is OpKind.CREATE_BRANCH:
        return m.create_branch(op.repo, op.branch, op.source or None)
    if k is OpKind.WRITE:
        return m.write(op.repo, op.branch, op.path, op.size)
    if k is OpKind.OVERWRITE:
        return m.overwrite(op.repo, op.branch, op.path, op.size)
    if k is OpKind.DELETE:
        return m.delete(op.repo, op.branch, op.path)
    if k in (OpKind.COPY, OpKind.COPY_BRANCH):
        return m.copy(op.repo, op.branch, op.path, op.to_branch, op.to_path)
    if k is OpKind.COMMIT:
        return m.commit(op.repo, op.branch, at=op.at)
    if k is OpKind.SEAL:
        return m.seal(op.repo, op.branch)
    if k is OpKind.MERGE:
        return m.merge(op.repo, op.source, op.branch, at=op.at)
    if k is OpKind.RESET:
        return m.reset_branch(op.repo, op.branch)
    if k is OpKind.DELETE_BRANCH:
        return m.delete_branch(op.repo, op.branch)
    if k is OpKind.TAG:
        return m.create_tag(op.repo, op.name, op.source)
    if k is OpKind.DELETE_TAG:
        return m.delete_tag(op.repo, op.name)
    if k is OpKind.UNLINKED:
        return m.unlinked_upload(op.repo, op.size)
    if k is OpKind.ISSUE:
        return m.issue_address(op.repo)
    if k is OpKind.LEAK:
        return m.leak(op.repo, op.size)
    raise ModelError(f"unknown op kind {k!r}")  # pragma: no cover - the enum is exhaustive


@dataclass(frozen=True)
class Workload:
    """A seeded random sequence of operations with a configurable mix.

    ``operations(model)`` first creates the repositories and ``branches`` branches each (unless
    they exist), then draws ``ops`` operations. Each draw looks at the model's current state so
    that every operation is valid (an overwrite picks a path the branch has; a merge needs a
    source with commits; an impossible draw falls back to a write, commit or branch creation),
    so the generator must be consumed in lockstep with applying its ops, as
    :func:`run_workload` and :meth:`ModelService.run_workload` do. The same seed on a fresh
    model gives the same operations.

    ``mix`` maps op kind names (see :class:`OpKind`) to relative weights; kinds it leaves out
    keep their :data:`DEFAULT_MIX` weight, so ``{"leak": 0}`` just turns leaks off. With
    ``span_days`` > 0, commits and merges are back-dated evenly over that many days (oldest
    first), so that retention has history to work on.
    """

    seed: int = 0
    ops: int = 300
    mix: Mapping[str, float] | None = None
    repos: int = 1
    branches: int = 3
    paths: int = 40
    min_size: int = 1
    max_size: int = 4096
    bucket: str = "hardelete-model"
    name: str = "wl"
    retention_days: float = 7.0
    span_days: float = 0.0

    def __post_init__(self) -> None:
        if self.ops < 0:
            raise ValueError(f"ops must be >= 0, got {self.ops}")
        if self.repos < 1 or self.branches < 1 or self.paths < 1:
            raise ValueError("repos, branches and paths must be >= 1")
        if not 0 <= self.min_size <= self.max_size:
            raise ValueError("need 0 <= min_size <= max_size")
        if self.span_days < 0:
            raise ValueError("span_days must be >= 0")
        # Repository creation is set-up, not a draw: the workload's repositories are fixed.
        unknown = sorted(set(self.mix or {}) - {k.value for k in DEFAULT_MIX})
        if unknown:
            raise ValueError(f"unknown op kind(s) in mix: {unknown}; known: "
                             f"{sorted(k.value for k in DEFAULT_MIX)}")
        weights = self.weights()
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError("mix weights must be >= 0 with a positive total")

    def weights(self) -> dict[OpKind, float]:
        merged = dict(DEFAULT_MIX)
        for kind, weight in (self.mix or {}).items():
            merged[OpKind(kind)] = float(weight)
        return merged

    def repo_ids(self) -> list[str]:
        return [f"{self.name}-r{i}" for i in range(self.repos)]

    def namespace(self, repo: str) -> str:
        return f"s3://{self.bucket}/{self.name}/{repo}/"

    @property
    def setup_ops(self) -> int:
        return self.repos * self.branches

    def operations(self, model: Model) -> Iterator[Op]:
        rng = random.Random(self.seed)
        for repo in self.repo_ids():
            if repo not in model.repositories:
                yield Op(OpKind.CREATE_REPOSITORY, repo, name=self.namespace(repo),
                         retention_days=self.retention_days)
            for i in range(1, self.branches):
                if f"b{i}" not in model.repository(repo).branches:
                    yield Op(OpKind.CREATE_BRANCH, repo, branch=f"b{i}")
        weights = self.weights()
        kinds = [k for k in DEFAULT_MIX if weights[k] > 0]
        kind_weights = [weights[k] for k in kinds]
        start = model.clock() if self.span_days else 0.0
        for i in range(self.ops):
            kind = rng.choices(kinds, kind_weights)[0]
            repo = rng.choice(self.repo_ids())
            at = None
            if self.span_days:
                at = start - self.span_days * 86400.0 * (1 - i / max(self.ops, 1))
            yield self._draw(rng, model, kind, repo, i, at)

    def _draw(self, rng: random.Random, model: Model, kind: OpKind, repo: str, i: int,
              at: float | None) -> Op:
        r = model.repository(repo)
        names = sorted(r.branches)
        branch = rng.choice(names)
        size = rng.randint(self.min_size, self.max_size)

        def visible(b: str) -> list[str]:
            return sorted(model.branch_entries(repo, b))

        def path() -> str:
            return f"p/{rng.randrange(self.paths):04d}"

        if kind is OpKind.WRITE:
            return Op(kind, repo, branch, path(), size)
        if kind in (OpKind.OVERWRITE, OpKind.DELETE, OpKind.COPY, OpKind.COPY_BRANCH):
            paths = visible(branch)
            others = [b for b in names if b != branch]
            if not paths or (kind is OpKind.COPY_BRANCH and not others):
                return self._draw(rng, model, OpKind.WRITE, repo, i, at)
            src = rng.choice(paths)
            staged = sorted(p for p, v in model.tokens[r.branches[branch].staging_token]
                            .entries.items() if isinstance(v, Entry))
            if staged and kind in (OpKind.OVERWRITE, OpKind.DELETE) and rng.random() < 0.5:
                # Favour same-token overwrites and deletes: they are what the online path
                # reclaims, and with frequent commits uniformly drawn paths are mostly committed.
                src = rng.choice(staged)
            if kind is OpKind.OVERWRITE:
                return Op(kind, repo, branch, src, size)
            if kind is OpKind.DELETE:
                return Op(kind, repo, branch, src)
            dst = branch if kind is OpKind.COPY else rng.choice(others)
            return Op(kind, repo, branch, src, to_branch=dst, to_path=path())
        if kind in (OpKind.COMMIT, OpKind.SEAL, OpKind.RESET):
            return Op(kind, repo, branch, at=at if kind is OpKind.COMMIT else None)
        if kind is OpKind.MERGE:
            sources = [b for b in names if b != branch and r.branches[b].head]
            if not sources:
                return self._draw(rng, model, OpKind.COMMIT, repo, i, at)
            return Op(kind, repo, branch, source=rng.choice(sources), at=at)
        if kind is OpKind.CREATE_BRANCH:
            if len(names) >= 2 * self.branches:
                return self._draw(rng, model, OpKind.WRITE, repo, i, at)
            return Op(kind, repo, f"x{i}", source=branch)
        if kind is OpKind.DELETE_BRANCH:
            victims = [b for b in names if b != r.default_branch]
            if not victims:
                return self._draw(rng, model, OpKind.CREATE_BRANCH, repo, i, at)
            return Op(kind, repo, rng.choice(victims))
        if kind is OpKind.DELETE_TAG and r.tags:
            return Op(kind, repo, name=rng.choice(sorted(r.tags)))
        if kind in (OpKind.TAG, OpKind.DELETE_TAG):
            heads = [b for b in names if r.branches[b].head]
            if not heads:
                return self._draw(rng, model, OpKind.COMMIT, repo, i, at)
            return Op(OpKind.TAG, repo, name=f"t{i}", source=rng.choice(heads))
        if kind in (OpKind.UNLINKED, OpKind.LEAK):
            return Op(kind, repo, size=size)
        return Op(kind, repo)  # ISSUE


def run_workload(model: Model, workload: Workload) -> list[Event]:
    """Apply a workload's operations to the model; return the events they produced."""
    events: list[Event] = []
    for op in workload.operations(model):
        events.extend(apply_op(model, op))
    return events


# --- the service layer: real side effects -----------------------------------------------------

PublishMode = Literal["per-op", "buffered"]
PUBLISH_MODES: tuple[PublishMode, ...] = ("per-op", "buffered")


@dataclass(frozen=True, slots=True)
class StoreCheck:
    """The model's view compared with a direct listing of the namespaces."""

    listed_data: int
    listed_manifests: int
    listed_other: int
    missing: tuple[str, ...]  # the model wrote bytes there; the store does not have them
    unexpected: tuple[str, ...]  # data in the store the model never wrote
    missing_manifests: tuple[str, ...]
    # Listed data objects per ground-truth category; each listed object is in exactly one.
    listed_by_category: dict[str, int]

    @property
    def ok(self) -> bool:
        categorised = sum(n for c, n in self.listed_by_category.items() if c in set(Category))
        return not (self.missing or self.unexpected or self.missing_manifests) and (
            categorised == self.listed_data)


@dataclass(frozen=True, slots=True)
class WorkloadSummary:
    seed: int
    publish_mode: str
    ops: int
    ops_by_kind: dict[str, int]
    objects_written: int
    bytes_written: int
    manifests_written: int
    events: int
    events_by_type: dict[str, int]
    events_published: int
    truth: TruthCounts
    # The same state once every upload token issued so far has expired: what the online path
    # will have reclaimed by then if nothing else happens (the live numbers count unexpired
    # issued addresses as protected, which in a short run is most garbage).
    truth_at_expiry: TruthCounts
    elapsed_seconds: float


class ModelService:
    """A Model plus its real side effects: bucket, object bytes, Parquet manifests, events.

    Order per operation: the ``address_issued`` events that open it are published first (the
    address is protected before anything is uploaded), then bytes and manifests are written,
    then the remaining events are published: an event never describes something the store does
    not have yet. ``publish_mode="buffered"`` keeps the events and publishes them in one
    ``publish_many`` at :meth:`flush` (benchmarks); without a publisher nothing is published.
    A model with an outbox commits each operation's events to it (with their seqs) and a
    relay the caller runs publishes them (``schemas/relay.py``): the publisher is not used.
    A side effect that fails raises and leaves the model ahead of the store: this is a test
    harness, not a simulation of partial failures (``leak`` models those explicitly).
    """

    def __init__(
        self,
        settings: Settings,
        s3: S3Client,
        publisher: Publisher | None = None,
        *,
        model: Model | None = None,
        publish_mode: PublishMode = "per-op",
        payload_cap: int = 1024,
    ) -> None:
        if publish_mode not in PUBLISH_MODES:
            raise ValueError(f"publish_mode must be one of {PUBLISH_MODES}, got {publish_mode!r}")
        self.settings = settings
        self.s3 = s3
        self.publisher = publisher
        self.model = model if model is not None else Model.from_settings(settings)
        from sim.sequenced import active  # (the relay's clients: only for a live service)

        certifying = active(settings)
        if certifying is not None and self.model.outbox is None and not self.model.events:
            self.model.outbox = certifying.outbox  # (the test's service numbers its history)
        self.publish_mode = publish_mode
        # Object bytes are random and capped: the store's size may be smaller than the entry's
        # size, which nothing in hardelete reads (sizes come from events and manifests).
        self.payload_cap = payload_cap
        self.objects_written = 0
        self.bytes_written = 0
        self.manifests_written = 0
        self.events_published = 0
        self._pending: list[Event] = []
        self._buckets: set[str] = set()

    async def apply(self, op: Op) -> OpEvents:
        """Run one workload operation on the model, then its side effects."""
        result = apply_op(self.model, op)
        await self._effects(result)
        return result

    async def call(self, fn: Callable[Concatenate[Model, P], OpEvents], *args: P.args,
                   **kwargs: P.kwargs) -> OpEvents:
        """Run any Model operation with its side effects: ``await svc.call(Model.write, ...)``."""
        result = fn(self.model, *args, **kwargs)
        await self._effects(result)
        return result

    async def flush(self) -> int:
        """Publish the buffered events (buffered mode); returns how many."""
        pending, self._pending = self._pending, []
        return await self._publish(pending)

    async def run_workload(self, workload: Workload,
                           on_op: Callable[[Op], None] | None = None) -> WorkloadSummary:
        started = time.monotonic()
        first_event = len(self.model.events)
        before = (self.objects_written, self.bytes_written, self.manifests_written,
                  self.events_published)
        kinds: Counter[str] = Counter()
        for op in workload.operations(self.model):
            await self.apply(op)
            kinds[op.kind.value] += 1
            if on_op is not None:
                on_op(op)
        await self.flush()
        events = self.model.events[first_event:]
        truth = self.model.truth()
        summary = WorkloadSummary(
            seed=workload.seed,
            publish_mode=self.publish_mode,
            ops=sum(kinds.values()),
            ops_by_kind=dict(sorted(kinds.items())),
            objects_written=self.objects_written - before[0],
            bytes_written=self.bytes_written - before[1],
            manifests_written=self.manifests_written - before[2],
            events=len(events),
            events_by_type=dict(sorted(Counter(e.TYPE for e in events).items())),
            events_published=self.events_published - before[3],
            truth=truth.counts(),
            truth_at_expiry=self.model.truth(
                truth.now + self.model.upload_ttl_seconds).counts(),
            elapsed_seconds=round(time.monotonic() - started, 3),
        )
        log.info("model.workload_done", seed=workload.seed, ops=summary.ops,
                 objects=summary.objects_written, events=summary.events,
                 published=summary.events_published, seconds=summary.elapsed_seconds)
        return summary

    async def list_namespace(self, repo: str) -> list[str]:
        """Every key under the repository's namespace, as s3:// URIs."""
        r = self.model.repository(repo)
        return await asyncio.to_thread(self._list, r.bucket, r.prefix)

    async def verify_store(self, repos: Iterable[str] | None = None) -> StoreCheck:
        """List the namespaces and compare with what the model says it wrote."""
        chosen = list(self.model.repositories) if repos is None else list(repos)
        data: set[str] = set()
        manifests: set[str] = set()
        other = 0
        expected_manifests: set[str] = set()
        for repo in chosen:
            ns = self.model.repository(repo).storage_namespace
            for uri in await self.list_namespace(repo):
                if uri.startswith(ns + DATA_PREFIX):
                    data.add(uri)
                elif uri.startswith(ns + MANIFESTS_PREFIX):
                    manifests.add(uri)
                else:
                    other += 1
            expected_manifests.update(self.model.commits[c].manifest
                                      for c in self.model.repository(repo).commit_ids)
        expected = {a for a, o in self.model.objects.items() if o.repository in chosen}
        truth = self.model.truth()
        by_category: Counter[str] = Counter()
        for address in data & expected:
            category = truth.category(address)
            by_category[category.value if category else "unknown"] += 1
        return StoreCheck(
            listed_data=len(data), listed_manifests=len(manifests), listed_other=other,
            missing=tuple(sorted(expected - data)), unexpected=tuple(sorted(data - expected)),
            missing_manifests=tuple(sorted(expected_manifests - manifests)),
            listed_by_category={**{c.value: 0 for c in Category}, **by_category},
        )

    async def write_uncommitted_export(self, repo: str, location: str | None = None) -> str:
        """Write the service's uncommitted-address export for the reconciler (format in
        ``reconciler/README.md``): by default a new folder under the namespace's
        ``_hardelete/exports/``. ``exported_at`` is the service's wall clock at the export.
        Returns the folder."""
        from reconciler.service_export import EXPORTS_PREFIX, write_export

        exported_at = time.time()
        addresses = sorted(self.model.uncommitted_addresses(repo))
        if location is None:
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(exported_at))
            location = (f"{self.model.repository(repo).storage_namespace}{EXPORTS_PREFIX}"
                        f"{stamp}-{int(exported_at * 1000) % 1000:03d}/")
        return await asyncio.to_thread(write_export, self.s3, location, addresses,
                                       exported_at_ms=int(exported_at * 1000),
                                       repository=repo,
                                       namespace=self.model.repository(repo).storage_namespace)

    async def write_state_export(self, repo: str, nonce: str,
                                 location: str | None = None) -> str:
        """Write the service's whole-state export (tracker/rebuild.py) for a prepared rebuild:
        by default a new folder under the namespace's ``_hardelete/exports/``. Returns it."""
        from tracker.rebuild import ExportContinuity, write_export

        export = self.model.state_export(repo, nonce)
        if self.model.outbox is not None:
            # The counters with the state, no step between them (one thread): every event
            # they count is in the export.
            counters = self.model.outbox.counters(repo)
            if counters is not None:
                export = replace(export, continuity=ExportContinuity.of(counters))
        if location is None:
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(export.exported_at_ms / 1000))
            location = (f"{self.model.repository(repo).storage_namespace}_hardelete/exports/"
                        f"state-{stamp}-{export.exported_at_ms % 1000:03d}/")
        return await asyncio.to_thread(write_export, self.s3, location, export)

    # -- internals --

    async def _effects(self, result: OpEvents) -> None:
        split = 0
        while split < len(result) and isinstance(result[split], AddressIssued):
            split += 1
        await self._emit(result[:split])
        for event in result:
            if isinstance(event, RepositoryCreated):
                await self._ensure_bucket(split_s3_uri(event.storage_namespace)[0])
        for record in result.uploads:
            await self._put_object(record)
        if result.commit is not None:
            await self._put_manifest(result.commit)
        await self._emit(result[split:])

    async def _emit(self, events: list[Event]) -> None:
        if not events:
            return
        if self.publish_mode == "buffered":
            self._pending.extend(events)
        else:
            await self._publish(events)

    async def _publish(self, events: list[Event]) -> int:
        if self.model.outbox is not None:  # committed to the outbox: its relay publishes
            self.events_published += len(events)
            return len(events)
        if self.publisher is None or not events:
            return 0
        sent = await self.publisher.publish_many(events)
        self.events_published += sent
        return sent

    async def _ensure_bucket(self, bucket: str) -> None:
        if bucket in self._buckets:
            return
        await asyncio.to_thread(self._create_bucket, bucket)
        self._buckets.add(bucket)

    def _create_bucket(self, bucket: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.s3.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                raise
        try:
            if self.settings.s3_region == "us-east-1":
                self.s3.create_bucket(Bucket=bucket)
            else:
                self.s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={
                    "LocationConstraint": self.settings.s3_region})  # type: ignore[typeddict-item]
        except ClientError as exc:
            # Another writer created it between our HEAD and CREATE: that is what we wanted.
            if exc.response.get("Error", {}).get("Code") not in (
                    "BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    async def _put_object(self, record: ObjectRecord) -> None:
        body = os.urandom(min(record.size, self.payload_cap))
        bucket, key = split_s3_uri(record.address)
        await asyncio.to_thread(self.s3.put_object, Bucket=bucket, Key=key, Body=body)
        self.objects_written += 1
        self.bytes_written += len(body)

    async def _put_manifest(self, commit: Commit) -> None:
        body = manifest_bytes(commit)
        bucket, key = split_s3_uri(commit.manifest)
        await asyncio.to_thread(self.s3.put_object, Bucket=bucket, Key=key, Body=body)
        self.manifests_written += 1

    def _list(self, bucket: str, prefix: str) -> list[str]:
        out: list[str] = []
        paginator = self.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            out.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))
        return out


MANIFEST_COLUMNS = ("path", "address", "size", "ref_id")


def manifest_bytes(commit: Commit) -> bytes:
    """A commit's entries as Parquet (columns path, address, size, ref_id, sorted by path);
    the commit's own fields go in the file's key-value metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(commit.entries.items())
    table = pa.table(
        {
            "path": pa.array([p for p, _ in rows], pa.string()),
            "address": pa.array([e.address for _, e in rows], pa.string()),
            "size": pa.array([e.size for _, e in rows], pa.int64()),
            "ref_id": pa.array([e.ref_id for _, e in rows], pa.string()),
        }
    ).replace_schema_metadata({
        "hardelete.commit": orjson.dumps({
            "commit_id": commit.id, "repository": commit.repository, "branch": commit.branch,
            "parents": list(commit.parents), "time": commit.time,
        }),
    })
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
