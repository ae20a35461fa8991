"""An adversary in the property tests (issue 19, item 10).

A hypothesis rule-based state machine over the pure parts: the reference machine
(``tracker.references``), the one judgment (``schemas.liveness.judge``), the reaper's claims,
releases and prune, the reconciler's sweep decision, and Redis going back in time. Its rules
include what an adversary can do: a publisher with rights to one repository sends any
schema-valid event (forged ``addresses_reaped`` records, duplicates, late and reordered
deliveries, tags moved and duplicated, hostile repository ids), an operator pauses, holds,
restores from quarantine, purges the quarantine, retires the repository (and a new one asks for
its namespace), purges what retirement kept and resolves dead letters (after replaying their
fix; a hold is the product's set of claims, ``schemas.holds``), and the daemons' steps
interleave (claim, re-check right before the request, a refused request, lease expiry and
release, quarantine copy, prune, sweep, the quarantine purge's and the retired purge's own
gate decisions: ``reaper.quarantine.purge_keeps``, ``reconciler.retirement.guard_keeps``).

The invariant, checked at every delete: **nothing is deleted while anything protects it**, where
protection is computed by an oracle of its own from what the service really did (a live
reference in a token that is not dropped, an unexpired issued upload, less than the grace window
since a reference last ended or the address was first named, a hold, a pause, fail-closed,
and for a retired repository its retention instead of its references), never from the
tracker's records. A quarantine copy is protected like its object while it is the last copy.
The oracle ignores ``addresses_reaped`` entirely: no event can vouch for a deletion. Two more
invariants: refs (tags, the branch's staging token) converge to what the service did whatever
the duplicates and the order, and no Redis key of one repository lies under another's.
"""

from __future__ import annotations

import copy
import dataclasses
import urllib.parse
from dataclasses import dataclass, field

import orjson
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from core.gate import Evidence, Gate
from reaper.quarantine import purge_keeps
from reconciler.retirement import Retired, guard_keeps, purge_due
from schemas import events as ev
from schemas import holds, reaper_auth
from schemas.layout import AddressState, RepoKeys, TokenState
from schemas.liveness import Guards, judge, tombstone_keeps
from schemas.namespaces import ownership_problem
from schemas.records import AddressRecord
from tracker import codec
from tracker import references as refs

REPO = "r"
NS = "s3://bucket/repo/"
GRACE = 10_000  # ms
LEASE = 5_000
TOMBSTONE = 20_000
TTL = 30.0  # s, issued uploads
REAPER = "reaper-1"
REAPER_KEY = b"the reaper's key, which no publisher holds"
QUARANTINE = 15_000  # ms a reaped object's quarantine copy is kept
RETAIN = 60_000  # ms a retired repository's data is kept
RETAIN_DAYS = RETAIN / 86_400_000
SUCCESSOR = "r-next"  # a new repository asking for the retired one's namespace
HOSTILE_IDS = ["r}:a:" + NS + "data/0", "r}", "{r}", "r:a", "r}:t:t0", "ř\u0000}", "r" * 1000]


# --- the oracle: what the service really did -------------------------------------------------

@dataclass
class Truth:
    """The service's ground truth, folded from every delivered event except reaper records."""

    adds: dict[str, dict[str, str]] = field(default_factory=dict)  # address -> ref -> token
    removes: dict[str, set[str]] = field(default_factory=dict)  # address -> refs removed
    tokens: dict[str, TokenState] = field(default_factory=dict)
    issued_until: dict[str, int] = field(default_factory=dict)
    last_end: dict[str, int] = field(default_factory=dict)  # address -> ms a reference ended
    rank = {TokenState.OPEN: 0, TokenState.SEALED: 1, TokenState.DROPPED: 2,
            TokenState.COMMITTED: 3}

    def _live(self, address: str) -> set[str]:
        out = set()
        for ref, tok in self.adds.get(address, {}).items():
            if ref in self.removes.get(address, set()):
                continue
            if self.tokens.get(tok) is not TokenState.DROPPED:
                out.add(ref)
        return out

    def _touch(self, address: str, now: int) -> None:
        self.last_end.setdefault(address, now)

    def apply(self, event: ev.Event, now: int) -> None:
        for name in ("address", "replaces_address"):
            spelled = getattr(event, name, None)
            if spelled is not None and spelled not in ADDRS:
                # Another spelling: the service meant one of the objects it may name.
                for address in meanings(spelled):
                    self.apply(dataclasses.replace(event, **{name: address}), now)
                return
        if isinstance(event, ev.AddressesReaped):
            return  # only the reaper says this; it is never evidence of anything
        if isinstance(event, ev.ObjectWritten | ev.ObjectCopied):
            self._touch(event.address, now)
            self.adds.setdefault(event.address, {}).setdefault(event.ref_id,
                                                               event.staging_token)
            if event.replaces_ref_id is not None and event.replaces_address is not None:
                self._remove(event.replaces_address, event.replaces_ref_id, now)
        elif isinstance(event, ev.ObjectDeleted):
            self._remove(event.address, event.ref_id, now)
        elif isinstance(event, ev.AddressIssued):
            self._touch(event.address, now)
            self.issued_until.setdefault(event.address, now + int(event.ttl_seconds * 1000))
        elif isinstance(event, ev.CommitCreated):
            for t in event.sealed_tokens:
                self._token(t, TokenState.COMMITTED, now)
            self._token(event.staging_token, TokenState.OPEN, now)
        elif isinstance(event, ev.BranchReset | ev.BranchDeleted):
            for t in event.dropped_tokens:
                self._token(t, TokenState.DROPPED, now)
            if isinstance(event, ev.BranchReset):
                self._token(event.staging_token, TokenState.OPEN, now)
        elif isinstance(event, ev.BranchCreated):
            self._token(event.staging_token, TokenState.OPEN, now)

    def _remove(self, address: str, ref: str, now: int) -> None:
        self._touch(address, now)
        if ref in self._live(address):
            self.last_end[address] = now
        self.removes.setdefault(address, set()).add(ref)

    def _token(self, token: str, state: TokenState, now: int) -> None:
        cur = self.tokens.get(token)
        if cur is not None and self.rank[state] <= self.rank[cur]:
            return
        before = {a: self._live(a) for a in self.adds}
        self.tokens[token] = state
        for a, live in before.items():
            if live and not self._live(a):
                self.last_end[a] = now

    def protection(self, address: str, now: int) -> str | None:
        """Why the service says this object must stay, or None."""
        for ref in self._live(address):
            return f"reference {ref} in a {self.tokens.get(self.adds[address][ref])} token"
        iu = self.issued_until.get(address)
        if iu is not None and iu > now:
            return f"issued upload until {iu}"
        end = self.last_end.get(address)
        if end is not None and now - end < GRACE:
            return f"a reference ended {now - end} ms ago (grace {GRACE})"
        return None


