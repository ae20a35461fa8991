"""Durable facts: a repository's holds and pauses live in its namespace, and Redis holds a copy
whose currency every delete path proves before it deletes.

Redis can go back (restored from an older copy, a stale replica promoted, a cluster node failing
over). What comes from the event log is replayed; a hold or a pause placed by an operator, by
``hardelete restore`` or by the tracker for a dead letter is not an event, so before this module
a Redis that went back simply forgot it and the reaper deleted the held object.

**The durable home** of repository ``R`` is an append-only log of facts in its own namespace,
``<namespace>_hardelete/facts/<R>/<seq>.json`` (``seq`` from 1, gapless, zero-padded so a listing
is in order). A fact is written with ``If-None-Match: *``: two writers never share a ``seq``
(the loser re-reads and takes the next). The namespace's ``_hardelete/`` is never deleted by any
path of the product, and S3 does not go back with Redis.

**The copy.** Each fact is applied to Redis by one script that checks and advances
``RepoKeys.facts_seq`` (the last fact applied) together with the fact's effect, in the
repository's slot: a Redis that goes back takes the copy and its ``facts_seq`` back together,
never one without the other. Effects are the holds script (``schemas/holds.lua``) and the pause
script (``schemas/pause.py``) run unchanged, so a durable fact means exactly what the command
meant.

**The proof** (:func:`prove`): read ``facts_seq`` = m, list the home from fact m on, apply
what is missing in order, and return the last durable fact's ``seq`` D, read *before* the gate's
own read of Redis (``core.gate.read_gate``), which refuses every delete of the repository when
the copy's ``facts_seq`` is below D. A fact written durably before the listing is then in the
copy the gate reads; one written after it is concurrent with the delete (the command that
writes it has not returned). A home that lacks fact m (emptied, or gone back) or has a gap
proves nothing: the repository deletes nothing and the reason says so.

A repository whose home is still empty while its Redis holds holds or pauses (placed before
this module) is **adopted**: the first proof or write records them as facts first.

**Only the product writes facts.** Anyone who writes the namespace (the service, its
publishers) could write into the home, or overwrite a fact there. A fact is signed
(HMAC-SHA256, its own domain) under the product's fact key (``hd:factkey``, minted in Redis,
which publishers are never given), and a fact that does not verify is never applied: the copy
stops before it and the repository deletes nothing (a forged removal would lift a hold; a
forged addition may have *replaced* a genuine one). ``hardelete facts list`` shows what does
not verify; ``hardelete facts reseal`` signs the home anew under the current key once an
operator has judged it (the key is lost only with the whole Redis: a copy older than the
product's first start, or none).

**Facts owed.** The tracker's dead-letter holds go into Redis even when the home cannot take
them (S3 down: the tracker is not stopped by S3); they are then *owed*
(``RepoKeys.facts_owed``, in the slot of the holds): the gate keeps the repository while any is
owed, and the next proof writes them durably first.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from core.clients import split_s3_uri
from schemas.holds import SCRIPT as HOLDS_LUA
from schemas.layout import FACT_KEY, RepoKeys, key_part
from schemas.pause import PAUSE_LUA

FACTS_DIR = "_hardelete/facts/"
FORMAT = 1
HOLD_ADD, HOLD_REMOVE, PAUSE = "hold_add", "hold_remove", "pause"
KINDS = (HOLD_ADD, HOLD_REMOVE, PAUSE)
HASHES = ("holds", "hold_prefixes")  # which holds hash of the repository a hold fact changes
PAUSE_OPS = ("add", "remove", "force")
_APPEND_TRIES = 20


class FactError(ValueError):
    """A durable fact that cannot be read as one (the proof fails: nothing is deleted)."""


def facts_home(namespace: str, repo: str) -> str:
    """The s3:// prefix of repository ``repo``'s durable facts."""
    return f"{namespace}{FACTS_DIR}{key_part(repo)}/"


def fact_name(seq: int) -> str:
    return f"{seq:012d}.json"


