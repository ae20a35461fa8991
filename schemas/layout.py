"""Redis record layout: the one place that names every key the components share.

Every key of a repository carries the hash tag ``{repo}`` so that all of a repository's keys
live in one Redis Cluster slot and one server-side script can update them atomically. Times are
integer milliseconds of the Redis server clock (``TIME``), the one clock no publisher controls.
See schemas/README.md for the meaning of each record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

PREFIX = "hd"

# Global keys (not repository-scoped).
REPOS = f"{PREFIX}:repos"  # set of repository ids
PROGRESS = f"{PREFIX}:progress"  # hash: partition -> ms up to which the broker's content is applied
PROGRESS_META = f"{PREFIX}:progress:meta"  # hash: topic, partitions (count), verified_ms
# What the tracker has applied, per partition of the events topic, with the identity of the log:
# field "<topic>:<partition>" -> "<epoch>:<offset>:<fingerprint>", or "<epoch>:<offset>:@<at>.<fp>"
# for a log known by its anchor record (tracker/logid.py). Written
# after the repository chunks of a batch; a new epoch is minted when the log was reset/re-created.
LOG = f"{PREFIX}:log"
# Redis Cluster only: the tracker's copy of each repository's applied[] (repository -> json
# {partition: "<epoch>:<offset>"}), written after each chunk and merged per partition
# (tracker.state.APPLIED_MERGE_LUA: two trackers never undo each other's). It shares hd:log's
# slot (its hash tag), so it goes back only with hd:log, which the tracker sees and replays
# from. A repository's node that goes back in time (a failover to a stale replica) is seen
# against it: by the tracker's next chunk after a restart, and by every delete path's gate
# even when no event of the repository comes (core.gate.applied_regression).
APPLIED = f"{PREFIX}:applied{{{LOG}}}"
INCIDENTS = f"{PREFIX}:incidents"  # list: json incidents not tied to one repository
RECONCILER_LEASE = f"{PREFIX}:reconciler:lease:"  # + repo: string with run id, PX lease
# `hardelete schedule`: hash last_attempt_ms, last_exit, last_success_ms, last_error (operators)
RECONCILER_SCHEDULE = f"{PREFIX}:reconciler:schedule"
# Namespace ownership (Safety I): live namespace -> repository id; a namespace that equals,
# contains or lies inside a registered one is refused. Retired repository ids are never reused.
NAMESPACES = f"{PREFIX}:namespaces"  # hash: namespace -> repository id (live repositories only)
RETIRED = f"{PREFIX}:retired"  # hash: repository id -> json {namespace, at_ms, event_id}
# A refused repository_created stays refused on every later delivery of the same event (a
# redelivery after a crash, a duplicate), whatever changed since: a decision on an event is
# final, so the outcome never depends on batching or redelivery.
REAPER_KEY = f"{PREFIX}:reaperkey"  # string: the key that signs addresses_reaped (reaper_auth)
FACT_KEY = f"{PREFIX}:factkey"  # string: the key that signs durable facts (core/facts.py)
REFUSED = f"{PREFIX}:refused"  # hash: event id of a refused repository_created -> reason
# Incidents that belong to no live repository (a repository_created refused because its
# namespace overlaps a live one's, or because its id was retired): json, newest last.
INCIDENTS = f"{PREFIX}:incidents"  # list: json {kind, repository, reason, event_id, at_ms, ...}
# `hardelete incidents ack`: how many of each incident list a person has looked at ("*": the
# list above, else a repository id); `status` counts the ones after as needing a person.
INCIDENTS_ACKED = f"{PREFIX}:incidents:acked"  # hash: scope -> json {count, by, reason, at_ms}
# The whole mirror is unproven (e.g. Redis lost everything while the group has offsets): every
# repository is fail-closed until an operator clears it. Field "reason" (and detail fields).
FAIL_CLOSED = f"{PREFIX}:failclosed"  # hash: reason, at_ms, detail (present = fail-closed)


# Ref events (branch/tag created/deleted, commit created, branch reset) whose event id the
# tracker remembers per repository, with the ref and version each carried (RepoKeys.ref_seen):
# a redelivery or a retried publish within this many later ref events of the repository is
# recognised as a duplicate by its id. Beyond it, ref_version alone keeps the outcome (a
# duplicate's version is never above the ref's). apply.lua's WINDOW is the same number.
REF_DEDUPE_WINDOW = 10_000
DEAD_SEQS_MAX = 1_000  # notes of dead-lettered seqs kept per repository (RepoKeys.dead_seqs)


class AddressState(StrEnum):
    STAGED = "staged"  # at least one live reference in an open/sealed (or unknown) token
    COMMITTED = "committed"  # a commit took it: terminal for the online path, never reaped online
    ISSUED = "issued"  # an issued upload address not yet expired, no live reference
    UNREFERENCED = "unreferenced"  # no live reference since `since`: a reaping candidate
    REAPING = "reaping"  # claimed by a reaper until `lease_until`
    REAPED = "reaped"  # deleted from the store at `reaped_at` (tombstone, kept tombstone_days)


class TokenState(StrEnum):
    OPEN = "open"
    SEALED = "sealed"
    DROPPED = "dropped"
    # Named by two branches' events (a misrouted or forged drop/seal): kept, never dropped
    # (SPEC safety 6); only a commit moves it on.
    DOUBT = "doubt"
    COMMITTED = "committed"


# Token states only move up this rank (duplicates/reordering cannot move them back); committed
# outranks dropped because, when in doubt, keeping wins.
TOKEN_RANK = {TokenState.OPEN: 0, TokenState.SEALED: 1, TokenState.DROPPED: 2,
              TokenState.DOUBT: 3, TokenState.COMMITTED: 4}
LIVE_TOKEN_STATES = frozenset({TokenState.OPEN, TokenState.SEALED})

# Reserved metadata prefixes inside a storage namespace: nothing under them is ever deleted by
# the reaper or the reconciler's sweep.
META_PREFIX = "_hardelete/"
MANIFESTS_PREFIX = META_PREFIX + "manifests/"
REPORTS_PREFIX = META_PREFIX + "reports/"
QUARANTINE_PREFIX = META_PREFIX + "quarantine/"
RESERVED_PREFIXES = (META_PREFIX, "_lakefs/")
DATA_PREFIX = "data/"

# Fields of an address hash that are not references.
F_STATE, F_SINCE, F_COMMITTED, F_ISSUED_UNTIL, F_SIZE = "state", "since", "committed", "iu", "size"
F_LEASE_UNTIL, F_CLAIMER, F_REAPED_AT = "lease_until", "claimer", "reaped_at"
# Sticky: a reference id of this address was named with two tokens (a contract breach): kept.
F_DOUBT = "doubt"
REF_ADD, REF_REMOVE = "+", "-"  # address hash fields "+<ref_id>" / "-<ref_id>" -> token


_KEY_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def key_part(name: str) -> str:
    """A repository id as it appears in Redis keys: every byte of its UTF-8 outside
    ``[A-Za-z0-9._-]`` written ``%XX``. Injective (``%`` itself is escaped), and it leaves no
    ``{``, ``}`` or ``:`` that could close the hash tag early or reach another repository's
    key prefix (``hd:{<victim>}:a:...``); ordinary ids are unchanged."""
    raw = name.encode("utf-8", "surrogatepass")
    if all(b in _KEY_SAFE for b in raw):
        return name
    return "".join(chr(b) if b in _KEY_SAFE else f"%{b:02X}" for b in raw)


@dataclass(frozen=True, slots=True)
class RepoKeys:
    """Key names for one repository. The id is encoded (:func:`key_part`); what follows the
    tag (addresses, tokens) sits after a fixed ``:a:``/``:t:`` part, so it cannot reach
    another key kind or another repository."""

    repo: str

    @property
    def tag(self) -> str:
        return f"{PREFIX}:{{{key_part(self.repo)}}}"

    def address(self, address: str) -> str:
        """hash: +ref -> token, -ref -> token, state, since, committed, iu, size, lease..."""
        return f"{self.tag}:a:{address}"

    def token_addresses(self, token: str) -> str:
        """set: addresses that have a reference in this staging token."""
        return f"{self.tag}:t:{token}"

    @property
    def meta(self) -> str:
        """hash: namespace (canonical), default_branch, default_retention_days,
        branch_retention (json); once retired also retired_at (ms), retired_event."""
        return f"{self.tag}:repo"

    @property
    def tokens(self) -> str:
        """hash: token -> '<state>:<ms>'."""
        return f"{self.tag}:tokens"

    @property
    def branches(self) -> str:
        """hash: branch -> json {head, staging_token, sealed_tokens}."""
        return f"{self.tag}:branches"

    @property
    def ref_versions(self) -> str:
        """hash: 'b:<branch>' / 't:<tag>' -> highest ref_version applied (deletes included:
        a versioned tombstone, so a late lower-versioned event cannot resurrect the ref)."""
        return f"{self.tag}:refver"

    @property
    def token_owners(self) -> str:
        """hash: token -> the branch whose events name it ('' once two branches did: the
        token is contested, state ``doubt``)."""
        return f"{self.tag}:tokowner"

    @property
    def ref_seen(self) -> str:
        """hash: ref event id -> '<ref>|<version>' for the last REF_DEDUPE_WINDOW ref events
        (the dedupe window: the same id, ref and version again is a duplicate)."""
        return f"{self.tag}:refseen"

    @property
    def ref_seen_order(self) -> str:
        """list: the ids of ``ref_seen``, oldest first (the oldest leaves a full window)."""
        return f"{self.tag}:refseenq"

    @property
    def commits(self) -> str:
        """hash: commit id -> json {parents, time, branch, manifest}."""
        return f"{self.tag}:commits"

    @property
    def tags(self) -> str:
        """hash: tag -> commit id."""
        return f"{self.tag}:tags"

    @property
    def unreferenced(self) -> str:
        """zset: address -> ms it became unreferenced (or its issued upload expires)."""
        return f"{self.tag}:unref"

    @property
    def claims(self) -> str:
        """zset: address -> lease expiry ms of a reaper's claim."""
        return f"{self.tag}:claims"

    @property
    def reaped(self) -> str:
        """zset: address -> ms reaped (tombstones, pruned after tombstone_days)."""
        return f"{self.tag}:reaped"

    @property
    def incidents(self) -> str:
        """list: json incidents (reference for an address already reaped or being reaped)."""
        return f"{self.tag}:incidents"

    @property
    def stats(self) -> str:
        """hash: counters (events, incidents, reaped, reaped_bytes ...)."""
        return f"{self.tag}:stats"

    @property
    def applied(self) -> str:
        """hash: partition -> "<epoch>:<offset>": last applied offset of the log identified by
        epoch (makes redelivery a no-op; a record of another log skips nothing)."""
        return f"{self.tag}:applied"

    @property
    def fail_closed(self) -> str:
        """hash: reason, at_ms, detail. Present: the mirror of this repository is not proven
        complete and current; the reaper deletes nothing and the reconciler marks nothing as
        leaked or unreferenced for it (Safety I) until a rebuild proves it (tracker/rebuild.py)
        or an operator clears it. ``losses`` counts the losses that set or kept it."""
        return f"{self.tag}:failclosed"

    @property
    def rebuild(self) -> str:
        """hash: nonce, at_ms, losses (the flag's counter at the snapshot): a rebuild prepared
        (tracker/rebuild.py); the nonce is written last, after the snapshot."""
        return f"{self.tag}:rebuild"

    @property
    def rebuild_snapshot(self) -> str:
        """string: json of the mirror's live references, tokens, branches and tags at the
        rebuild's snapshot (tracker/rebuild.py)."""
        return f"{self.tag}:rebuild:snapshot"

    @property
    def holds(self) -> str:
        """hash: address -> json {claims: {claim id -> {reason, source, at_ms, ...}}, reason,
        source, at_ms}: every delete path keeps a held address (dead-lettered events naming it,
        legal holds, restores); the hold goes with its last claim (schemas/holds.py)."""
        return f"{self.tag}:holds"

    @property
    def hold_prefixes(self) -> str:
        """hash: key prefix (full s3:// form) -> json, as ``holds``: every address under the
        prefix is held (few entries: delete paths read the whole hash)."""
        return f"{self.tag}:holdprefixes"

    def mark_seal(self, run_id: str) -> str:
        """string: the reconciler's seal of one run's mark (its parts and their ETags, the
        marked count), written when the mark is; ``--sweep-only`` sweeps only a mark whose
        stored summary and parts still match it. Expires with the mark's usable age."""
        return f"{self.tag}:markseal:{run_id}"

    def keep_seal(self, run_id: str) -> str:
        """string: the reconciler's seal of one run's stored committed keep-set (the digest
        of its ``keepset.json``, which names its parts and their ETags); an optimized run
        reuses only a keep-set whose descriptor still gives it. Expires after 8 days."""
        return f"{self.tag}:keepseal:{run_id}"

    @property
    def facts_owed(self) -> str:
        """set: json [hash, target, claim id, claim]: hold claims placed in Redis only because
        the repository's fact log refused them (S3 down); the gate keeps the repository while
        any is owed, and the next proof writes them (``core/facts.py``)."""
        return f"{self.tag}:factsowed"

    @property
    def facts_seq(self) -> str:
        """string: the sequence number of the last durable fact of the repository (its holds and
        pauses, ``core/facts.py``) this Redis copy has applied; in the slot of the copy, so the
        two go back together and a delete path sees that the copy is behind its durable home."""
        return f"{self.tag}:factseq"

    @property
    def paused(self) -> str:
        """string: json {reason, at_ms}. Present: the reaper and the sweep skip the repository."""
        return f"{self.tag}:paused"

    # Continuity (core/continuity.py, core/continuity.lua): per stripe k of the repository's
    # ordering domain, three keys in its slot, written only by the continuity script.
    def continuity(self, stripe: int) -> str:
        """hash: inc (the incarnation), prefix (every seq up to it applied; absent: 0),
        horizon (ms: every event committed before it is applied; absent: none), broken (the
        reason; present: the stripe applies nothing and has no horizon)."""
        return f"{self.tag}:cont:{_stripe(stripe)}"

    def continuity_above(self, stripe: int) -> str:
        """zset: the seqs applied above the prefix (member and score the seq)."""
        return f"{self.tag}:above:{_stripe(stripe)}"

    def continuity_watermarks(self, stripe: int) -> str:
        """zset: the pending watermarks, member ``'<M>:<R>'``, score M (M > prefix; M and R
        both strictly increasing; at most ``core.continuity.PENDING_MAX``)."""
        return f"{self.tag}:wm:{_stripe(stripe)}"

    @property
    def dead_seqs(self) -> str:
        """hash: ``'<k>:<seq>'`` -> JSON {dlq, reason, event_id}: a sequenced event of stripe
        k the tracker dead-lettered, so its seq stays missing (status says which dead letter
        holds the horizon). Informational; the Ticker drops an entry once the prefix passes
        its seq; at most DEAD_SEQS_MAX entries (a writer of the events topic could make up
        seqs)."""
        return f"{self.tag}:deadseq"

    @property
    def clock(self) -> str:
        """The slot's clock (``core.continuity.slot_clock``): the highest TIME its scripts
        read; every since and tick comes from ``max(TIME, clock)``."""
        return f"{self.tag}:clock"

    @property
    def address_prefix(self) -> str:
        return f"{self.tag}:a:"


