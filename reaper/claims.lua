-- Reaper claims, atomic per repository (all keys share the {repo} hash tag).
-- Every decision is re-checked here, at claim time, on the Redis clock: the queue (unref zset)
-- only says where to look, never what to delete. The decision is schemas/liveness.py's
-- judgment (path "online"), rule for rule and reason for reason; a differential test on a
-- real Redis proves they agree (tests/test_liveness_lua.py).
--
-- KEYS[1] unref zset, KEYS[2] claims zset, KEYS[3] tokens hash, KEYS[4] reaped zset,
-- KEYS[5] stats hash, KEYS[6] holds hash, KEYS[7] hold prefixes hash,
-- KEYS[8] repository fail-closed hash, KEYS[9] repository paused string, KEYS[10] the
-- repository's hash (sequenced, stripes)
-- ARGV[1] op: 'claim' | 'complete' | 'prune' | 'restore'
-- claim:    ARGV[2] address key prefix, ARGV[3] cutoff ms (horizon - grace), ARGV[4] limit,
--           ARGV[5] lease ms, ARGV[6] claimer id, ARGV[7] '1' = dry run (write nothing),
--           ARGV[8] the repository's key prefix, ARGV[9] grace ms (a sequenced repository's
--           cutoff is also its continuity horizon - grace)
--           A fail-closed or paused repository claims nothing (4th result: the reason); the
--           global fail-closed key is not in this slot: the reaper checks it in Python.
-- complete: ARGV[2] prefix, ARGV[3..] addresses whose delete the store confirmed
-- prune:    ARGV[2] prefix, ARGV[3] tombstone ms, ARGV[4] limit
-- restore:  ARGV[2] prefix, ARGV[3] address restored from quarantine
local op = ARGV[1]
local prefix = ARGV[2]
-- The slot's clock (continuity.lua's C.clock, read without moving it: a since stamped here is
-- never below a tick read before, whatever the node's clock did since).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slot = string.match(prefix, '^(.*)a:$')
if slot ~= nil then
  local high = tonumber(redis.call('GET', slot .. 'clock') or '0') or 0
  if high > now then now = high end
end

-- An address record: plain fields, added refs (+ref -> token), removed refs (-ref -> token).
local function read_record(addr)
  local h = redis.call('HGETALL', prefix .. addr)
  if #h == 0 then return nil end
  local f, adds, removes = {}, {}, {}
  for i = 1, #h, 2 do
    local k, v = h[i], h[i + 1]
    local c = string.sub(k, 1, 1)
    if c == '+' then adds[string.sub(k, 2)] = v
    elseif c == '-' then removes[string.sub(k, 2)] = v
    else f[k] = v end
  end
  return f, adds, removes
end

local token_cache = {}
local function token_state(tok)
  local v = token_cache[tok]
  if v == nil then
    local raw = redis.call('HGET', KEYS[3], tok)
    if raw then v = string.match(raw, '^([^:]+)') else v = 'unknown' end
    token_cache[tok] = v
  end
  return v
end

-- A reference that was added and not ended (only a removal naming the add's own token ends
-- it) keeps the address unless its token was dropped; open, sealed, committed, doubt and
-- unknown tokens all keep it.
local function has_live_ref(adds, removes)
  for ref, tok in pairs(adds) do
    if removes[ref] ~= tok and token_state(tok) ~= 'dropped' then return true end
  end
  return false
end

-- the sticky doubt flag (schemas/records.py: present and not '' or '0')
local function doubtful(f)
  local d = f['doubt']
  return d ~= nil and d ~= '' and d ~= '0'
end

if op == 'complete' then
  local done = 0
  for i = 3, #ARGV do
    local addr = ARGV[i]
    local key = prefix .. addr
    local st = redis.call('HMGET', key, 'state', 'size')
    if st[1] == 'reaping' then
      redis.call('HSET', key, 'state', 'reaped', 'reaped_at', now)
      redis.call('HDEL', key, 'lease_until')  -- the claimer stays: who deleted it (explain)
      redis.call('ZREM', KEYS[2], addr)
      redis.call('ZADD', KEYS[4], now, addr)
      redis.call('HINCRBY', KEYS[5], 'reaped', 1)
      redis.call('HINCRBY', KEYS[5], 'reaped_bytes', tonumber(st[2] or '0') or 0)
      done = done + 1
    end
  end
  return done