def seq_of(name: str) -> int | None:
    """The seq of a fact's object name (relative to the home), None for anything else."""
    stem, dot, ext = name.partition(".")
    if ext != "json" or not dot or len(stem) != 12 or not stem.isdigit():
        return None
    return int(stem) or None


# --- the facts (pure) ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Fact:
    repository: str
    seq: int
    kind: str
    body: Mapping[str, Any]
    at_ms: int
    by: str
    signature: str = ""  # hex HMAC under the fact key (:func:`sign`); "" unsigned

    def fields(self) -> dict[str, Any]:
        return {"format": FORMAT, "repository": self.repository, "seq": self.seq,
                "kind": self.kind, "body": dict(self.body), "at_ms": self.at_ms, "by": self.by}

    def encode(self) -> bytes:
        return orjson.dumps({**self.fields(), "signature": self.signature})


_DOMAIN = b"hardelete fact v1\0"  # never a reaper's or a dead letter's signature


def _message(fact: Fact) -> bytes:
    return _DOMAIN + orjson.dumps(fact.fields(), option=orjson.OPT_SORT_KEYS)


def sign(key: bytes, fact: Fact) -> Fact:
    from dataclasses import replace

    return replace(fact, signature=hmac.new(key, _message(fact), hashlib.sha256).hexdigest())


def verified(key: bytes | None, fact: Fact) -> bool:
    if not key or not fact.signature:
        return False
    return hmac.compare_digest(fact.signature,
                               hmac.new(key, _message(fact), hashlib.sha256).hexdigest())


def load_key(r: Any) -> bytes:
    """The fact key (minted in Redis by the first one to need it)."""
    r.set(FACT_KEY, secrets.token_hex(32), nx=True)
    raw = r.get(FACT_KEY)
    if raw is None:  # pragma: no cover - deleted between the two calls
        raise FactError("the fact key vanished from Redis")
    return raw.encode() if isinstance(raw, str) else bytes(raw)


def _check_body(kind: str, body: Any) -> str | None:
    """Why ``body`` is not a valid body of a ``kind`` fact (pure), or None."""
    if not isinstance(body, dict):
        return "its body is not an object"
    if kind == HOLD_ADD:
        items = body.get("items")
        if body.get("hash") not in HASHES or not isinstance(body.get("replace"), bool) \
                or not isinstance(items, list) or not items:
            return "a hold_add needs hash, replace and items"
        for it in items:
            if not (isinstance(it, list) and len(it) == 3 and isinstance(it[0], str)
                    and isinstance(it[1], str) and isinstance(it[2], dict)):
                return "a hold_add item is [target, claim id, claim]"
        return None
    if kind == HOLD_REMOVE:
        ids = body.get("claim_ids")
        if body.get("hash") not in HASHES or not isinstance(body.get("target"), str) \
                or not isinstance(body.get("force"), bool) or not isinstance(ids, list) \
                or not all(isinstance(i, str) for i in ids):
            return "a hold_remove needs hash, target, force and claim_ids"
        return None
    if kind == PAUSE:
        if body.get("op") not in PAUSE_OPS or not isinstance(body.get("who"), str) \
                or not isinstance(body.get("reason"), str) \
                or type(body.get("at_ms")) is not int:
            return "a pause needs op, who, reason and at_ms"
        return None
    return f"unknown kind {kind!r}"


def make_fact(repository: str, seq: int, kind: str, body: Mapping[str, Any], *, at_ms: int,
              by: str) -> Fact:
    problem = _check_body(kind, dict(body))
    if problem is not None:
        raise ValueError(f"not a {kind} fact: {problem}")
    return Fact(repository, seq, kind, dict(body), at_ms, by)


