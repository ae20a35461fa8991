"""Reading and writing the tracker's Redis state (layout: ``schemas/layout.py``).

- :func:`read_repo_state` / :func:`aread_repo_state`: one repository's records as the
  :mod:`tracker.references` dataclasses (the same shape the pure machine produces).
- :class:`ApplyScript`: loads ``apply.lua`` and applies batches (pipelined, NOSCRIPT-safe).

The clock and the horizon are in :mod:`core.clock`, the namespace registry in
:mod:`core.registry`, the fail-closed flags and holds in :mod:`core.guards`.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aredis
from redis.exceptions import NoScriptError, ResponseError

from core.continuity_store import compose
from schemas.layout import (
    LOG,
    AddressState,
    RepoKeys,
)
from schemas.records import (
    AddressRecord,
    decode_address,
    decode_branch,
    decode_commit,
    decode_meta,
    decode_token,
)
from tracker.references import (
    Incident,
    RepoState,
)

APPLY_LUA = compose((Path(__file__).parent / "apply.lua").read_text())

# hd:progress[p] = max(current, new): progress never moves back, whoever writes it. Keyed by
# log identity: with KEYS[2] = hd:log and ARGV triples (partition, ms, "<topic>:<p>|<record>"),
# a claim is written only while the partition's log record is exactly the one the claimer
# applied up to (a claim on a replaced log, or on a Redis that went back in time, is refused).
# Returns the refused partitions.
PROGRESS_LUA = """
local step = 2
if KEYS[2] ~= nil then step = 3 end
local refused = {}
for i = 1, #ARGV, step do
  local ok = true
  if step == 3 then
    local f, e = string.match(ARGV[i + 2], '^([^|]*)|(.*)$')
    ok = (redis.call('HGET', KEYS[2], f) or '') == e
  end
  local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1')
  if not ok then
    refused[#refused + 1] = ARGV[i]
  elseif tonumber(ARGV[i + 1]) > cur then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
return refused
"""

# After the repository chunks of a batch: hd:log[field] = new, only if it is still what the
# tracker expects (ARGV triples field, expected, new), and (one Redis) only while every
# repository of the batch still holds what its chunk applied: KEYS[2..] = their applied
# hashes, with ARGV first holding per key (partition, epoch, offset its chunk reached). A
# compare on hd:log's value alone is fooled by a Redis restored from a copy taken when hd:log
# held that same value: the chunk is gone, hd:log moves past it, and its records are never
# replayed (found by the soak: redis_rollback between a chunk and its hd:log write; a write
# lost, its object reaped while a retained commit held it). Returns {"gone", key, partition},
# or the fields that had moved (Redis went back in time, or another writer): the tracker then
# resumes from what Redis holds.
LOG_WRITE_LUA = """
local i = 1
for k = 2, #KEYS do
  local part, epoch, want = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local v = redis.call('HGET', KEYS[k], part)
  local ok = false
  if v then
    local e, o = string.match(v, '^(.*):(%-?%d+)$')
    if e == nil then e, o = '', v end
    ok = (e == epoch) and tonumber(o) ~= nil and tonumber(o) >= want
  end
  if not ok then return {'gone', KEYS[k], part} end
  i = i + 3
end
local moved = {}
while i <= #ARGV do
  local cur = redis.call('HGET', KEYS[1], ARGV[i]) or ''
  if cur == ARGV[i + 1] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  else
    moved[#moved + 1] = ARGV[i]
  end
  i = i + 3
end
return moved
"""

# Redis Cluster: merge what a tracker applied into the copy hd:applied (KEYS[1]); ARGV[1] json
# {repository: {partition: "<epoch>:<offset>"}}. Per partition the stored value moves only
# forward within one log (a new log's value replaces an old one's): a tracker writing late, or
# from a stale view, never takes another's further progress back.
APPLIED_MERGE_LUA = """
local batch = cjson.decode(ARGV[1])
for repo, parts in pairs(batch) do
  local cur = redis.call('HGET', KEYS[1], repo)
  local m = {}
  if cur then m = cjson.decode(cur) end
  for p, v in pairs(parts) do
    local old = m[p]
    if old == nil then
      m[p] = v
    else
      local oe, oo = string.match(old, '^(.*):(%-?%d+)$')
      local ne, no = string.match(v, '^(.*):(%-?%d+)$')
      if oe == nil or ne == nil or oe ~= ne or tonumber(no) > tonumber(oo) then m[p] = v end
    end
  end
  redis.call('HSET', KEYS[1], repo, cjson.encode(m))
end
return 1
"""

# The partition count of the events topic, verified: ARGV topic, count seen by a metadata
# request sent after Redis time ARGV[3]. A larger count is recorded at once (new partitions
# hold the horizon back until they have progress); verified_ms only moves up.
META_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], 'partitions') or '0')
local n, at = tonumber(ARGV[2]), tonumber(ARGV[3])
if n ~= cur then
  redis.call('HSET', KEYS[1], 'topic', ARGV[1], 'partitions', ARGV[2], 'verified_ms', ARGV[3])
  return 1
end
local v = tonumber(redis.call('HGET', KEYS[1], 'verified_ms') or '-1')
if at > v then redis.call('HSET', KEYS[1], 'verified_ms', ARGV[3]) end
return 0
"""


# The namespace registry (schemas.namespaces.registration_problem, atomically): register
# ARGV[2] = namespace (canonical) for ARGV[1] = repository unless it equals, contains or lies
# inside another live repository's, or the repository owns another one; reports the first
# conflict in namespace order. {1} registered (or already was), {0, namespace, owner} refused.
# With ARGV[3] == "free": remove the namespace if ARGV[1] owns it (retirement).
def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _is_noscript(exc: BaseException) -> bool:
    return isinstance(exc, NoScriptError) or "NOSCRIPT" in str(exc) or (
        isinstance(exc, ResponseError) and "No matching script" in str(exc))


@dataclass(frozen=True, slots=True)
class LogGuard:
    """For apply.lua: the epoch of the partition's log, and (check) the value hd:log[field]
    must hold for the chunk to apply."""

    epoch: str
    field: str = ""
    expected: str = ""
    check: bool = True


def _in_slot(g: LogGuard | None, applied: str | None) -> LogGuard | None:
    """Redis Cluster: hd:log lives in another slot, so the chunk checks the repository's own
    ``applied[partition]`` against what the tracker last saw (``*``: nothing yet)."""
    return None if g is None else LogGuard(g.epoch, "applied", applied or "*", check=False)


class ApplyScript:
    """``apply.lua``: one EVALSHA per (repository, partition) chunk of a batch."""

    lua = APPLY_LUA
    sha = _sha(APPLY_LUA)

    @staticmethod
    def args(repo: str, partition: int, events_json: bytes | str,
             now_ms: int | None = None, log: LogGuard | None = None) -> tuple[Any, ...]:
        keys = RepoKeys(repo)
        now = "" if now_ms is None else str(now_ms)
        if log is None:
            return (ApplyScript.sha, 1, keys.meta, keys.tag + ":", repo, str(partition),
                    events_json, now)
        if not log.check:  # Redis Cluster: hd:log lives in another slot (see _in_slot)
            return (ApplyScript.sha, 1, keys.meta, keys.tag + ":", repo, str(partition),
                    events_json, now, log.epoch, "applied", log.expected or "*")
        return (ApplyScript.sha, 2, keys.meta, LOG, keys.tag + ":", repo, str(partition),
                events_json, now, log.epoch, log.field, log.expected)

    @classmethod
    async def apply_many(cls, client: Any,
                         calls: Sequence[tuple[str, int, bytes | str]],
                         logs: dict[int, LogGuard] | None = None,
                         applied: dict[tuple[str, int], str] | None = None) -> list[Any]:
        """Apply every chunk in one pipeline round trip; raises if any chunk failed.

        Re-running a chunk is harmless (offsets <= applied[partition] are skipped), so on
        NOSCRIPT (Redis restarted, cache flushed) the whole pipeline is simply re-sent.
        ``logs``: per partition, the log epoch and the log record the chunk requires.
        ``applied`` (Redis Cluster): per (repository, partition), the ``applied`` value the
        tracker last saw, which the chunk requires instead (the guard stays in the slot).
        """
        cluster = isinstance(client, aredis.RedisCluster)
        g = (logs or {}).get
        for attempt in range(2):
            try:
                if cluster:  # cluster pipelines refuse EVALSHA: concurrent calls instead
                    return list(await asyncio.gather(*(
                        client.evalsha(*cls.args(repo, partition, events_json, None,
                                                 _in_slot(g(partition), (applied or {}).get(
                                                     (repo, partition)))))
                        for repo, partition, events_json in calls)))
                pipe = client.pipeline(transaction=False)
                for repo, partition, events_json in calls:
                    pipe.evalsha(*cls.args(repo, partition, events_json, None, g(partition)))
                results: list[Any] = await pipe.execute(raise_on_error=True)
                return results
            except Exception as exc:
                if attempt == 0 and _is_noscript(exc):
                    await client.script_load(cls.lua)
                    continue
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def apply_sync(cls, client: Any, repo: str, partition: int, events: list[list[Any]],
                   now_ms: int | None = None) -> Any:
        """Apply one chunk with a synchronous client (tests, tools)."""
        args = cls.args(repo, partition, orjson.dumps(events), now_ms)
        try:
            return client.evalsha(*args)
        except Exception as exc:
            if not _is_noscript(exc):
                raise
            client.script_load(cls.lua)
            return client.evalsha(*args)


# --- reading state back ------------------------------------------------------------------------

def parse_address(h: dict[str, str]) -> AddressRecord:
    """An address hash as the machine's dataclass (the one codec: ``schemas.records``).
    A state the machine does not know raises ValueError."""
    rec = decode_address(h)
    if rec.state is not None:
        rec.state = AddressState(rec.state)
    return rec


parse_token = decode_token  # '<state>:<ms>' -> (TokenState, ms): the one codec


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _pairs(z: Any) -> dict[str, int]:
    out = {}
    for item in z:
        member, score = item[0], item[1]
        out[member] = int(float(score))
    return out


def _assemble(repo: str, meta: dict[str, str], addr_hashes: dict[str, dict[str, str]],
              token_sets: dict[str, Iterable[str]], tokens: dict[str, str],
              branches: dict[str, str], commits: dict[str, str], tags: dict[str, str],
              incidents: list[str], unref: Any,
              ref_versions: dict[str, str] | None = None,
              ref_seen: tuple[list[str], dict[str, str]] | None = None,
              stats: dict[str, str] | None = None,
              token_owners: dict[str, str] | None = None) -> RepoState:
    st = RepoState(repo)
    st.meta = decode_meta(meta, repo)
    st.addresses = {a: parse_address(h) for a, h in addr_hashes.items()}
    st.token_addresses = {t: set(m) for t, m in token_sets.items()}
    st.tokens = {t: parse_token(v) for t, v in tokens.items()}
    for b, j in branches.items():
        bf = decode_branch(j, b)
        st.branches[b] = bf
    for c, j in commits.items():
        cf = decode_commit(j, c)
        st.commits[c] = cf
    st.tags = dict(tags)
    st.incidents = [_incident(j) for j in incidents]
    st.unreferenced = _pairs(unref)
    st.ref_versions = {f: int(v) for f, v in (ref_versions or {}).items()}
    st.token_owners = dict(token_owners or {})
    order, seen = ref_seen or ([], {})
    st.ref_seen = {i: seen[i] for i in order if i in seen}
    st.ref_duplicates = int((stats or {}).get("ref_duplicates", 0))
    st.ref_ids_reused = int((stats or {}).get("ref_ids_reused", 0))
    st.retired_at = int(meta["retired_at"]) if meta.get("retired_at") else None
    return st


_INCIDENT_FIELDS = frozenset(f.name for f in fields(Incident))


def _incident(j: str) -> Incident:
    """An incident record (other kinds, e.g. fail-closed, carry more fields: kept in Redis)."""
    d = orjson.loads(j)
    base: dict[str, Any] = {"repository": "", "address": "", "event_id": "", "type": "",
                            "ref_id": "", "at_ms": 0}
    base.update({k: v for k, v in d.items() if k in _INCIDENT_FIELDS})
    return Incident(**base)


def read_repo_state(r: Any, repo: str) -> RepoState:
    """One repository's tracked state (synchronous client; Redis Cluster too)."""
    k = RepoKeys(repo)
    a_pre, t_pre = k.address_prefix, k.tag + ":t:"
    addr_keys, tok_keys = [], []
    for key in r.scan_iter(match=_glob_escape(k.tag) + ":*", count=1000):
        if key.startswith(a_pre):
            addr_keys.append(key)
        elif key.startswith(t_pre):
            tok_keys.append(key)
    pipe = r.pipeline(transaction=False)
    for key in addr_keys:
        pipe.hgetall(key)
    for key in tok_keys:
        pipe.smembers(key)
    for key in (k.meta, k.tokens, k.branches, k.commits, k.tags):
        pipe.hgetall(key)
    pipe.lrange(k.incidents, 0, -1)
    pipe.zrange(k.unreferenced, 0, -1, withscores=True)
    pipe.hgetall(k.ref_versions)
    pipe.lrange(k.ref_seen_order, 0, -1)
    pipe.hgetall(k.ref_seen)
    pipe.hgetall(k.stats)
    pipe.hgetall(k.token_owners)
    res = pipe.execute()
    na, nt = len(addr_keys), len(tok_keys)
    addr = {key[len(a_pre):]: h for key, h in zip(addr_keys, res[:na], strict=True)}
    toks = {key[len(t_pre):]: m for key, m in zip(tok_keys, res[na:na + nt], strict=True)}
    (meta, tokens, branches, commits, tags, incidents, unref, versions, seen_order, seen,
     stats, owners) = res[na + nt:]
    return _assemble(repo, meta, addr, toks, tokens, branches, commits, tags, incidents, unref,
                     versions, (seen_order, seen), stats, owners)