end

if op == 'restore' then
  -- ARGV[3] address brought back from quarantine: its state follows from its record again.
  local addr = ARGV[3]
  local key = prefix .. addr
  local f, adds, removes = read_record(addr)
  if f == nil then return 'unknown' end
  if f['state'] ~= 'reaped' then return f['state'] or 'no-state' end
  local next_state = 'unreferenced'
  if f['committed'] == '1' then next_state = 'committed'
  elseif has_live_ref(adds, removes) or doubtful(f) then next_state = 'staged' end
  redis.call('HSET', key, 'state', next_state, 'since', now)
  redis.call('HDEL', key, 'reaped_at')
  redis.call('ZREM', KEYS[4], addr)
  if next_state == 'unreferenced' then redis.call('ZADD', KEYS[1], now, addr) end
  redis.call('HINCRBY', KEYS[5], 'restored', 1)
  return next_state
end

if op == 'prune' then
  -- A tombstone is dropped only when its record protects nothing: no reference that is not
  -- removed (whatever its token, unless dropped), not committed, no upload still issued and
  -- no reference activity within the tombstone time. Anything else keeps the record (looked
  -- at again a tombstone time later): without it the reconciler would take a live object
  -- for a leak.
  local tomb = tonumber(ARGV[3])
  local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - tomb,
                         'LIMIT', 0, tonumber(ARGV[4]))
  local pruned = 0
  for _, addr in ipairs(old) do
    local f, adds, removes = read_record(addr)
    if f == nil or f['state'] ~= 'reaped' then
      redis.call('ZREM', KEYS[4], addr)  -- gone, or no longer a tombstone (restored)
    else
      local iu = tonumber(f['iu'] or '')
      local since = tonumber(f['since'] or '')
      local flag = f['committed']
      if has_live_ref(adds, removes) or doubtful(f)
          or (flag ~= nil and flag ~= '' and flag ~= '0')
          or (f['iu'] ~= nil and (iu == nil or iu > now))
          or (f['since'] ~= nil and (since == nil or since > now - tomb)) then
        redis.call('ZADD', KEYS[4], now, addr)
      else
        redis.call('DEL', prefix .. addr)
        redis.call('ZREM', KEYS[4], addr)
        pruned = pruned + 1
      end
    end
  end
  return pruned
end

-- op == 'claim'
local cutoff = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local lease = tonumber(ARGV[5])
local claimer = ARGV[6]
local dry = ARGV[7] == '1'

