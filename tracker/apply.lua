--[[ hardelete tracker: apply a batch of ONE repository's events atomically.

The specification is tracker/references.py (a differential test proves this script agrees with
it); the key layout is schemas/layout.py. Events arrive pre-validated and in compact form
(tracker/codec.py: [offset, op, ...]); admission (namespace, reserved prefixes, unknown
repository) happened in Python.

KEYS[1]  <tag>:repo             (routes the call to the repository's slot; all keys below share it)
ARGV[1]  <tag>:                 key prefix of the repository, e.g. "hd:{repo}:"
ARGV[2]  repository id          (for incidents)
ARGV[3]  partition              (events with offset <= applied[partition] are skipped);
                                '' for a rebuild (op 13 only, tracker/rebuild.py): nothing
                                is skipped and applied[] is not touched
ARGV[4]  events                 JSON array of compact events
ARGV[5]  now override (ms)      "" in production: the Redis clock (TIME) is the only clock
ARGV[6]  log epoch              identity of the partition's log (tracker/logid.py); "" in tests.
                                applied[partition] = "<epoch>:<offset>": an offset recorded for
                                another epoch (another log) skips nothing.
KEYS[2]  hd:log (optional)      with ARGV[7] field and ARGV[8] expected value: the chunk is
ARGV[7..8]                      refused ("hardelete: log record moved") unless the partition's
                                log record is what the tracker last wrote or verified, so a
                                Redis that went back in time applies nothing past its gap.
                                Redis Cluster (no KEYS[2]): ARGV[7] = "applied", ARGV[8] the
                                applied[partition] value the tracker last saw ("*": none yet).

Continuity (schemas/README.md, "Continuity"; core/continuity.lua is prepended to this script):
a sequenced event's entry has its op negated and its (stripe, incarnation, seq) appended,
[offset, -op, ..., stripe, incarnation, seq] (ops 1..11; op 14 is not used), and is applied
only if its (stripe, seq) is new (exact dedupe, any order); op 15
{stripe, incarnation, M, R, applied, broken, epoch} is a watermark whose tick
the tracker verified (applied: the seq applied at R, signed in the tick; a non-empty `broken`:
a break the service recorded at that rebuild epoch, which breaks the stripe again unless it
was rebuilt since);
op 16 {stripe, incarnation, from, to, reason} a range the service's relay says is gone, which
breaks the stripe unless it is applied already. A repository that ever carried a seq is
`sequenced` (hd:{R}:repo); an event without one after that breaks its stripe 0 (the service
broke A1: its history is no longer certified), and so does an event of a stripe it did not
declare (`stripes`, from repository_created).

Returns {applied, skipped, incident_json...}.
]]

local P = ARGV[1]
local C = continuity(P)
local repo = ARGV[2]
local part = ARGV[3]
local events = cjson.decode(ARGV[4])
local now
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  now = tonumber(ARGV[5])
else
  now = C.clock()
end

local K_META, K_TOKENS, K_BRANCHES = P .. 'repo', P .. 'tokens', P .. 'branches'
local K_COMMITS, K_TAGS, K_UNREF = P .. 'commits', P .. 'tags', P .. 'unref'
local K_INC, K_APPLIED, K_STATS = P .. 'incidents', P .. 'applied', P .. 'stats'
local K_REFVER, K_CLAIMS, K_REAPED = P .. 'refver', P .. 'claims', P .. 'reaped'
local K_REFSEEN, K_REFSEENQ = P .. 'refseen', P .. 'refseenq'
local WINDOW = 10000  -- schemas.layout.REF_DEDUPE_WINDOW
local AP, TP = P .. 'a:', P .. 't:'

local RANK = { open = 0, sealed = 1, dropped = 2, doubt = 3, committed = 4 }
local K_TOKOWN = P .. 'tokowner'

-- a < b by bytes (Lua's < follows the server's locale; Python compares code points, which
-- is the UTF-8 byte order)
local function less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function fmt(n) return string.format('%d', n) end
local NOW = fmt(now)

local incidents = {}
local function incident(address, event_id, etype, ref, kind, token)
  local j = cjson.encode({ repository = repo, address = address, event_id = event_id,
                           type = etype, ref_id = ref, at_ms = now, kind = kind,
                           token = token })
  redis.call('RPUSH', K_INC, j)
  incidents[#incidents + 1] = j
end

-- token -> state string, or false when unknown (unknown tokens count as live)
local tokcache = {}
local function tok_state(t)
  local s = tokcache[t]
  if s == nil then
    local v = redis.call('HGET', K_TOKENS, t)
    if v then s = string.match(v, '^([^:]*)') else s = false end
    tokcache[t] = s
  end
  return s
end

--[[ Write-back cache of address records: each touched address is read once (HGETALL) and
written once at the end (HSET of the changed fields, HDEL since, ZADD/ZREM of the index). The
script's clock is constant, so this is the same as writing after every event. ]]
local recs, order = {}, {}
local function load(address)
  local r = recs[address]
  if r then return r end
  local h = redis.call('HGETALL', AP .. address)
  -- every field named here, nil ones too, so that the table is allocated at its final size
  r = { adds = {}, rems = {}, committed = false, newf = {}, dsize = false, dcomm = false,
        state = nil, since = nil, iu = nil, size = nil, state0 = nil, since0 = nil,
        diu = nil, reaped = nil, doubt = false, ddoubt = false }
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    local c = string.byte(f, 1)
    if c == 43 then r.adds[string.sub(f, 2)] = v          -- '+'
    elseif c == 45 then r.rems[string.sub(f, 2)] = v      -- '-'
    elseif f == 'state' then r.state = v
    elseif f == 'since' then r.since = v
    elseif f == 'committed' then r.committed = true
    elseif f == 'doubt' then r.doubt = (v ~= '' and v ~= '0')
    elseif f == 'iu' then r.iu = tonumber(v)
    elseif f == 'size' then r.size = tonumber(v)
    end
  end
  r.state0, r.since0 = r.state, r.since
  recs[address] = r
  order[#order + 1] = address
  return r
end

--[[ Recompute the committed flag and (unless the reaper holds it) the state of an address.
commit_tok: a token that just moved dropped -> committed (incident for each of its live refs if
the reaper holds the address). ]]
local function derive(address, r, ev_id, ev_type, commit_tok)
  local held = (r.state == 'reaping' or r.state == 'reaped')
  local live, comm = r.doubt, r.committed  -- a contradiction keeps, like a live reference
  local rems = r.rems
  for ref, tok in pairs(r.adds) do
    if rems[ref] ~= tok then  -- only a removal naming the add's token ends it
      local ts = tok_state(tok)
      if ts == 'committed' then
        comm = true
      elseif ts == false or ts == 'open' or ts == 'sealed' or ts == 'doubt' then
        live = true
      end
      if held and commit_tok ~= nil and tok == commit_tok then
        incident(address, ev_id, ev_type, ref)
      end
    end
  end
  if comm and not r.committed then r.committed = true; r.dcomm = true end
  if held then
    -- references.py _derive: the grace of a released claim restarts from its last reference
    if not comm and not live then r.since = NOW end
    return
  end
  if comm then
    r.state, r.since = 'committed', nil
  elseif live then
    r.state, r.since = 'staged', nil
  elseif r.iu ~= nil and r.iu > now then
    r.state, r.since = 'issued', fmt(r.iu)
  else
    r.state, r.since = 'unreferenced', NOW
  end
end

-- references._contradiction: a reference id named with another token than an earlier add or
-- remove of it: the address is kept for good (sticky doubt), one incident.
local function contradiction(address, r, ref, tok, ev_id, ev_type)
  if r.doubt then return end
  local a, m = r.adds[ref], r.rems[ref]
  if (a ~= nil and a ~= tok) or (m ~= nil and m ~= tok) then
    r.doubt, r.ddoubt = true, true
    incident(address, ev_id, ev_type, ref, 'ref_doubt', tok)
  end
end

local tokadds = {}  -- token -> {address = true} added in this call (SADD at the end)
local function add_ref(address, ref, tok, size, ev_id, ev_type)
  local r = load(address)
  contradiction(address, r, ref, tok, ev_id, ev_type)
  local cur = r.adds[ref]
  if cur == nil or less(tok, cur) then  -- the least token named: any order, one record
    r.adds[ref] = tok
    local nf = r.newf
    nf[#nf + 1] = '+' .. ref
    nf[#nf + 1] = tok
  end
  local ta = tokadds[tok]  -- every token named indexes the address
  if ta == nil then ta = {}; tokadds[tok] = ta end
  ta[address] = true
  if r.size == nil or size > r.size then r.size = size; r.dsize = true end
  if cur == nil and (r.state == 'reaping' or r.state == 'reaped') and not r.rems[ref]
      and tok_state(tok) ~= 'dropped' then
    incident(address, ev_id, ev_type, ref)
  end
  derive(address, r)
end

local function remove_ref(address, ref, tok, ev_id, ev_type)
  local r = load(address)
  contradiction(address, r, ref, tok, ev_id, ev_type)
  local cur = r.rems[ref]
  if cur == nil or less(tok, cur) then
    r.rems[ref] = tok
    local nf = r.newf
    nf[#nf + 1] = '-' .. ref
    nf[#nf + 1] = tok
  end
  derive(address, r)
end

-- The reaper's log record of a confirmed delete (see references._reaped): unless the reaper's
-- own record holds the address, Redis lost its work; reaped again, an incident per keeping ref.
local function reaped(address, ev_id)
  local r = load(address)
  if r.state == 'reaping' or r.state == 'reaped' then return end
  for ref, tok in pairs(r.adds) do
    if r.rems[ref] ~= tok and tok_state(tok) ~= 'dropped' then
      incident(address, ev_id, 'addresses_reaped', ref)
    end
  end
  r.state, r.since, r.reaped = 'reaped', nil, true
end

local function set_token(t, new, ev_id, ev_type)
  local cur = tok_state(t)
  if cur and RANK[new] <= RANK[cur] then return end
  redis.call('HSET', K_TOKENS, t, new .. ':' .. NOW)
  tokcache[t] = new
  local commit_tok = nil  -- committed or contested after dropped: incidents if held
  if cur == 'dropped' and (new == 'committed' or new == 'doubt') then commit_tok = t end
  local seen = {}
  local members = redis.call('SMEMBERS', TP .. t)
  for i = 1, #members do
    local a = members[i]
    seen[a] = true
    derive(a, load(a), ev_id, ev_type, commit_tok)
  end
  local ta = tokadds[t]
  if ta then
    for a in pairs(ta) do
      if not seen[a] then derive(a, load(a), ev_id, ev_type, commit_tok) end
    end
  end
end

-- references._claim_token: a branch event names token t as branch's; named by a second
-- branch it is contested ('' in tokowner): doubt, which no drop can end; one incident.
local function claim_token(t, branch, ev_id, ev_type)
  local cur = redis.call('HGET', K_TOKOWN, t)
  if not cur then
    redis.call('HSET', K_TOKOWN, t, branch)
  elseif cur ~= '' and cur ~= branch then
    redis.call('HSET', K_TOKOWN, t, '')
    incident('', ev_id, ev_type, '', 'token_contested', t)
    set_token(t, 'doubt', ev_id, ev_type)
  end
end

-- redis.call with the values of list t, at most step at a time (unpack() has a stack limit)
local function call_chunked(cmd, key, t, step)
  local n, j = #t, 1
  while j <= n do
    local k = math.min(j + step - 1, n)
    redis.call(cmd, key, unpack(t, j, k))
    j = k + 1
  end
end

local function flush()
  local zadd, zrem = {}, {}  -- the unreferenced index, changed in two calls, not one per address
  for i = 1, #order do
    local address = order[i]
    local r = recs[address]
    local akey = AP .. address
    local f = r.newf
    if r.dsize then f[#f + 1] = 'size'; f[#f + 1] = fmt(r.size) end
    if r.dcomm then f[#f + 1] = 'committed'; f[#f + 1] = '1' end
    if r.ddoubt then f[#f + 1] = 'doubt'; f[#f + 1] = '1' end
    if r.state ~= r.state0 then f[#f + 1] = 'state'; f[#f + 1] = r.state end
    if r.since ~= nil and r.since ~= r.since0 then f[#f + 1] = 'since'; f[#f + 1] = r.since end
    if r.diu then f[#f + 1] = 'iu'; f[#f + 1] = fmt(r.iu) end
    if r.reaped then
      f[#f + 1] = 'reaped_at'; f[#f + 1] = NOW
      redis.call('ZADD', K_REAPED, now, address)  -- pruned with the reaper's tombstones
    end
    call_chunked('HSET', akey, f, 2000)
    local held = r.state == 'reaping' or r.state == 'reaped'
    if r.since == nil and r.since0 ~= nil then
      redis.call('HDEL', akey, 'since')
      zrem[#zrem + 1] = address
    elseif held then  -- never queued: a claim's release queues it again
      if r.since0 ~= nil then zrem[#zrem + 1] = address end
    elseif r.since ~= nil and r.since ~= r.since0 then
      zadd[#zadd + 1] = r.since
      zadd[#zadd + 1] = address
    end
  end
  call_chunked('ZADD', K_UNREF, zadd, 2000)
  call_chunked('ZREM', K_UNREF, zrem, 2000)
  for t, ta in pairs(tokadds) do
    local m = {}
    for a in pairs(ta) do m[#m + 1] = a end
    call_chunked('SADD', TP .. t, m, 2000)
  end
end

--[[ Versioned refs (ref_version, required; see references.py): true if the event's version is
above the ref's recorded one (and records it), false if not (stale or duplicate: the ref does
not change). Deletes record their version too: a tombstone. ]]
local function newer(field, v)
  local cur = tonumber(redis.call('HGET', K_REFVER, field) or '-1')
  if v <= cur then return false end
  redis.call('HSET', K_REFVER, field, fmt(v))
  return true
end

--[[ The dedupe window (references._duplicate): the last WINDOW ref event ids with the ref and
version each carried. The same id, ref and version again is a duplicate; the same id with
another ref or version is applied by the version rule (never dropped). ]]
local dups, reused = 0, 0
local function duplicate(ev_id, field, v)
  local mark = field .. '|' .. fmt(v)
  if redis.call('HSETNX', K_REFSEEN, ev_id, mark) == 0 then  -- seen (the common case: not)
    if redis.call('HGET', K_REFSEEN, ev_id) == mark then dups = dups + 1; return true end
    reused = reused + 1
    return false
  end
  if redis.call('RPUSH', K_REFSEENQ, ev_id) > WINDOW then
    redis.call('HDEL', K_REFSEEN, redis.call('LPOP', K_REFSEENQ))
  end
  return false
end

local function fresh(ev_id, field, v)
  if duplicate(ev_id, field, v) then return false end
  return newer(field, v)
end

local function branch_json(head, token)
  local h = 'null'
  if head ~= nil and head ~= '' then h = cjson.encode(head) end
  return '{"head":' .. h .. ',"staging_token":' .. cjson.encode(token) .. ',"sealed_tokens":[]}'
end

-- op 13 is the rebuild's (tracker/rebuild.py), never an event's: only a call with no
-- partition (ARGV[3] = '') may carry it, and such a call carries only it and the reference
-- ops (issue, add, delete), behind its guard.
local rebuild_call = (part == '')
local REBUILD_OPS = { [3] = true, [4] = true, [5] = true, [13] = true }
for i = 1, #events do  -- refuse a malformed batch before writing anything
  local op = events[i][2]
  if type(op) == 'number' and op < 0 and op >= -11 and #events[i] >= 5 and not rebuild_call
  then op = -op end  -- a sequenced event
  if type(op) ~= 'number' or op < 1 or op > 16 or op == 14 or (op == 13 and not rebuild_call)
      or (rebuild_call and not REBUILD_OPS[op]) then
    return redis.error_reply('hardelete: unknown op ' .. tostring(events[i][2]))
  end
end
local K_FC, K_RB = P .. 'failclosed', P .. 'rebuild'
local chunk_done = nil
if rebuild_call then
  -- The snapshot the plan was computed from must still be the current one, and the flag the
  -- one it saw (no loss since): a new prepare or a new loss makes the plan stale.
  -- And the chunks applied so far must be the ones the rebuild applied: the count lives in
  -- the same slot, so a slot that went back between two chunks (a failover, an AOF tail)
  -- makes the next one stale instead of lifting the flag over the chunks it lost.
  local g = events[1]
  if g[3] ~= 'guard' or redis.call('HGET', K_RB, 'nonce') ~= g[4]
      or (redis.call('HGET', K_FC, 'losses') or '') ~= g[5]
      or (g[6] ~= nil and g[7] ~= '0' and (redis.call('HGET', K_RB, 'run') ~= g[6]
          or redis.call('HGET', K_RB, 'chunks') ~= g[7])) then
    return redis.error_reply('hardelete: rebuild is stale: its snapshot, the fail-closed '
                             .. 'flag or its chunks changed since it was prepared')
  end
end

-- A retired repository changes no more (the tracker dead-letters its events; this holds even
-- for a tracker whose cache missed the retirement). retire: retired by this call.
local dead = redis.call('HEXISTS', K_META, 'retired_at') == 1
local retire = false

if KEYS[2] ~= nil then
  local cur = redis.call('HGET', KEYS[2], ARGV[7]) or ''
  if cur ~= ARGV[8] then
    return redis.error_reply('hardelete: log record moved: ' .. ARGV[7] .. ' is "' .. cur ..
                             '", expected "' .. ARGV[8] .. '"')
  end
end
local epoch = ARGV[6] or ''
local last = -1
local rec = redis.call('HGET', K_APPLIED, part)
-- Redis Cluster (hd:log lives in another slot): the same guard on the repository's own
-- applied[partition], which must be what the tracker last saw ('*': it has not seen it yet).
-- (Further on, by another tracker after a rebalance, is no regression: only behind refuses.)
if KEYS[2] == nil and ARGV[7] == 'applied' and ARGV[8] ~= '*' and (rec or '') ~= ARGV[8] then
  local ce, co = string.match(rec or '', '^(.*):(%-?%d+)$')
  local xe, xo = string.match(ARGV[8], '^(.*):(%-?%d+)$')
  if ce == nil then ce, co = '', rec end
  if xe == nil then xe, xo = '', ARGV[8] end
  if ce ~= xe or tonumber(co or '-1') == nil or tonumber(co) < tonumber(xo) then
    return redis.error_reply('hardelete: log record moved: applied[' .. part .. '] of ' ..
                             repo .. ' is "' .. (rec or '') .. '", expected "' .. ARGV[8] .. '"')
  end
end
if rec then
  local e, o = string.match(rec, '^(.*):(%-?%d+)$')
  if e == nil then e, o = '', rec end  -- written before log epochs: epoch ""
  if e == epoch then last = tonumber(o) end
end
local maxoff, applied, skipped = last, 0, 0

-- continuity: is the repository sequenced, its declared stripes; each stripe's prefix is
-- written once, after the events (C.flush below)
local sequenced = redis.call('HGET', K_META, 'sequenced') == '1'
local stripes = tonumber(redis.call('HGET', K_META, 'stripes') or '1') or 1
local seq_dups = 0
C.defer_prefix()
local function set_sequenced()
  if not sequenced then
    redis.call('HSET', K_META, 'sequenced', '1')
    sequenced = true
  end
end
local function undeclared(k)
  if k >= stripes then
    C.break_domain(0, 'an event of stripe ' .. fmt(k) .. ', which the repository did not '
                   .. 'declare (stripes=' .. fmt(stripes) .. ')')
    return true
  end
  return false
end

for i = 1, #events do
  local e = events[i]
  local off, op = e[1], e[2]
  local seqd = op < 0  -- sequenced: (stripe, incarnation, seq) are its last three
  local admitted = true
  if seqd then op = -op end
  if seqd and off > last then
    if not sequenced then set_sequenced() end
    local n = #e
    local k = e[n - 2]
    if k >= stripes and undeclared(k) then admitted = false
    else admitted = C.admit(k, e[n - 1], e[n]) == 'apply' end
    if not admitted then seq_dups = seq_dups + 1 end
  end
  if off <= last then
    skipped = skipped + 1
  elseif not admitted then
    -- a duplicate, or refused (a broken stripe, a retired incarnation): its offset is done
    -- all the same, or a chunk of nothing else would never be recorded in applied[] and
    -- hd:log would wait on it for ever (one Redis: LOG_WRITE_LUA)
    skipped = skipped + 1
    if off > maxoff then maxoff = off end
  else
    applied = applied + 1
    if off > maxoff then maxoff = off end
    if op <= 11 and not seqd and sequenced and not rebuild_call then
      C.break_domain(0, 'an event without a seq (op ' .. fmt(op) .. ') in a sequenced '
                     .. 'repository')
    end
    if op == 15 then -- watermark: stripe, incarnation, M, R, applied at R (tick verified)
      -- broken (e[8]): the service recorded a break of the stripe; it certifies nothing
      set_sequenced()
      -- (e[9]: the epoch of that break; one from before the stripe's last rebuild is moot)
      if undeclared(e[3]) then
      elseif e[8] ~= nil and e[8] ~= '' and (e[9] or 0) >= C.epoch(e[3]) then
        C.break_domain(e[3], 'the service recorded a break: ' .. e[8])
      elseif not C.issued(e[6]) then  -- a tick this slot holds no reading of: nothing
        redis.call('HINCRBY', K_STATS, 'unknown_ticks', 1)
      else C.certify(e[3], e[4], e[5], e[6], e[7]) end
    elseif op == 16 then -- range gone: stripe, incarnation, from, to, reason
      set_sequenced()
      local inc = C.incarnation(e[3])  -- (the cache: this chunk's seqs count)
      if (inc == nil or inc == e[4]) and C.prefix(e[3]) < e[6] then
        C.break_domain(e[3], 'the service lost seqs ' .. fmt(e[5]) .. '..' .. fmt(e[6]) ..
                       ' of incarnation ' .. e[4] .. ': ' .. e[7])
      end
    elseif dead then -- retired: nothing changes
    elseif op == 4 then -- add: token, address, size, ref, rep_ref, rep_addr, event_id, type
      add_ref(e[4], e[6], e[3], e[5], e[9], e[10])
      if e[7] ~= '' then remove_ref(e[8], e[7], e[3], e[9], e[10]) end
    elseif op == 5 then -- delete: token, address, ref, event_id
      remove_ref(e[4], e[5], e[3], e[6], 'object_deleted')
    elseif op == 3 then -- issue: address, ttl_ms
      local r = load(e[3])
      if r.iu == nil then r.iu = now + e[4]; r.diu = true end
      derive(e[3], r)
    elseif op == 6 then -- commit: branch, commit, sealed, staging, record, event_id, version
      local changes = fresh(e[8], 'b:' .. e[3], e[9])
      for _, t in ipairs(e[5]) do claim_token(t, e[3], e[8], 'commit_created') end
      claim_token(e[6], e[3], e[8], 'commit_created')
      for _, t in ipairs(e[5]) do set_token(t, 'committed', e[8], 'commit_created') end
      set_token(e[6], 'open', e[8], 'commit_created')
      redis.call('HSETNX', K_COMMITS, e[4], e[7])
      if changes then redis.call('HSET', K_BRANCHES, e[3], branch_json(e[4], e[6])) end
    elseif op == 2 then -- branch created: branch, token, source_commit, version, event_id
      local changes = fresh(e[7], 'b:' .. e[3], e[6])
      claim_token(e[4], e[3], e[7], 'branch_created')
      set_token(e[4], 'open', '', 'branch_created')
      if changes then redis.call('HSET', K_BRANCHES, e[3], branch_json(e[5], e[4])) end
    elseif op == 7 then -- reset: branch, dropped, staging, head, event_id, version
      local changes = fresh(e[7], 'b:' .. e[3], e[8])
      for _, t in ipairs(e[4]) do claim_token(t, e[3], e[7], 'branch_reset') end
      claim_token(e[5], e[3], e[7], 'branch_reset')
      for _, t in ipairs(e[4]) do set_token(t, 'dropped', e[7], 'branch_reset') end
      set_token(e[5], 'open', e[7], 'branch_reset')
      if changes then redis.call('HSET', K_BRANCHES, e[3], branch_json(e[6], e[5])) end
    elseif op == 8 then -- branch deleted: branch, dropped, event_id, version
      local changes = fresh(e[5], 'b:' .. e[3], e[6])
      for _, t in ipairs(e[4]) do claim_token(t, e[3], e[5], 'branch_deleted') end
      for _, t in ipairs(e[4]) do set_token(t, 'dropped', e[5], 'branch_deleted') end
      if changes then redis.call('HDEL', K_BRANCHES, e[3]) end
    elseif op == 9 then -- tag: tag, commit, version, event_id
      if fresh(e[6], 't:' .. e[3], e[5]) then redis.call('HSET', K_TAGS, e[3], e[4]) end
    elseif op == 10 then -- untag: tag, version, event_id
      if fresh(e[5], 't:' .. e[3], e[4]) then redis.call('HDEL', K_TAGS, e[3]) end
    elseif op == 12 then -- addresses reaped: addresses, event_id
      for _, a in ipairs(e[3]) do reaped(a, e[4]) end
    elseif op == 13 then -- rebuild (tracker/rebuild.py): kind, ...
      local kind = e[3]
      if kind == 'tok' then -- token, state (ranks only move up, as for events)
        set_token(e[4], e[5], '', 'rebuilt')
      elseif kind == 'comm' then -- address a commit the mirror never saw holds
        local r = load(e[4])
        if not r.committed then r.committed = true; r.dcomm = true end
        derive(e[4], r)
      elseif kind == 'commit' then -- id, record
        redis.call('HSETNX', K_COMMITS, e[4], e[5])
      elseif kind == 'branch' then -- name, json, version: only when newer than the mirror's
        if newer('b:' .. e[4], e[6]) then redis.call('HSET', K_BRANCHES, e[4], e[5]) end
      elseif kind == 'tag' then -- name, commit, version
        if newer('t:' .. e[4], e[6]) then redis.call('HSET', K_TAGS, e[4], e[5]) end
      elseif kind == 'branch_gone' or kind == 'tag_gone' then
        -- name, version at the snapshot: gone at the service; removed unless an event changed
        -- it since the snapshot (then that event is newer than the export)
        local f, k = 't:', K_TAGS
        if kind == 'branch_gone' then f, k = 'b:', K_BRANCHES end
        if (redis.call('HGET', K_REFVER, f .. e[4]) or '-1') == fmt(e[5]) then
          redis.call('HDEL', k, e[4])
        end
      elseif kind == 'branch_deleted' or kind == 'tag_deleted' then
        -- name, the version of its deletion at the service: applied as the delete event
        -- would be (a tombstone: an older event of the ref, delivered later, is stale)
        local f, k = 't:', K_TAGS
        if kind == 'branch_deleted' then f, k = 'b:', K_BRANCHES end
        if newer(f .. e[4], e[5]) then redis.call('HDEL', k, e[4]) end
      elseif kind == 'cont' then -- stripe, incarnation, counter: the export's (last chunk)
        C.rebuild(e[4], e[5], e[6])
      elseif kind == 'chunk' then -- the count this chunk brings (written after the flush)
        chunk_done = {e[4], e[5]}
      elseif kind == 'lift' then -- incident json: the rebuilt mirror is proven; the flag lifts
        redis.call('DEL', K_FC, K_RB, P .. 'rebuild:snapshot')
        redis.call('RPUSH', K_INC, e[4])
        redis.call('HINCRBY', K_STATS, 'rebuilds', 1)
      end -- 'guard' was checked above
    elseif op == 11 then -- repository deleted (retired): event_id
      redis.call('HSET', K_META, 'retired_at', NOW, 'retired_event', e[3])
      dead, retire = true, true
    else -- op == 1, repository: namespace, default_branch, retention, branch_retention,
         -- stripes
      if redis.call('HSETNX', K_META, 'namespace', e[3]) == 1 then
        redis.call('HSET', K_META, 'default_branch', e[4], 'default_retention_days', e[5],
                   'branch_retention', e[6], 'stripes', fmt(e[7] or 1))
        stripes = e[7] or 1
      end
    end
  end
end

flush()
C.flush()
if chunk_done ~= nil and redis.call('EXISTS', K_RB) == 1 then
  redis.call('HSET', K_RB, 'run', chunk_done[1], 'chunks', chunk_done[2])
end
-- Retired: nothing of it may be deleted online (the queue is dropped after the flush, which may
-- have queued addresses of this batch; claims in flight are dropped with it).
if retire then redis.call('DEL', K_UNREF, K_CLAIMS) end
if maxoff > last and not rebuild_call then
  local v = fmt(maxoff)
  if epoch ~= '' then v = epoch .. ':' .. v end
  redis.call('HSET', K_APPLIED, part, v)
end
if applied > 0 and not rebuild_call then redis.call('HINCRBY', K_STATS, 'events', applied) end
if #incidents > 0 then redis.call('HINCRBY', K_STATS, 'incidents', #incidents) end
if dups > 0 then redis.call('HINCRBY', K_STATS, 'ref_duplicates', dups) end
if seq_dups > 0 then redis.call('HINCRBY', K_STATS, 'seq_duplicates', seq_dups) end
if reused > 0 then redis.call('HINCRBY', K_STATS, 'ref_ids_reused', reused) end
local result = { applied, skipped }
for i = 1, #incidents do result[#result + 1] = incidents[i] end
return result