# --- the machine under attack ----------------------------------------------------------------

def decoded(rec: AddressRecord) -> AddressRecord:
    return AddressRecord(adds=dict(rec.adds), removes=dict(rec.removes),
                          state=None if rec.state is None else rec.state.value,
                          since=rec.since, committed=rec.committed,
                          issued_until=rec.issued_until, size=rec.size,
                          lease_until=rec.lease_until, claimer=rec.claimer,
                          reaped_at=rec.reaped_at)


ADDRS = [f"{NS}data/{i}" for i in range(3)]


def spellings(address: str) -> list[str]:
    """Other ways a publisher may write the same object's address."""
    rest = address[len("s3://"):]
    bucket, key = rest.split("/", 1)
    return [f"S3://{rest}", f"s3a://{rest}", f"s3://{bucket.upper()}/{key}",
            f"s3://{bucket}/{key.replace('/', '%2F')}", f"s3://{bucket}/{key.replace('a', '%61')}"]


def meanings(spelled: str) -> list[str]:
    """The objects (canonical addresses of ADDRS) a spelling may name: the oracle protects
    every reading (scheme and bucket name case-insensitive, s3a:// the same store, a key
    either raw or percent-decoded)."""
    scheme, _, rest = spelled.partition("://")
    if scheme.lower() not in ("s3", "s3a", "s3n") or "/" not in rest:
        return []
    bucket, key = rest.split("/", 1)
    keys = {key, urllib.parse.unquote(key)}
    return [a for a in ADDRS if a in {f"s3://{bucket.lower()}/{k}" for k in keys}]
TOKENS = ["t0", "t1", "t2", "t3"]