def decode_fact(raw: bytes, *, repository: str, seq: int) -> Fact:
    """A stored fact, read strictly: it must be this repository's fact number ``seq``."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise FactError(f"fact {seq} of {repository!r} is not json: {exc}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FactError(f"fact {seq} of {repository!r} is not a format-{FORMAT} fact")
    if d.get("repository") != repository or d.get("seq") != seq:
        raise FactError(f"fact {seq} of {repository!r} names repository "
                        f"{d.get('repository')!r}, seq {d.get('seq')!r}")
    kind = d.get("kind")
    if not isinstance(kind, str):
        raise FactError(f"fact {seq} of {repository!r} has no kind")
    problem = _check_body(kind, d.get("body"))
    if problem is not None or type(d.get("at_ms")) is not int or not isinstance(d.get("by"), str) \
            or not isinstance(d.get("signature", ""), str):
        raise FactError(f"fact {seq} of {repository!r} is malformed: "
                        f"{problem or 'at_ms, by (and signature) are required'}")
    return Fact(repository, seq, kind, d["body"], d["at_ms"], d["by"], d.get("signature", ""))


@dataclass(frozen=True)
class Currency:
    """What a listing of the home says about a copy that applied up to ``mirrored``."""

    mirrored: int
    durable: int  # the last durable fact (``mirrored`` when the home has nothing newer)
    missing: tuple[int, ...]  # durable facts the copy lacks, in order
    problem: str | None  # the home cannot prove the copy: nothing may be deleted


def judge(mirrored: int, listed: Sequence[int]) -> Currency:
    """The currency of a copy at ``mirrored`` given the seqs the home lists from ``mirrored``
    on (pure). The home must still hold fact ``mirrored`` (else it went back or was emptied:
    what the copy knows can no longer be re-derived) and be gapless above it."""
    seqs = sorted(set(listed))
    above = [s for s in seqs if s > mirrored]
    if mirrored > 0 and mirrored not in seqs:
        return Currency(mirrored, max(seqs, default=mirrored), (),
                        f"the durable home lacks fact {mirrored}, the last one this Redis "
                        "applied: the home went back or was emptied")
    want = list(range(mirrored + 1, mirrored + 1 + len(above)))
    if above != want:
        gap = next(w for w, a in zip(want, above, strict=True) if w != a)
        return Currency(mirrored, max(above), (), f"the durable home has a gap at fact {gap}")
    return Currency(mirrored, max(above, default=mirrored), tuple(above), None)


@dataclass(frozen=True)
class FactsProof:
    """A delete path's proof, taken right before it reads the gate: the last durable fact of
    the repository (``durable``), or why none can be given (``problem``)."""

    repository: str
    durable: int
    problem: str | None = None

    def copy_problem(self, repo: str, applied: int | None, owed: int = 0) -> str | None:
        """Why the gate's copy (``applied`` = its ``facts_seq``; ``owed`` facts it holds that
        the home does not yet) may not be trusted (pure)."""
        if self.repository != repo:
            return f"the facts proof is of repository {self.repository!r}, not {repo!r}"
        if self.problem is not None:
            return f"holds and pauses not proven: {self.problem}"
        if owed:
            return (f"{owed} dead-letter hold claim(s) are in Redis only (their fact log "
                    "refused them); the next proof writes them")
        if (applied or 0) < self.durable:
            return (f"Redis's copy of the holds and pauses went back (it applied fact "
                    f"{applied or 0}, the durable home has {self.durable}); the next pass "
                    "applies them again")
        return None


NOT_PROVEN = "holds and pauses not proven current against their durable home (core/facts.py)"


# --- the durable home (S3) -----------------------------------------------------------------------

class FactLog:
    """One repository's durable facts in S3 (synchronous: run it in a thread from async code)."""

    def __init__(self, s3: Any, namespace: str, repo: str) -> None:
        self.s3 = s3
        self.repo = repo
        self.bucket, self.prefix = split_s3_uri(facts_home(namespace, repo))

    def seqs_from(self, seq: int) -> list[int]:
        """The seqs of the home's facts from ``seq`` on (from the first when ``seq`` <= 1)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix}
        if seq > 1:
            kwargs["StartAfter"] = self.prefix + fact_name(seq - 1)
        out: list[int] = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(**kwargs):
            for obj in page.get("Contents", ()):
                s = seq_of(obj["Key"][len(self.prefix):])
                if s is None:
                    raise FactError(f"{obj['Key']} in the facts home of {self.repo!r} is not "
                                    "a fact")
                out.append(s)
        return out

    def raw(self, seq: int) -> bytes:
        return bytes(self.s3.get_object(Bucket=self.bucket,
                                        Key=self.prefix + fact_name(seq))["Body"].read())

    def read(self, seq: int) -> Fact:
        return decode_fact(self.raw(seq), repository=self.repo, seq=seq)

    def snapshot(self) -> tuple[str, dict[int, bytes]]:
        """(digest, seq -> bytes) of what the home holds now: an operator's judgment of the
        home (``hardelete facts list``) is bound to the digest (``facts reseal --digest``)."""
        h = hashlib.sha256()
        out: dict[int, bytes] = {}
        for seq in self.seqs_from(1):
            out[seq] = raw = self.raw(seq)
            h.update(seq.to_bytes(8, "big") + len(raw).to_bytes(8, "big") + raw)
        return h.hexdigest()[:16], out

    def put(self, fact: Fact) -> bool:
        """Write ``fact`` unless its seq is taken (False: another writer has it)."""
        from botocore.exceptions import ClientError

        try:
            self.s3.put_object(Bucket=self.bucket, Key=self.prefix + fact_name(fact.seq),
                               Body=fact.encode(), IfNoneMatch="*",
                               ContentType="application/json")
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code", "")) in (
                    "PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise
        return True


# --- the copy (Redis) ----------------------------------------------------------------------------

def _guarded(effect: str) -> str:
    """``effect`` (a script whose last KEY and ARGV are not its own) run only when it is the
    next fact of the copy, together with advancing ``facts_seq``: {'applied'|'already'|'gap',
    facts_seq after}."""
    return (
        "local seqkey = KEYS[#KEYS]\n"
        "local seq = tonumber(ARGV[#ARGV])\n"
        "local cur = tonumber(redis.call('GET', seqkey) or '0')\n"
        "if cur >= seq then return {'already', cur} end\n"
        "if cur ~= seq - 1 then return {'gap', cur} end\n"
        "local function effect(KEYS, ARGV)\n" + effect + "\nend\n"
        "local k, a = {}, {}\n"
        "for i = 1, #KEYS - 1 do k[i] = KEYS[i] end\n"
        "for i = 1, #ARGV - 1 do a[i] = ARGV[i] end\n"
        "effect(k, a)\n"
        "redis.call('SET', seqkey, seq)\n"
        "return {'applied', seq}\n")


GUARDED_HOLDS = _guarded(HOLDS_LUA)
GUARDED_PAUSE = _guarded(PAUSE_LUA)


def _call(fact: Fact) -> tuple[str, list[str], list[str]]:
    """(script, keys, args) applying ``fact`` to the copy (pure)."""
    k = RepoKeys(fact.repository)
    b = fact.body
    if fact.kind == PAUSE:
        return GUARDED_PAUSE, [k.paused, k.facts_seq], [
            b["op"], b["who"], b["reason"], str(b["at_ms"]), str(fact.seq)]
    holds = k.holds if b["hash"] == "holds" else k.hold_prefixes
    if fact.kind == HOLD_ADD:
        args = ["add", "1" if b["replace"] else "0"]
        for target, claim_id, claim in b["items"]:
            args += [target, claim_id, orjson.dumps(claim).decode()]
        return GUARDED_HOLDS, [holds, k.facts_seq], [*args, str(fact.seq)]
    return GUARDED_HOLDS, [holds, k.facts_seq], [
        "remove", b["target"], "1" if b["force"] else "0", *b["claim_ids"], str(fact.seq)]


def _status(res: Any) -> tuple[str, int]:
    status, seq = res
    return (status.decode() if isinstance(status, bytes) else str(status)), int(seq)


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def adoption(repo: str, holds: Mapping[Any, Any], prefixes: Mapping[Any, Any],
             paused: Any) -> list[tuple[str, dict[str, Any]]]:
    """The facts that record what a repository's Redis holds before its home has any (pure):
    one hold_add per hash (every claim, kept as it is) and one pause per pause claim."""
    from schemas.holds import claims_of

    out: list[tuple[str, dict[str, Any]]] = []
    for name, h in (("holds", holds), ("hold_prefixes", prefixes)):
        items = [[_text(t), cid, dict(c) if isinstance(c, dict) else {"reason": str(c)}]
                 for t, raw in sorted(h.items()) for cid, c in claims_of(raw).items()]
        if items:
            out.append((HOLD_ADD, {"hash": name, "replace": False, "items": items}))
    if paused is not None:
        try:
            value = orjson.loads(paused)
        except orjson.JSONDecodeError:
            value = {"reason": _text(paused)}
        claims = value.get("claims") if isinstance(value, dict) else None
        if not isinstance(claims, dict):
            claims = {"legacy": value if isinstance(value, dict) else {"reason": str(value)}}
        for who, c in sorted(claims.items()):
            c = c if isinstance(c, dict) else {}
            at = c.get("at_ms")
            out.append((PAUSE, {"op": "add", "who": str(who),
                                "reason": str(c.get("reason") or "paused"),
                                "at_ms": at if type(at) is int else 0}))
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def unverified(fact: Fact) -> str:
    return (f"fact {fact.seq} ({fact.kind} by {fact.by!r}) does not verify under the fact key: "
            f"forged, overwritten, or signed with a key Redis lost; `hardelete facts list "
            f"{fact.repository}` shows it, `hardelete facts reseal` once it is judged")


class RepoFacts:
    """One repository's durable facts and their Redis copy (synchronous Redis client; Redis
    Cluster too: every key is in the repository's slot)."""

    def __init__(self, r: Any, s3: Any, repo: str, namespace: str) -> None:
        self.r = r
        self.repo = repo
        self.log = FactLog(s3, namespace, repo)
        self.k = RepoKeys(repo)
        self._key: bytes | None = None

    def key(self) -> bytes:
        if self._key is None:
            self._key = load_key(self.r)
        return self._key

    def applied(self) -> int:
        return _int(self.r.get(self.k.facts_seq))

    def _apply(self, fact: Fact) -> str:
        script, keys, args = _call(fact)
        status, _ = _status(self.r.eval(script, len(keys), *keys, *args))
        return status

    def sync(self) -> Currency:
        """Apply to the copy, in order, every durable fact it lacks; the currency after."""
        for _ in range(_APPEND_TRIES):
            m = self.applied()
            cur = judge(m, self.log.seqs_from(m))
            if cur.problem is not None or not cur.missing:
                return cur
            for seq in cur.missing:
                fact = self.log.read(seq)
                if not verified(self.key(), fact):
                    return Currency(seq - 1, cur.durable, (), unverified(fact))
                if self._apply(fact) == "gap":
                    break  # the copy moved (went back, or another syncer): list again
            else:
                return Currency(cur.durable, cur.durable, (), None)
        raise FactError(f"the facts of {self.repo!r} kept moving while they were applied")

    def _adopt(self, cur: Currency, by: str, now_ms: int) -> None:
        if cur.durable or cur.problem:
            return
        raw = self.r.pipeline(transaction=False)
        raw.hgetall(self.k.holds)
        raw.hgetall(self.k.hold_prefixes)
        raw.get(self.k.paused)
        holds, prefixes, paused = raw.execute()
        for kind, body in adoption(self.repo, holds or {}, prefixes or {}, paused):
            self.record(kind, body, by=by, now_ms=now_ms, adopt=False)

    def record(self, kind: str, body: Mapping[str, Any], *, by: str, now_ms: int,
               adopt: bool = True) -> Fact:
        """Write a fact durably, then apply it to the copy (after every fact before it)."""
        cur = self.sync()
        if cur.problem is not None:
            raise FactError(f"cannot record a fact of {self.repo!r}: {cur.problem}")
        if adopt:
            self._adopt(cur, by, now_ms)
            cur = self.sync()
        seq = cur.durable + 1
        for _ in range(_APPEND_TRIES):
            fact = sign(self.key(), make_fact(self.repo, seq, kind, body, at_ms=now_ms, by=by))
            if self.log.put(fact):
                break
            seq = max(self.log.seqs_from(seq) or [seq]) + 1  # another writer took it
        else:
            raise FactError(f"could not append a fact of {self.repo!r}: too many writers")
        self.sync()
        return fact

    def owe(self, name: str, items: list[list[Any]]) -> None:
        """Hold claims placed in Redis only (the home refused them): owed until a proof
        writes them (module docstring)."""
        k = self.k
        key = k.holds if name == "holds" else k.hold_prefixes
        # The debt first: a crash between the two leaves a debt whose payment applies it.
        self.r.sadd(k.facts_owed, *(orjson.dumps([name, *it]).decode() for it in items))
        args: list[str] = ["add", "0"]
        for target, claim_id, claim in items:
            args += [target, claim_id, orjson.dumps(claim).decode()]
        self.r.eval(HOLDS_LUA, 1, key, *args)

    def pay(self, by: str, now_ms: int) -> None:
        """Write the owed claims durably, then forget the debt."""
        owed = self.r.smembers(self.k.facts_owed)
        if not owed:
            return
        groups: dict[str, list[list[Any]]] = {}
        for raw in sorted(_text(o) for o in owed):
            name, target, claim_id, claim = orjson.loads(raw)
            groups.setdefault(name, []).append([target, claim_id, claim])
        for name, items in sorted(groups.items()):
            self.record(HOLD_ADD, {"hash": name, "replace": False, "items": items}, by=by,
                        now_ms=now_ms)
        self.r.srem(self.k.facts_owed, *owed)

    def prove(self, *, by: str = "proof", now_ms: int = 0, adopt: bool = True) -> FactsProof:
        """The proof a delete path takes right before it reads the gate (module docstring).
        ``adopt=False``: a reader that writes nothing durable (``explain``)."""
        try:
            if adopt:
                self.pay(by, now_ms)
            cur = self.sync()
            if adopt and cur.problem is None and cur.durable == 0:
                self._adopt(cur, by, now_ms)
                cur = self.sync()
        except Exception as exc:  # the home unreadable: nothing is proven
            return FactsProof(self.repo, 0, f"{type(exc).__name__}: {exc}")
        return FactsProof(self.repo, cur.durable, cur.problem)