-- holds: an exact address, or any prefix of the (few) hold prefixes
local hold_prefixes = nil
local function held(addr)
  if redis.call('HEXISTS', KEYS[6], addr) == 1 then return true end
  if hold_prefixes == nil then hold_prefixes = redis.call('HKEYS', KEYS[7]) end
  for _, p in ipairs(hold_prefixes) do
    if string.sub(addr, 1, #p) == p then return true end
  end
  return false
end

-- a number field: nil when absent, false when present but not a number (doubt keeps)
local function num(f, name)
  local v = f[name]
  if v == nil then return nil end
  -- the same grammar as schemas/records.py (no inf, exponents, hex or spaces)
  if not string.match(v, '^%-?%d+%.?%d*$') then return false end
  return tonumber(v)
end

local KNOWN = { staged = true, committed = true, issued = true, unreferenced = true,
                reaping = true, reaped = true }

-- Returns 'ok', size, since  or a reason to keep (schemas/liveness.py, path online).
local function check(addr)
  local f, adds, removes = read_record(addr)
  if f == nil then return 'gone' end
  if held(addr) then return 'held' end
  local since, iu, size, lease = num(f, 'since'), num(f, 'iu'), num(f, 'size'),
                                 num(f, 'lease_until')
  if since == false or iu == false or size == false or lease == false
      or num(f, 'reaped_at') == false then
    return 'doubt'
  end
  if doubtful(f) then return 'doubt' end
  local live, comm_tok, unknown = false, false, false
  for ref, tok in pairs(adds) do
    if removes[ref] ~= tok then
      local ts = token_state(tok)
      if ts == 'unknown' or ts == 'open' or ts == 'sealed' then live = true
      elseif ts == 'committed' then comm_tok = true
      elseif ts ~= 'dropped' then unknown = true end
    end
  end
  if live then return 'staged' end
  if unknown then return 'doubt' end
  local st = f['state']
  local flag = f['committed']
  if (flag ~= nil and flag ~= '' and flag ~= '0') or comm_tok or st == 'committed' then
    return 'committed'
  end
  if st == 'reaping' and lease ~= nil and lease > now then return 'claimed' end
  if st == nil or st == '' or not KNOWN[st] or st == 'staged' then return 'doubt' end
  if st == 'issued' and iu == nil then return 'doubt' end
  -- 'reaped' last (liveness.py rule 9): no record overrides an upload or the grace window
  if iu ~= nil and (iu > now or iu > cutoff) then return 'issued' end
  if st == 'reaped' then
    local at = num(f, 'reaped_at')
    if since == nil or (at ~= nil and at > since) then since = at end
  end
  if since == nil then return 'doubt' end
  if since > cutoff then return 'young' end
  if st == 'reaped' then return 'reaped' end
  return 'ok', size or 0, since
end

local claimed, kept = {}, {}
local function consider(addr)
  local verdict, size, since = check(addr)
  if verdict == 'ok' then
    if not dry then
      redis.call('HSET', prefix .. addr, 'state', 'reaping', 'lease_until', now + lease,
                 'claimer', claimer)
      redis.call('ZREM', KEYS[1], addr)
      redis.call('ZADD', KEYS[2], now + lease, addr)
    end
    table.insert(claimed, {addr, size, since})
  else
    table.insert(kept, {addr, verdict})
    -- Stale queue entries (now live, committed, reaped, gone, doubtful) leave the queue so
    -- they cannot clog its head; the tracker queues an address again whenever it becomes
    -- unreferenced. A held address is looked at again after a lease (its record keeps its
    -- own since: the queue's score only says when to look).
    if not dry then
      if verdict == 'held' then
        redis.call('ZADD', KEYS[1], now + lease, addr)
      elseif verdict ~= 'young' and verdict ~= 'issued' and verdict ~= 'claimed' then
        redis.call('ZREM', KEYS[1], addr)
      end
    end
  end
end

-- A fail-closed or paused repository: nothing is claimed, nothing is touched.
if redis.call('EXISTS', KEYS[8]) == 1 then return {now, {}, {}, 'fail_closed'} end
if redis.call('EXISTS', KEYS[9]) == 1 then return {now, {}, {}, 'paused'} end

-- A sequenced repository (schemas/README.md, "Continuity"): its service certifies its own
-- history, and the horizon beside its records (this slot, read in this script) bounds the
-- cutoff too; none yet (a gap, a broken stripe, no watermark) claims nothing.
if ARGV[8] ~= nil and redis.call('HGET', KEYS[10], 'sequenced') == '1' then
  local C = continuity(ARGV[8])
  local h = C.horizon(tonumber(redis.call('HGET', KEYS[10], 'stripes') or '1') or 1)
  if h == nil then return {now, {}, {}, 'continuity'} end
  if h - tonumber(ARGV[9]) < cutoff then cutoff = h - tonumber(ARGV[9]) end
end

-- Claims whose reaper died (lease expired) are taken again first.
-- A claim that no longer passes the checks (a late reference arrived, which the tracker recorded
-- as an incident) is released to the state its record now implies, never deleted.
for _, addr in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)) do
  local before = #claimed
  consider(addr)
  if not dry and #claimed == before then
    local key = prefix .. addr
    if redis.call('HGET', key, 'state') == 'reaping' then
      local verdict = kept[#kept][2]
      local next_state = 'unreferenced'
      if verdict == 'staged' then next_state = 'staged' end
      if verdict == 'committed' then next_state = 'committed' end
      redis.call('HSET', key, 'state', next_state)
      redis.call('HDEL', key, 'lease_until', 'claimer')
      if next_state == 'unreferenced' then
        local f = redis.call('HMGET', key, 'since', 'iu')
        redis.call('ZADD', KEYS[1], math.max(tonumber(f[1] or now), tonumber(f[2] or 0)), addr)
      end
    end
    redis.call('ZREM', KEYS[2], addr)
  end
end
local room = limit - #claimed
if room > 0 then
  for _, addr in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, room)) do
    consider(addr)
  end
end
return {now, claimed, kept}
