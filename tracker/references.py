"""The reference state machine: the specification of what the tracker does with each event.

Pure data and functions, no I/O. ``tracker/apply.lua`` implements exactly this machine inside
Redis (a differential test, ``tests/integration/tracker/test_tracker_lua.py``, proves they agree);
everything that
reads the tracker's Redis state back (``tracker.state``) produces these dataclasses.

Per physical address the machine keeps an observed-remove set of references (SPEC rule 5,
``schemas/README.md``): ``adds`` ref -> token and ``removes`` ref -> token. A reference is *live*
when it was added, was not removed in its own token, and its token is open, sealed, contested
(``doubt``) or unknown. A reference id named with two tokens (adds or removes) is a
contradiction: the address gets the sticky ``doubt`` flag and is kept (an incident); the least
token named is recorded, so any order gives one record. A token named by two branches' events
is contested (``token_owners``): token state ``doubt``, above dropped, so no branch event of
another branch can end its references. If any added and
not removed reference belongs to a committed token the address gets the sticky ``committed``
flag (terminal for the online path). The address state is derived, in this precedence:

    committed  >  staged (a live ref)  >  issued (iu > now)  >  unreferenced (since = now)

Every event that touches an address and leaves it unreferenced restarts its grace window
(``since = now``): any doubt keeps the object longer. ``reaping`` and ``reaped`` belong to the
reaper: the tracker records references on such addresses but never changes their state; a new
reference that would keep such an address alive is an :class:`Incident`. The reaper also
publishes what the store confirmed deleted (``addresses_reaped``, before it marks Redis): an
address the tracker does not yet know as held becomes ``reaped`` then (Redis forgot the
reaper's work), with an incident for each reference that would keep it.

Token states only move up ``TOKEN_RANK`` (doubt outranks dropped, committed both); when a
token's state changes, every address referenced from it is re-evaluated.

Refs (branch and tag records) converge by version: every ref event carries ``ref_version`` (the
service KV's version of the ref after the change; required, ``schemas/events.py``). Per ref the
machine keeps the highest version it applied, deletes included (a versioned tombstone), and an
event whose version is not higher changes nothing of the ref (its token effects still apply:
they commute). So any order and any duplication ends in the state of in-order delivery. A
``branch_reset`` carries the whole record (``head`` null means no commit). Duplicates are also
recognised by ``event_id``: the last ``REF_DEDUPE_WINDOW`` ref event ids of the repository are
kept with the ref and version they carried, and an id seen again with the same ref and version
is a duplicate whose ref change is skipped. The same id with another ref or version is not a
duplicate of it (a publisher reusing ids): it is applied by the version rule, never dropped, since
dropping a real tag could let the reconciler take what the tag retains. Commits are immutable
(first record wins).

Repositories: the :class:`World` keeps the namespace registry (``hd:namespaces``). A
``repository_created`` whose namespace equals, contains or lies inside a live repository's, or
that names a retired repository id, is refused (an incident). ``repository_deleted`` retires a
repository: its reaper queue is dropped, every later event of it is refused, and its namespace
is freed once the retirement is applied (:meth:`World.settle`, the end of the tracker's batch).

Admission: an event of an unknown or retired repository, or naming an address outside the
repository's namespace or under a reserved prefix (``layout.namespace_key``), is rejected with a
reason (the tracker sends it to the dead-letter topic) and never applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import events as ev
from schemas.address import spelling
from schemas.layout import (
    LIVE_TOKEN_STATES,
    REF_DEDUPE_WINDOW,
    TOKEN_RANK,
    AddressState,
    TokenState,
)
from schemas.namespaces import namespace_problem, registration_problem
from schemas.records import AddressRecord, BranchRecord, CommitRecord, RepoMeta

HELD_BY_REAPER = frozenset({AddressState.REAPING, AddressState.REAPED})
# Token states whose references keep their address (an unknown token keeps too).
KEEPING_TOKEN_STATES = LIVE_TOKEN_STATES | {TokenState.DOUBT}


@dataclass(frozen=True, order=True)
class Incident:
    """A contract breach: a reference that arrived for an address being reaped or already
    reaped (``kind`` ''), a reference id named with two tokens (``ref_doubt``: ``token`` is
    the event's), or a token named by two branches (``token_contested``, no address)."""

    repository: str
    address: str
    event_id: str
    type: str
    ref_id: str
    at_ms: int
    kind: str = ""
    token: str = ""


REF_DOUBT, TOKEN_CONTESTED = "ref_doubt", "token_contested"


@dataclass
class RepoState:
    repository: str
    meta: RepoMeta | None = None
    addresses: dict[str, AddressRecord] = field(default_factory=dict)
    tokens: dict[str, tuple[TokenState, int]] = field(default_factory=dict)  # -> (state, ms)
    token_addresses: dict[str, set[str]] = field(default_factory=dict)
    branches: dict[str, BranchRecord] = field(default_factory=dict)
    commits: dict[str, CommitRecord] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    incidents: list[Incident] = field(default_factory=list)
    unreferenced: dict[str, int] = field(default_factory=dict)  # address -> since (or iu)
    ref_versions: dict[str, int] = field(default_factory=dict)  # 'b:<branch>'/'t:<tag>' -> v
    # token -> the branch whose events name it, '' once two branches did (contested).
    token_owners: dict[str, str] = field(default_factory=dict)
    # The dedupe window: ref event id -> '<ref>|<version>', oldest first (REF_DEDUPE_WINDOW).
    ref_seen: dict[str, str] = field(default_factory=dict)
    ref_duplicates: int = 0  # ref events skipped as duplicates (stats: ref_duplicates)
    ref_ids_reused: int = 0  # an id seen with another ref or version (stats: ref_ids_reused)
    retired_at: int | None = None  # ms the repository_deleted was applied

    def token_state(self, token: str) -> TokenState | None:
        cur = self.tokens.get(token)
        return cur[0] if cur else None

    def reapable(self, address: str, horizon_ms: int, grace_ms: int) -> bool:
        """Whether the online path may delete ``address`` given the tracker horizon."""
        rec = self.addresses.get(address)
        if rec is None or rec.state not in (AddressState.UNREFERENCED, AddressState.ISSUED):
            return False
        since = self.unreferenced.get(address)
        return since is not None and since + grace_ms <= horizon_ms


@dataclass
class Outcome:
    rejected: str | None = None  # reason: the event goes to the dead-letter topic
    incidents: list[Incident] = field(default_factory=list)


# --- admission ---------------------------------------------------------------------------------

def addresses_of(event: ev.Event) -> list[str]:
    """The physical addresses an event names (all must lie inside the namespace)."""
    return ev.named_addresses(lambda name: getattr(event, name, None))


def admission_problem(repository: str, event_type: str, addresses: list[str],
                      known_namespace: str | None, new_namespace: str | None = None,
                      retired: bool = False) -> str | None:
    """Why an event must not be applied (it goes to the dead-letter topic), or None.

    ``known_namespace`` is the repository's namespace if the repository exists;
    ``new_namespace`` is the namespace a ``repository_created`` or ``repository_deleted``
    event declares (for a retired repository ``known_namespace`` is still its namespace);
    ``retired`` whether the repository was retired (``repository_deleted``). Overlap with other
    repositories' namespaces is the registry's part (:func:`registration_problem`).
    """
    if event_type == ev.RepositoryDeleted.TYPE:  # (a duplicate is fine: retiring is idempotent)
        if known_namespace is None:
            return f"unknown repository {repository!r}"
        if new_namespace != known_namespace:
            return (f"repository {repository!r} has storage namespace {known_namespace!r}, "
                    f"not {new_namespace!r}")
        return None
    if retired:
        if event_type == ev.RepositoryCreated.TYPE:
            return (f"repository {repository!r} was retired: a repository id is never used "
                    "again")
        return f"repository {repository!r} is retired"
    if event_type == ev.RepositoryCreated.TYPE:
        problem = namespace_problem(new_namespace or "")
        if problem:
            return problem
        if known_namespace is not None and new_namespace != known_namespace:
            return (f"repository {repository!r} already exists with storage namespace "
                    f"{known_namespace!r}, not {new_namespace!r}")
        return None
    if known_namespace is None:
        return f"unknown repository {repository!r}"
    for address in addresses:  # the wire form is canonical (schemas/address.py)
        problem = spelling(known_namespace, address).problem
        if problem is not None:
            return problem
    return None


def ttl_ms(event: ev.AddressIssued) -> int:
    return int(event.ttl_seconds * 1000)


# --- the machine -------------------------------------------------------------------------------

def _record(state: RepoState, address: str) -> AddressRecord:
    rec = state.addresses.get(address)
    if rec is None:
        rec = state.addresses[address] = AddressRecord()
    return rec


def _derive(state: RepoState, address: str, rec: AddressRecord, now: int) -> None:
    """Recompute the committed flag and (unless the reaper holds it) the state of an address."""
    live = rec.doubt  # a contradiction keeps, like a live reference (SPEC safety 6)
    for token in rec.unremoved().values():
        ts = state.token_state(token)
        if ts is TokenState.COMMITTED:
            rec.committed = True
        elif ts is None or ts in KEEPING_TOKEN_STATES:
            live = True
    if rec.state in HELD_BY_REAPER:
        # The reaper's state stays, but what references did meanwhile is recorded: when the
        # claim is given back (a refused delete, an expired lease) the address is judged again
        # with its grace restarted from its last reference, never on its original since.
        # (Not queued: the claim's release queues it,
        # tests/integration/schemas/test_liveness_lua.py.)
        if not rec.committed and not live:
            rec.since = now
        return
    if rec.committed or live:
        rec.state = AddressState.COMMITTED if rec.committed else AddressState.STAGED
        rec.since = None
        state.unreferenced.pop(address, None)
    elif rec.issued_until is not None and rec.issued_until > now:
        rec.state = AddressState.ISSUED
        rec.since = rec.issued_until
        state.unreferenced[address] = rec.issued_until
    else:
        rec.state = AddressState.UNREFERENCED
        rec.since = now
        state.unreferenced[address] = now


def _contradiction(state: RepoState, address: str, rec: AddressRecord, ref: str, token: str,
                   event: ev.Event, now: int, out: Outcome) -> None:
    """A reference id is one entry of one token: an event naming it with another token than
    an earlier add or remove did (a reused id, a misrouted or forged event) proves nothing
    about which entry ended. The address is kept for good (sticky ``doubt``), with one
    incident. Whether some event pair disagrees does not depend on their order."""
    if rec.doubt:
        return
    if rec.adds.get(ref, token) != token or rec.removes.get(ref, token) != token:
        rec.doubt = True
        out.incidents.append(Incident(state.repository, address, event.event_id, event.TYPE,
                                      ref, now, REF_DOUBT, token))


def _add(state: RepoState, address: str, ref: str, token: str, size: int, event: ev.Event,
         now: int, out: Outcome) -> None:
    rec = _record(state, address)
    _contradiction(state, address, rec, ref, token, event, now, out)
    cur = rec.adds.get(ref)
    # The least token named is recorded (any order ends in the same record); every token
    # named indexes the address.
    if cur is None or token < cur:
        rec.adds[ref] = token
    state.token_addresses.setdefault(token, set()).add(address)
    if rec.size is None or size > rec.size:
        rec.size = size
    if (cur is None and rec.state in HELD_BY_REAPER and ref not in rec.removes
            and state.token_state(token) is not TokenState.DROPPED):
        out.incidents.append(Incident(state.repository, address, event.event_id, event.TYPE,
                                      ref, now))
    _derive(state, address, rec, now)


def _remove(state: RepoState, address: str, ref: str, token: str, event: ev.Event, now: int,
            out: Outcome) -> None:
    rec = _record(state, address)
    _contradiction(state, address, rec, ref, token, event, now, out)
    cur = rec.removes.get(ref)
    if cur is None or token < cur:  # the least token named, as for adds
        rec.removes[ref] = token
    _derive(state, address, rec, now)


def _claim_token(state: RepoState, token: str, branch: str, event: ev.Event, now: int,
                 out: Outcome) -> None:
    """A branch event names ``token`` as ``branch``'s (open, sealed, committed or dropped).
    A token belongs to one branch: named by a second one (a misrouted or forged drop), it is
    contested: ``doubt``, which outranks dropped, so no branch event can end its references
    whatever the order (SPEC safety 1, 5, 6); one incident."""
    cur = state.token_owners.get(token)
    if cur is None:
        state.token_owners[token] = branch
    elif cur and cur != branch:
        state.token_owners[token] = ""
        out.incidents.append(Incident(state.repository, "", event.event_id, event.TYPE, "",
                                      now, TOKEN_CONTESTED, token))
        _set_token(state, token, TokenState.DOUBT, event, now, out)


def _set_token(state: RepoState, token: str, new: TokenState, event: ev.Event, now: int,
               out: Outcome) -> None:
    cur = state.token_state(token)
    if cur is not None and TOKEN_RANK[new] <= TOKEN_RANK[cur]:
        return
    state.tokens[token] = (new, now)
    resurrected = cur is TokenState.DROPPED and new in (TokenState.COMMITTED, TokenState.DOUBT)
    for address in sorted(state.token_addresses.get(token, ())):
        rec = state.addresses[address]
        if resurrected and rec.state in HELD_BY_REAPER:
            # A commit took (or a contest kept) a reference whose token had been dropped and
            # whose address the reaper already holds: live data is (being) deleted.
            for ref, tok in rec.unremoved().items():
                if tok == token:
                    out.incidents.append(Incident(state.repository, address, event.event_id,
                                                  event.TYPE, ref, now))
        _derive(state, address, rec, now)


def _reaped(state: RepoState, address: str, event: ev.Event, now: int, out: Outcome) -> None:
    """The reaper's log record of a confirmed delete. Redis normally says so already (the
    reaper marks it after publishing); if it does not, Redis lost the reaper's work (restored
    from an older copy): the address becomes reaped again, and each reference that would keep
    it is an incident - the data is gone. Dropped tokens keep nothing."""
    rec = _record(state, address)
    if rec.state in HELD_BY_REAPER:
        return  # the reaper's own record (its claim or tombstone) stands
    for ref, token in sorted(rec.unremoved().items()):
        if state.token_state(token) is not TokenState.DROPPED:
            out.incidents.append(Incident(state.repository, address, event.event_id,
                                          event.TYPE, ref, now))
    rec.state = AddressState.REAPED
    rec.since = None
    rec.reaped_at = now
    state.unreferenced.pop(address, None)


def _newer(state: RepoState, ref: str, version: int) -> bool:
    """True if ``version`` is above the ref's recorded one (and record it), False if not (a
    stale or duplicate event: the ref does not change)."""
    cur = state.ref_versions.get(ref)
    if cur is not None and version <= cur:
        return False
    state.ref_versions[ref] = version
    return True


def _duplicate(state: RepoState, event_id: str, ref: str, version: int) -> bool:
    """Whether this ref event was seen within the window (same id, ref and version); else it
    is remembered, the oldest id leaving once the window is full."""
    mark = f"{ref}|{version}"
    seen = state.ref_seen.get(event_id)
    if seen is not None:
        if seen == mark:
            state.ref_duplicates += 1
            return True
        state.ref_ids_reused += 1
        return False
    state.ref_seen[event_id] = mark
    if len(state.ref_seen) > REF_DEDUPE_WINDOW:
        del state.ref_seen[next(iter(state.ref_seen))]
    return False


def _fresh(state: RepoState, event: ev.Event, ref: str, version: int) -> bool:
    """Whether a ref event changes its ref: not a duplicate, and above the ref's version."""
    if _duplicate(state, event.event_id, ref, version):
        return False
    return _newer(state, ref, version)


def apply(state: RepoState, event: ev.Event, now_ms: int) -> Outcome:
    """Apply one event to one repository's state at tracker time ``now_ms``."""
    out = Outcome()
    known = state.meta.namespace if state.meta else None
    new_ns = (event.storage_namespace
              if isinstance(event, ev.RepositoryCreated | ev.RepositoryDeleted) else None)
    problem = admission_problem(event.repository, event.TYPE, addresses_of(event), known, new_ns,
                                state.retired_at is not None)
    if problem:
        out.rejected = problem
        return out
    now = now_ms
    if state.retired_at is not None:
        return out  # (only a duplicate repository_deleted gets here: nothing changes)
    if isinstance(event, ev.RepositoryCreated):
        if state.meta is None:
            state.meta = RepoMeta(event.storage_namespace, event.default_branch,
                                  event.default_retention_days,
                                  dict(event.branch_retention_days))
    elif isinstance(event, ev.RepositoryDeleted):
        # Nothing of a retired repository may be deleted online: its queue goes (the reaper's
        # claims too, in Redis). Its records stay, for explain.
        state.retired_at = now
        state.unreferenced.clear()
    elif isinstance(event, ev.ObjectWritten | ev.ObjectCopied):
        _add(state, event.address, event.ref_id, event.staging_token, event.size, event, now,
             out)
        if event.replaces_ref_id is not None and event.replaces_address is not None:
            _remove(state, event.replaces_address, event.replaces_ref_id, event.staging_token,
                    event, now, out)
    elif isinstance(event, ev.ObjectDeleted):
        _remove(state, event.address, event.ref_id, event.staging_token, event, now, out)
    elif isinstance(event, ev.AddressIssued):
        rec = _record(state, event.address)
        if rec.issued_until is None:
            rec.issued_until = now + ttl_ms(event)
        _derive(state, event.address, rec, now)
    elif isinstance(event, ev.BranchCreated):
        fresh = _fresh(state, event, "b:" + event.branch, event.ref_version)
        _claim_token(state, event.staging_token, event.branch, event, now, out)
        _set_token(state, event.staging_token, TokenState.OPEN, event, now, out)
        if fresh:
            state.branches[event.branch] = BranchRecord(event.source_commit, event.staging_token)
    elif isinstance(event, ev.CommitCreated):
        fresh = _fresh(state, event, "b:" + event.branch, event.ref_version)
        for token in (*event.sealed_tokens, event.staging_token):
            _claim_token(state, token, event.branch, event, now, out)
        for token in event.sealed_tokens:
            _set_token(state, token, TokenState.COMMITTED, event, now, out)
        _set_token(state, event.staging_token, TokenState.OPEN, event, now, out)
        state.commits.setdefault(event.commit_id, CommitRecord(
            tuple(event.parents), event.committed_at, event.branch, event.manifest))
        if fresh:
            state.branches[event.branch] = BranchRecord(event.commit_id, event.staging_token)
    elif isinstance(event, ev.BranchReset):
        fresh = _fresh(state, event, "b:" + event.branch, event.ref_version)
        for token in (*event.dropped_tokens, event.staging_token):
            _claim_token(state, token, event.branch, event, now, out)
        for token in event.dropped_tokens:
            _set_token(state, token, TokenState.DROPPED, event, now, out)
        _set_token(state, event.staging_token, TokenState.OPEN, event, now, out)
        if fresh:
            state.branches[event.branch] = BranchRecord(event.head, event.staging_token)
    elif isinstance(event, ev.BranchDeleted):
        fresh = _fresh(state, event, "b:" + event.branch, event.ref_version)
        for token in event.dropped_tokens:
            _claim_token(state, token, event.branch, event, now, out)
        for token in event.dropped_tokens:
            _set_token(state, token, TokenState.DROPPED, event, now, out)
        if fresh:
            state.branches.pop(event.branch, None)
    elif isinstance(event, ev.TagCreated):
        if _fresh(state, event, "t:" + event.tag, event.ref_version):
            state.tags[event.tag] = event.commit_id
    elif isinstance(event, ev.TagDeleted):
        if _fresh(state, event, "t:" + event.tag, event.ref_version):
            state.tags.pop(event.tag, None)
    elif isinstance(event, ev.AddressesReaped):
        for address in event.addresses:
            _reaped(state, address, event, now, out)
    else:  # pragma: no cover - decode() only produces the types above
        raise TypeError(f"unhandled event type {event.TYPE}")
    state.incidents.extend(out.incidents)
    return out


@dataclass(frozen=True, order=True)
class RefusedRepository:
    """An incident without a live repository: a ``repository_created`` the tracker refused
    (namespace overlap, retired id, another namespace...). Kept in ``hd:incidents``."""

    repository: str
    namespace: str
    reason: str
    event_id: str
    at_ms: int


@dataclass
class World:
    """Every repository's state and the namespace registry: what the whole tracker maintains
    (for tests and the model)."""

    repos: dict[str, RepoState] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)  # hd:namespaces: ns -> live repo
    refused: list[RefusedRepository] = field(default_factory=list)  # hd:incidents
    retiring: list[tuple[str, str]] = field(default_factory=list)  # (repo, ns) until settle()
    refused_events: dict[str, str] = field(default_factory=dict)  # hd:refused: event id -> why

    def apply(self, event: ev.Event, now_ms: int) -> Outcome:
        state = self.repos.get(event.repository)
        if isinstance(event, ev.RepositoryCreated):
            return self._create(state, event, now_ms)
        if state is None:
            return Outcome(rejected=f"unknown repository {event.repository!r}")
        live = state.retired_at is None
        out = apply(state, event, now_ms)
        if (isinstance(event, ev.RepositoryDeleted) and live and out.rejected is None
                and state.meta is not None):
            self.retiring.append((event.repository, state.meta.namespace))
        return out

    def _create(self, state: RepoState | None, event: ev.RepositoryCreated,
                now_ms: int) -> Outcome:
        repo, ns = event.repository, event.storage_namespace
        known = state.meta.namespace if state and state.meta else None
        problem = self.refused_events.get(event.event_id) or admission_problem(
            repo, event.TYPE, [], known, ns, state is not None and state.retired_at is not None)
        if problem is None:
            problem = registration_problem(self.namespaces, repo, ns)
        if problem is not None:
            self.refused_events[event.event_id] = problem
            self.refused.append(RefusedRepository(repo, ns, problem, event.event_id, now_ms))
            return Outcome(rejected=problem)
        self.namespaces[ns] = repo
        if state is None:
            state = self.repos[repo] = RepoState(repo)
        return apply(state, event, now_ms)

    def settle(self) -> None:
        """The tracker finished applying a batch. A retired repository keeps its namespace
        registered while its data is kept (``reconciler/retirement.py``): nothing to free."""
        self.retiring.clear()

    def release(self, repo: str) -> None:
        """A retired repository's data was purged: its namespace may be registered again."""
        for ns, owner in list(self.namespaces.items()):
            if owner == repo and self.repos[repo].retired_at is not None:
                del self.namespaces[ns]


def live_refs(state: RepoState, address: str) -> dict[str, str]:
    """The live references of an address: ref -> token."""
    rec = state.addresses.get(address)
    if rec is None:
        return {}
    out = {}
    for ref, token in rec.unremoved().items():
        ts = state.token_state(token)
        if ts is None or ts in KEEPING_TOKEN_STATES:
            out[ref] = token
    return out