async def aprove(r: Any, s3: Any, repo: str, namespace: str, *, by: str = "proof",
                 now_ms: int = 0) -> FactsProof:
    """:meth:`RepoFacts.prove` from async code: ``r`` is a *synchronous* client (the proof
    runs in a thread: the home's listing blocks)."""
    return await asyncio.to_thread(RepoFacts(r, s3, repo, namespace).prove, by=by,
                                   now_ms=now_ms)


def pay_debts(r: Any, s3: Any, *, by: str, now_ms: int) -> dict[str, str | None]:
    """Write every repository's owed facts (the tracker runs it while S3 is back): repository
    -> None when paid, else why not (the debt stays, and keeps the repository)."""
    from core.registry import repo_namespace
    from schemas.layout import REPOS

    out: dict[str, str | None] = {}
    for repo in sorted(_text(x) for x in r.smembers(REPOS)):
        if not r.scard(RepoKeys(repo).facts_owed):
            continue
        namespace = repo_namespace(r, repo)
        if not namespace:
            out[repo] = "no namespace"
            continue
        try:
            RepoFacts(r, s3, repo, namespace).pay(by, now_ms)
            out[repo] = None
        except Exception as exc:  # S3 still refuses: owed a while longer
            out[repo] = f"{type(exc).__name__}: {exc}"
    return out