# A repository declares 1..STRIPES_MAX ordering stripes (repository_created.stripes).
STRIPES_MAX = 64


def _stripe(stripe: int) -> int:
    if isinstance(stripe, bool) or not isinstance(stripe, int) or not 0 <= stripe < STRIPES_MAX:
        raise ValueError(f"stripe must be an integer in 0..{STRIPES_MAX - 1}, got {stripe!r}")
    return stripe


class OutsideNamespace(ValueError):
    """An address that must never be deleted: outside the namespace or under a reserved prefix."""


def namespace_key(namespace: str, address: str) -> str:
    """The key (relative to the namespace) of an address that may be deleted, else raise.

    Every delete path (reaper, quarantine, sweep) and the tracker's admission check call this one
    function, so a bad event can never steer a delete outside ``namespace`` or into metadata.
    """
    if not namespace.startswith("s3://") or not namespace.endswith("/"):
        raise OutsideNamespace(f"namespace {namespace!r} must be s3://bucket/prefix/")
    if not address.startswith(namespace):
        raise OutsideNamespace(f"{address!r} is outside namespace {namespace!r}")
    rel = address[len(namespace):]
    if not rel or rel.startswith("/") or "//" in rel or any(
        part in (".", "..") for part in rel.split("/")
    ):
        raise OutsideNamespace(f"{address!r} is not a plain object key under {namespace!r}")
    if any(rel.startswith(p) for p in RESERVED_PREFIXES):
        raise OutsideNamespace(f"{address!r} is under a reserved metadata prefix")
    return rel