class Adversary(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.now = 1_000_000
        self.n = 0
        self.world = refs.World()
        self.truth = Truth()
        self.log: list[ev.Event] = []  # what was delivered, in order (the broker's log)
        self.pending: list[ev.Event] = []  # published, not yet delivered (late, reordered)
        self.store: set[str] = set()  # objects that exist
        self.written_at: dict[str, int] = {}
        self.open_token = "t0"
        self.sealed: list[str] = []
        self.entries: dict[str, tuple[str, str]] = {}  # ref -> (address, token): staged refs
        self.paused = False
        self.holds: set[str] = set()  # the operator's
        # placed by the tracker for dead-lettered records: target -> stored value (its claims)
        self.dlq_holds: dict[str, bytes] = {}
        self.dead: dict[str, ev.Event] = {}  # claim id -> dead-lettered event, unresolved
        self.fail_closed = False
        self.snapshot: tuple[refs.World, int] | None = None
        self.applied = 0  # how much of the log the mirror has applied
        self.deletes = 0
        self.quarantine: dict[str, int] = {}  # address -> ms its copy may be purged
        self.retired_at: int | None = None  # the service retired the repository (truth)
        self.released = False  # the retired purge finished: the namespace is free
        self.tags: dict[str, str] = {}  # what the service's tags are
        self._deliver(ev.RepositoryCreated(repository=REPO, event_id=self._id(),
                                           storage_namespace=NS, default_branch="main",
                                           default_retention_days=7.0))
        self._deliver(ev.BranchCreated(repository=REPO, event_id=self._id(), branch="main",
                                       staging_token="t0", source_commit=None, ref_version=0))

    def _id(self) -> str:
        self.n += 1
        return f"e{self.n}"

    def _deliver(self, event: ev.Event) -> None:
        """The tracker's path for one record: the contract's validator, admission, the
        reference machine; a refused record is dead-lettered and what it names is held."""
        self.truth.apply(event, self.now)  # the service did it, whatever the tracker makes of it
        self.log.append(event)
        if self.fail_closed:
            return  # the log guard applies nothing past the gap until the replay
        self._apply(event, len(self.log) - 1)
        self.applied = len(self.log)

    def _apply(self, event: ev.Event, offset: int) -> None:
        raw = ev.encode(event)
        try:
            ev.decode(raw)
        except ev.EventError as exc:
            rejected: str | None = str(exc)
        else:
            if isinstance(event, ev.AddressesReaped) and reaper_auth.problem(
                    REAPER_KEY, codec.parse(raw)):
                rejected = "forged addresses_reaped"  # the tracker verifies the signature
            else:
                rejected = self.world.apply(event, self.now).rejected
                self.world.settle()
        if rejected is not None:  # one claim per dead letter (its place in the log)
            cid = holds.dlq_claim("events", 0, offset)
            self.dead[cid] = event
            for _, target in codec.hold_targets(raw, REPO.encode(), {REPO: NS}):
                self.dlq_holds[target] = orjson.dumps(holds.add(
                    self.dlq_holds.get(target), cid, {"source": "dlq", "reason": rejected}))

    def _publish(self, event: ev.Event, late: bool) -> None:
        if late:
            self.pending.append(event)
        else:
            self._deliver(event)

    @property
    def state(self) -> refs.RepoState:
        return self.world.repos[REPO]

    def _token_states(self) -> dict[str, str | None]:
        return {t: s.value for t, (s, _) in self.state.tokens.items()}

    def _held(self, address: str) -> bool:
        """An operator's hold, or one a dead letter placed (exact, or its namespace prefix)."""
        return address in self.holds or any(
            address == t or (t.endswith("/") and address.startswith(t)) for t in self.dlq_holds)

    def _guards(self, address: str) -> Guards:
        return Guards(fail_closed="redis went back" if self.fail_closed else None,
                      paused="paused" if self.paused else None,
                      held="held" if self._held(address) else None)

    def _judge(self, address: str, path: str, claimer: str | None = None):  # type: ignore[no-untyped-def]
        rec = self.state.addresses.get(address)
        if rec == AddressRecord():
            rec = None  # a pruned (or never written) hash
        return judge(None if rec is None else decoded(rec), self._token_states(),
                     now_ms=self.now, horizon_ms=self.now, grace_ms=GRACE,
                     path=path,  # type: ignore[arg-type]
                     cutoff_ms=self.now - GRACE if path == "reconciler" else None,
                     claimer=claimer, guards=self._guards(address))

    def _protection(self, address: str) -> str | None:
        """Why the object must stay, by the oracle: the service's truth (for a retired
        repository its retention instead: its references died with it), and the guards."""
        if self.retired_at is None:
            why = self.truth.protection(address, self.now)
        elif not self.released and self.now < self.retired_at + RETAIN:
            why = f"retired at {self.retired_at}: its data is kept {RETAIN} ms"
        else:
            why = None
        if self.paused:
            why = why or "paused"
        if self._held(address):
            why = why or "held"
        if self.fail_closed:
            why = why or "fail-closed"
        return why

    def _delete(self, address: str, by: str) -> None:
        why = self._protection(address)
        assert why is None, f"{by} deleted live {address}: {why}"
        self.store.discard(address)
        self.deletes += 1

    def _evidence(self, addresses: list[str]) -> Evidence:
        """What the one evidence reader would read now (core.gate.read_evidence)."""
        exact = {t: "held" for t in self.dlq_holds if not t.endswith("/")}
        exact.update(dict.fromkeys(self.holds, "held"))
        gate = Gate(registry=dict(self.world.namespaces),
                    repo_fail_closed="redis went back" if self.fail_closed else None,
                    paused="paused" if self.paused else None,
                    holds={a: exact[a] for a in addresses if a in exact},
                    hold_prefixes={t: "held" for t in self.dlq_holds if t.endswith("/")})
        records = {}
        for a in addresses:
            rec = self.state.addresses.get(a)
            records[a] = None if rec is None or rec == AddressRecord() else decoded(rec)
        claimed = {a: r is not None and r.state is AddressState.REAPING
                   for a, r in records.items()}
        return Evidence(gate, records, claimed, self._token_states(), self.now)

    # --- the service (honest or not: any schema-valid event of its repository) ---------------

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(i=st.integers(0, len(ADDRS) - 1), late=st.booleans(), ttl=st.booleans())
    def write(self, i: int, late: bool, ttl: bool) -> None:
        address = ADDRS[i]
        if ttl:
            self._publish(ev.AddressIssued(repository=REPO, event_id=self._id(),
                                           address=address, ttl_seconds=TTL), late)
        self.store.add(address)
        self.written_at.setdefault(address, self.now)
        ref = f"ref{self.n}"
        self.entries[ref] = (address, self.open_token)
        self._publish(ev.ObjectWritten(repository=REPO, event_id=self._id(), branch="main",
                                       staging_token=self.open_token, path=f"p{i}",
                                       address=address, size=1, ref_id=ref), late)

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(data=st.data(), late=st.booleans())
    def unstage(self, data: st.DataObject, late: bool) -> None:
        staged = sorted(r for r, (_, t) in self.entries.items() if t == self.open_token)
        if not staged:
            return
        ref = data.draw(st.sampled_from(staged))
        address, token = self.entries.pop(ref)
        self._publish(ev.ObjectDeleted(repository=REPO, event_id=self._id(), branch="main",
                                       staging_token=token, path="p", address=address,
                                       ref_id=ref), late)

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(late=st.booleans())
    def commit(self, late: bool) -> None:
        sealed, new = self.open_token, f"t{self.n + 1}"
        self.open_token = new
        self._publish(ev.CommitCreated(repository=REPO, event_id=self._id(), branch="main",
                                       commit_id=f"c{self.n}", parents=[],
                                       sealed_tokens=[sealed], staging_token=new,
                                       committed_at=self.now / 1000, manifest=f"{NS}m",
                                       ref_version=self.n), late)
        self.entries = {r: v for r, v in self.entries.items() if v[1] != sealed}

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(late=st.booleans())
    def reset(self, late: bool) -> None:
        dropped, new = self.open_token, f"t{self.n + 1}"
        self.open_token = new
        self._publish(ev.BranchReset(repository=REPO, event_id=self._id(), branch="main",
                                     dropped_tokens=[dropped], staging_token=new,
                                     ref_version=self.n), late)
        self.entries = {r: v for r, v in self.entries.items() if v[1] != dropped}

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(i=st.integers(0, len(ADDRS) - 1))
    def touch(self, i: int) -> None:
        """A reference comes and goes: a shallow copy to the address, then its delete."""
        address, ref = ADDRS[i], f"ref{self.n}"
        self.store.add(address)  # (the copy's source exists)
        self.written_at.setdefault(address, self.now)
        self._deliver(ev.ObjectCopied(repository=REPO, event_id=self._id(), branch="main",
                                      staging_token=self.open_token, path="copy",
                                      address=address, size=1, ref_id=ref,
                                      source_read_at=self.now / 1000))
        self._deliver(ev.ObjectDeleted(repository=REPO, event_id=self._id(), branch="main",
                                       staging_token=self.open_token, path="copy",
                                       address=address, ref_id=ref))

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(i=st.integers(0, len(ADDRS) - 1), how=st.integers(0, 4), late=st.booleans())
    def write_spelled(self, i: int, how: int, late: bool) -> None:
        """The same object written under another spelling of its address."""
        address = ADDRS[i]
        self.store.add(address)
        self.written_at.setdefault(address, self.now)
        ref = f"ref{self.n}"
        self._publish(ev.ObjectWritten(repository=REPO, event_id=self._id(), branch="main",
                                       staging_token=self.open_token, path=f"s{i}",
                                       address=spellings(address)[how], size=1, ref_id=ref),
                      late)

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(addrs=st.lists(st.sampled_from(ADDRS), min_size=1, max_size=3, unique=True))
    def forge_reaped(self, addrs: list[str]) -> None:
        """A publisher claims the reaper deleted these (it did not)."""
        self._deliver(ev.AddressesReaped(repository=REPO, event_id=self._id(),
                                         addresses=addrs, reaper="mallory"))

    @precondition(lambda self: not self.released)  # (a purged repository says nothing)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        self._deliver(data.draw(st.sampled_from(self.log)))

    @precondition(lambda self: bool(self.pending) and not self.released)
    @rule(data=st.data())
    def deliver_late(self, data: st.DataObject) -> None:
        order = data.draw(st.permutations(self.pending))
        self.pending = []
        for event in order:
            self._deliver(event)

    @precondition(lambda self: not self.pending)  # late means within one grace window
    @rule(ms=st.sampled_from([500, 3_000, 6_000, 11_000, 40_000]))
    def tick(self, ms: int) -> None:
        self.now += ms

    # --- operators -------------------------------------------------------------------------

    @rule(on=st.booleans())
    def pause(self, on: bool) -> None:
        self.paused = on

    @rule(i=st.integers(0, len(ADDRS) - 1), on=st.booleans())
    def hold(self, i: int, on: bool) -> None:
        (self.holds.add if on else self.holds.discard)(ADDRS[i])

    @precondition(lambda self: bool(self.dead) and not self.fail_closed)
    @rule(k=st.integers(0, 50))
    def resolve_dead_letter(self, k: int) -> None:
        """``dlq replay`` of the fix (the address in its canonical spelling: each object the
        spelling may mean), then ``dlq resolve``: that dead letter's claim goes, the others'
        stay (schemas.holds)."""
        cid = sorted(self.dead)[k % len(self.dead)]
        event = self.dead.pop(cid)
        if isinstance(event, ev.ObjectWritten | ev.ObjectCopied):
            for address in meanings(event.address) if event.address not in ADDRS else []:
                fixed = dataclasses.replace(event, address=address, event_id=self._id())
                self._deliver(fixed)
                if event.staging_token == self.open_token:
                    self.entries[event.ref_id] = (address, event.staging_token)
        for target, raw in list(self.dlq_holds.items()):
            removal, value = holds.remove(raw, [cid])
            if value is None:
                del self.dlq_holds[target]
            elif removal.removed:
                self.dlq_holds[target] = orjson.dumps(value)

    # --- Redis going back in time ------------------------------------------------------------

    @rule()
    def save_redis(self) -> None:
        self.snapshot = (copy.deepcopy(self.world), self.applied)

    @precondition(lambda self: self.snapshot is not None)
    @rule()
    def redis_goes_back(self) -> None:
        """Redis restored from an older copy: the log guard sees it and fails closed."""
        assert self.snapshot is not None
        world, self.applied = self.snapshot
        self.world = copy.deepcopy(world)
        self.fail_closed = True

    @precondition(lambda self: self.fail_closed and self.snapshot is not None)
    @rule()
    def replay(self) -> None:
        """The tracker replays the log from where the old copy stood; then it is trusted."""
        assert self.snapshot is not None
        for offset in range(self.applied, len(self.log)):
            self._apply(self.log[offset], offset)
        self.applied = len(self.log)
        self.fail_closed = False

    # --- the daemons -------------------------------------------------------------------------

    @rule()
    def claim(self) -> None:
        """One pass of the claim script over every address."""
        for address in ADDRS:
            self._claim(address)

    def _claim(self, address: str) -> None:
        """Judge (online), then take a lease. An expired claim that no longer passes is
        released to the state its record implies (claims.lua)."""
        rec = self.state.addresses.get(address)
        if self.fail_closed or self.paused or rec is None or self.state.retired_at is not None:
            return  # (a retired repository's queue and claims went with it: references.apply)
        j = self._judge(address, "online")
        if j.may_delete:
            rec.state = AddressState.REAPING
            rec.lease_until = self.now + LEASE
            rec.claimer = REAPER
        elif rec.state is AddressState.REAPING and (rec.lease_until or 0) <= self.now:
            rec.state = {"staged": AddressState.STAGED,
                         "committed": AddressState.COMMITTED}.get(j.reason,
                                                                   AddressState.UNREFERENCED)
            rec.lease_until = rec.claimer = None

    @rule(refused=st.booleans())
    def reap(self, refused: bool) -> None:
        """Right before the request the reaper judges its claims again; the store may refuse."""
        for address in ADDRS:
            self._reap(address, refused)

    def _reap(self, address: str, refused: bool) -> None:
        rec = self.state.addresses.get(address)
        if rec is None or rec.state is not AddressState.REAPING or rec.claimer != REAPER:
            return
        if self.state.retired_at is not None:
            return
        if (rec.lease_until or 0) <= self.now:
            return  # the lease ran out: the claim is the claim script's to judge again
        if not self._judge(address, "online", claimer=REAPER).may_delete:
            return
        if refused:
            return  # the store said no: the claim stays until its lease expires
        if address in self.store:
            # quarantine first (reaper.quarantine): the copy is then the object's last copy
            self.quarantine.setdefault(address, self.now + QUARANTINE)
            self._delete(address, "the reaper")
        eid = self._id()
        genuine = ev.AddressesReaped(repository=REPO, event_id=eid, addresses=[address],
                                     reaper=REAPER, signature=reaper_auth.sign(
                                         REAPER_KEY, REPO, REAPER, eid, [address]))
        self._deliver(genuine)
        rec = self.state.addresses[address]
        rec.state, rec.reaped_at = AddressState.REAPED, self.now
        rec.lease_until = rec.claimer = None

    @rule()
    def prune(self) -> None:
        """The reaper forgets old tombstones."""
        cutoff = self.now - TOMBSTONE
        for address, rec in list(self.state.addresses.items()):
            if rec.state is not AddressState.REAPED or (rec.reaped_at or self.now) > cutoff:
                continue
            # claims.lua keeps a tombstone whose record still protects anything
            if not tombstone_keeps(decoded(rec), self._token_states(), now_ms=self.now,
                                   tombstone_ms=TOMBSTONE):
                # claims.lua DELs the hash: it reads as no record, and the next event that
                # names the address starts a fresh one (its token sets still name it).
                self.state.addresses[address] = AddressRecord()

    @rule()
    def sweep(self) -> None:
        """The reconciler: every listed object older than the cutoff that its mark does not
        keep (retained commits, live staging tokens) and the tracker's record does not keep."""
        if self.fail_closed or self.paused or self.state.retired_at is not None:
            return  # (a retired repository is refused: reconciler.job, retired_problem)
        live_tokens = {t for t, (s, _) in self.state.tokens.items()
                       if s in (TokenState.OPEN, TokenState.SEALED)}
        committed = {t for t, (s, _) in self.state.tokens.items() if s is TokenState.COMMITTED}
        for address in sorted(self.store):
            if self.written_at[address] > self.now - GRACE:
                continue
            marked = any(address in self.state.token_addresses.get(t, ())
                         for t in live_tokens | committed)
            if marked:
                continue
            if self._judge(address, "reconciler").may_delete:
                self._delete(address, "the sweep")

    # --- quarantine ----------------------------------------------------------------------------

    def _copy_protection(self, address: str) -> str | None:
        """A quarantine copy is protected like its object while it is the object's last copy
        (retirement keeps the repository's objects, not the reaper's copies of garbage)."""
        why = None
        if address not in self.store and self.retired_at is None:
            why = self.truth.protection(address, self.now)
        if self.paused:
            why = why or "paused"
        if self._held(address):
            why = why or "held"
        if self.fail_closed:
            why = why or "fail-closed"
        return why

    @precondition(lambda self: not self.released)
    @rule(i=st.integers(0, len(ADDRS) - 1), late=st.booleans())
    def copy_reference(self, i: int, late: bool) -> None:
        """A reference to an address the service believes is there (a copy out of an old
        commit, or a late copy): nothing is written."""
        address, ref = ADDRS[i], f"ref{self.n}"
        self.entries[ref] = (address, self.open_token)
        self._publish(ev.ObjectCopied(repository=REPO, event_id=self._id(), branch="main",
                                      staging_token=self.open_token, path=f"c{i}",
                                      address=address, size=1, ref_id=ref,
                                      source_read_at=self.now / 1000), late)

    @precondition(lambda self: bool(self.quarantine))
    @rule(i=st.integers(0, len(ADDRS) - 1))
    def restore(self, i: int) -> None:
        """``hardelete restore``: its hold first, the object copied back, the copy deleted,
        the record's state recomputed from its record (claims.lua ``restore``)."""
        address = ADDRS[i]
        if address not in self.quarantine:
            return
        self.holds.add(address)
        self.store.add(address)
        del self.quarantine[address]
        rec = self.state.addresses.get(address)
        if rec is None or rec.state is not AddressState.REAPED:
            return
        live = bool(refs.live_refs(self.state, address))
        rec.state = (AddressState.COMMITTED if rec.committed
                     else AddressState.STAGED if live else AddressState.UNREFERENCED)
        rec.since, rec.reaped_at = self.now, None
        if rec.state is AddressState.UNREFERENCED:
            self.state.unreferenced[address] = self.now

    @rule()
    def purge_quarantine(self) -> None:
        """The quarantine purge: each copy past its keep time, as the gate decides
        (``reaper.quarantine.purge_keeps`` over the one evidence reader's view)."""
        due = sorted(a for a, until in self.quarantine.items() if until <= self.now)
        if not due:
            return
        keep = purge_keeps(self._evidence(due), REPO, NS, horizon_ms=self.now, grace_ms=GRACE)
        for address in due:
            if address in keep:
                continue
            why = self._copy_protection(address)
            assert why is None, f"the quarantine purge deleted the last copy of {address}: {why}"
            del self.quarantine[address]

    # --- retirement ----------------------------------------------------------------------------

    @precondition(lambda self: self.retired_at is None)
    @rule()
    def retire(self) -> None:
        """``repository_deleted``: the service retires the repository."""
        self.retired_at = self.now
        self._deliver(ev.RepositoryDeleted(repository=REPO, event_id=self._id(),
                                           storage_namespace=NS))

    @rule()
    def successor(self) -> None:
        """A new repository asks for the namespace (honestly after a retirement, or not)."""
        self._deliver(ev.RepositoryCreated(repository=SUCCESSOR, event_id=self._id(),
                                           storage_namespace=NS, default_branch="main",
                                           default_retention_days=7.0))

    @precondition(lambda self: self.world.namespaces.get(NS) == SUCCESSOR)
    @rule()
    def successor_sweep(self) -> None:
        """The new owner's reconciler: its mark holds nothing of what was there before, and
        the retired repository's holds and pause are not its own."""
        if self.fail_closed:
            return
        state = self.world.repos[SUCCESSOR]
        tokens = {t: s.value for t, (s, _) in state.tokens.items()}
        for address in sorted(self.store):
            if self.written_at[address] > self.now - GRACE:
                continue
            rec = state.addresses.get(address)
            guards = Guards(not_owner=ownership_problem(self.world.namespaces, SUCCESSOR, NS,
                                                        address))
            if judge(None if rec is None else decoded(rec), tokens, now_ms=self.now,
                     horizon_ms=self.now, grace_ms=GRACE, path="reconciler",
                     cutoff_ms=self.now - GRACE, guards=guards).may_delete:
                why = None if self.released else self._protection(address)
                assert why is None, f"the new owner's sweep deleted {address}: {why}"
                self.store.discard(address)

    @precondition(lambda self: self.retired_at is not None and not self.released
                  and not self.pending)
    @rule()
    def purge_retired(self) -> None:
        """``retired purge``: due once the retention is over (``purge_due``), each key through
        the gate's guards (``guard_keeps``); when nothing was kept the namespace is freed and
        the repository's holds go with it."""
        st_ = self.state
        if st_.retired_at is None or self.world.namespaces.get(NS) != REPO:
            return  # the mirror has not applied the retirement (fail-closed), or gave it away
        if purge_due(Retired(REPO, NS, st_.retired_at, None, None), self.now,
                     RETAIN_DAYS) is not None:
            return
        listed = sorted(self.store)
        keep = guard_keeps(self._evidence(listed).gate, REPO, NS, listed)
        for address in listed:
            if address not in keep:
                self._delete(address, "the retired purge")
        if not keep:
            self.world.release(REPO)
            self.released = True
            self.holds.clear()
            self.dlq_holds.clear()
            self.paused = False

    # --- refs and ids --------------------------------------------------------------------------

    @precondition(lambda self: not self.released)
    @rule(on=st.booleans(), late=st.booleans())
    def tag(self, on: bool, late: bool) -> None:
        """A tag created (on a new commit id) or deleted, by the service, in version order."""
        eid = self._id()
        if on:
            self.tags["v1"] = f"c{self.n}"
            self._publish(ev.TagCreated(repository=REPO, event_id=eid, tag="v1",
                                        commit_id=f"c{self.n}", ref_version=self.n), late)
        else:
            self.tags.pop("v1", None)
            self._publish(ev.TagDeleted(repository=REPO, event_id=eid, tag="v1",
                                        ref_version=self.n), late)

    @invariant()
    def refs_converge(self) -> None:
        """Once everything published is delivered, the mirror's refs are the service's,
        whatever was duplicated or reordered on the way."""
        if self.pending or self.fail_closed or self.retired_at is not None:
            return
        assert self.state.tags == self.tags
        assert self.state.branches["main"].staging_token == self.open_token

    @rule(k=st.integers(0, len(HOSTILE_IDS) - 1))
    def hostile_repository(self, k: int) -> None:
        """A repository whose id tries to reach the victim's keys."""
        self._deliver(ev.RepositoryCreated(repository=HOSTILE_IDS[k], event_id=self._id(),
                                           storage_namespace=f"s3://hostile{k}/",
                                           default_branch="main",
                                           default_retention_days=7.0))

    @invariant()
    def keys_stay_home(self) -> None:
        """No Redis key of one repository lies under another's (its hash tag and prefix)."""
        repos = list(self.world.repos)
        for a in repos:
            for b in repos:
                if a == b:
                    continue
                kb = RepoKeys(b)
                for key in (kb.tag, kb.address(ADDRS[0]), kb.meta, kb.holds, kb.tokens,
                            kb.token_addresses("t0"), kb.claims):
                    assert not key.startswith(RepoKeys(a).tag), (b, key, a)


TestAdversary = Adversary.TestCase
TestAdversary.settings = settings(max_examples=1000, stateful_step_count=50, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.filterwarnings("ignore")


# --- each finding of issue 19 as the machine's own steps (they fail when its fix is undone) --

def _play(*steps: tuple[str, dict[str, object]]) -> Adversary:
    machine = Adversary()
    machine.start()
    for rule_name, args in steps:
        getattr(machine, rule_name)(**args)
    machine.teardown()
    return machine


def test_finding_a_forged_record_of_a_deletion_vouches_for_nothing() -> None:
    """A publisher says the reaper deleted an address whose upload token is valid for another
    hour: the sweep must not take it (the signature refuses the record; the judgment checks
    the upload before ``reaped`` anyway)."""
    m = _play(("write", {"i": 0, "late": False, "ttl": True}),
              ("reset", {"late": False}),
              ("forge_reaped", {"addrs": [ADDRS[0]]}),
              ("tick", {"ms": 11_000}),
              ("sweep", {}), ("prune", {}), ("sweep", {}))
    assert ADDRS[0] in m.store


def test_finding_a_released_claim_is_judged_on_its_last_reference() -> None:
    """The store refuses the delete; meanwhile a reference comes and goes; after the lease the
    claim is judged again with grace from that reference, not from its first end."""
    m = _play(("write", {"i": 0, "late": False, "ttl": False}),
              ("reset", {"late": False}),
              ("tick", {"ms": 11_000}),
              ("claim", {}), ("reap", {"refused": True}),
              ("touch", {"i": 0}),
              ("tick", {"ms": 6_000}),
              ("claim", {}), ("reap", {"refused": False}))
    assert ADDRS[0] in m.store
    m2 = _play(("write", {"i": 0, "late": False, "ttl": False}),
               ("reset", {"late": False}),
               ("tick", {"ms": 11_000}),
               ("claim", {}), ("reap", {"refused": True}),
               ("touch", {"i": 0}),
               ("tick", {"ms": 11_000}),
               ("claim", {}), ("reap", {"refused": False}))
    assert ADDRS[0] not in m2.store  # and once its grace is over, it goes


@pytest.mark.parametrize("how", range(5))
def test_finding_one_object_spelled_another_way_is_kept(how: int) -> None:
    m = _play(("write_spelled", {"i": 0, "how": how, "late": False}),
              ("tick", {"ms": 11_000}),
              ("claim", {}), ("reap", {"refused": False}), ("sweep", {}))
    assert ADDRS[0] in m.store and m.dlq_holds


def test_finding_resolving_one_dead_letter_keeps_the_others_hold() -> None:
    """Two dead letters name one object; the operator replays the first's fix and resolves it,
    then its entry is deleted: the second (never replayed) still keeps the object."""
    m = Adversary()
    m.start()
    m.write_spelled(i=0, how=0, late=False)
    m.write_spelled(i=0, how=1, late=False)
    assert len(m.dead) == 2
    m.resolve_dead_letter(k=0)
    (ref, (address, token)), = m.entries.items()  # the replayed entry
    m._deliver(ev.ObjectDeleted(repository=REPO, event_id=m._id(), branch="main",
                                staging_token=token, path="s0", address=address, ref_id=ref))
    m.tick(ms=11_000)
    m.claim()
    m.reap(refused=False)
    m.sweep()
    assert ADDRS[0] in m.store and list(m.dlq_holds) == [ADDRS[0]]
    m.resolve_dead_letter(k=0)  # the second, replayed too: now its entry keeps the object
    assert not m.dlq_holds and ADDRS[0] in m.store
    m.teardown()


def _reaped_into_quarantine() -> Adversary:
    """An object written, dropped, reaped past its grace: its quarantine copy is all there is."""
    m = _play(("write", {"i": 0, "late": False, "ttl": False}),
              ("reset", {"late": False}),
              ("tick", {"ms": 11_000}),
              ("claim", {}), ("reap", {"refused": False}))
    assert ADDRS[0] not in m.store and ADDRS[0] in m.quarantine
    return m


@pytest.mark.parametrize("protection", ["paused", "held", "committed again", "fail-closed"])
def test_finding_the_quarantine_purge_passes_the_gate(protection: str) -> None:
    """The purge deleted the last copy of an object a commit references again, and purged
    while paused or fail-closed: it checked holds only, outside the gate."""
    m = _reaped_into_quarantine()
    m.save_redis()
    if protection == "paused":
        m.pause(on=True)
    elif protection == "held":
        m.hold(i=0, on=True)
    elif protection == "committed again":
        m.copy_reference(i=0, late=False)
        m.commit(late=False)
    else:
        m.redis_goes_back()
    m.tick(ms=40_000)
    m.purge_quarantine()
    assert ADDRS[0] in m.quarantine
    if protection != "committed again":  # once nothing protects it, the copy goes
        m.pause(on=False)
        m.hold(i=0, on=False)
        if m.fail_closed:
            m.replay()
        m.purge_quarantine()
        assert ADDRS[0] not in m.quarantine


def test_finding_a_restored_object_is_held_until_the_operator_lets_it_go() -> None:
    m = _reaped_into_quarantine()
    m.restore(i=0)
    assert ADDRS[0] in m.store and not m.quarantine
    m.tick(ms=40_000)
    m.claim()
    m.reap(refused=False)
    m.sweep()
    assert ADDRS[0] in m.store  # restore's hold
    m.hold(i=0, on=False)
    m.claim()
    m.tick(ms=1)
    m.reap(refused=False)
    assert ADDRS[0] not in m.store  # unreferenced since the restore, past grace: it goes


def test_finding_retirement_keeps_data_from_the_next_owner() -> None:
    """After ``repository_deleted`` a new repository on the same namespace marked the retired
    one's committed objects as leaked and swept them at once."""
    m = _play(("write", {"i": 0, "late": False, "ttl": False}),
              ("commit", {"late": False}),
              ("write", {"i": 1, "late": False, "ttl": False}),
              ("retire", {}), ("successor", {}))
    assert m.world.namespaces[NS] == REPO  # refused while the data is kept
    m.tick(ms=40_000)
    m.sweep()
    m.claim()
    m.reap(refused=False)
    m.purge_retired()  # not due yet
    assert {ADDRS[0], ADDRS[1]} <= m.store
    m.tick(ms=40_000)
    m.hold(i=1, on=True)
    m.purge_retired()  # due, but a hold keeps one: the namespace stays the retired one's
    assert m.store == {ADDRS[1]} and not m.released
    m.successor()
    assert m.world.namespaces[NS] == REPO
    m.hold(i=1, on=False)
    m.purge_retired()
    assert not m.store and m.released
    m.successor()
    assert m.world.namespaces[NS] == SUCCESSOR


def test_finding_duplicate_and_late_ref_events_change_nothing() -> None:
    """A retried ``tag_created`` after the tag's deletion resurrected it; a late duplicate
    ``tag_deleted`` deleted a re-created tag."""
    m = Adversary()
    m.start()
    m.tag(on=True, late=False)
    created = m.log[-1]
    m.tag(on=False, late=False)
    deleted = m.log[-1]
    m._deliver(created)  # the retried publish
    m.refs_converge()
    m.tag(on=True, late=False)
    m._deliver(deleted)  # a late duplicate
    m.refs_converge()
    m.tag(on=False, late=True)
    m.tag(on=True, late=True)
    late, m.pending = m.pending, []
    for event in reversed(late):  # delivered in the wrong order
        m._deliver(event)
    m.refs_converge()
    assert m.state.tags == {"v1": m.tags["v1"]}


@pytest.mark.parametrize("k", range(len(HOSTILE_IDS)))
def test_finding_a_hostile_repository_id_reaches_no_other_key(k: int) -> None:
    m = Adversary()
    m.start()
    m.hostile_repository(k=k)
    assert HOSTILE_IDS[k] in m.world.repos  # admitted (encoded in keys), not refused
    m.keys_stay_home()
