--[[ hardelete tracker: apply a batch of ONE repository's events atomically.

The specification is tracker/references.py (a differential test proves this script agrees with
it); the key layout is schemas/layout.py. Events arrive pre-validated and in compact form
(tracker/codec.py: [offset, op, ...]); admission (namespace, reserved prefixes, unknown
repository) happened in Python.

KEYS[1]  <tag>:repo             (routes the call to the repository's slot; all keys below share it)
ARGV[1]  <tag>:                 key prefix of the repository, e.g. "hd:{repo}:"
ARGV[2]  repository id          (for incidents)
ARGV[3]  partition              (events with offset <= applied[partition] are skipped)
ARGV[4]  events                 JSON array of compact events
ARGV[5]  now override (ms)      "" in production: the Redis clock (TIME) is the only clock

Returns {applied, skipped, incident_json...}.
]]

local P = ARGV[1]
local repo = ARGV[2]
local part = ARGV[3]
local events = cjson.decode(ARGV[4])
local now
if ARGV[5] ~= nil and ARGV[5] ~= '' then
  now = tonumber(ARGV[5])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local K_META, K_TOKENS, K_BRANCHES = P .. 'repo', P .. 'tokens', P .. 'branches'
local K_COMMITS, K_TAGS, K_UNREF = P .. 'commits', P .. 'tags', P .. 'unref'
local K_INC, K_APPLIED, K_STATS = P .. 'incidents', P .. 'applied', P .. 'stats'
local AP, TP = P .. 'a:', P .. 't:'

local RANK = { open = 0, sealed = 1, dropped = 2, committed = 3 }
local function fmt(n) return string.format('%d', n) end
local NOW = fmt(now)

local incidents = {}
local function incident(address, event_id, etype, ref)
  local j = cjson.encode({ repository = repo, address = address, event_id = event_id,
                           type = etype, ref_id = ref, at_ms = now })
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

--[[ Recompute the committed flag and (unless the reaper holds it) the state of an address.
inc_ref/inc_token: a newly added ref to check for an incident; commit_tok: a token that just
moved dropped -> committed (incident for each of its refs if the reaper holds the address). ]]
local function derive(address, size, inc_ref, ev_id, ev_type, commit_tok)
  local akey = AP .. address
  local h = redis.call('HGETALL', akey)
  local adds, rems = {}, {}
  local state, since, committed, iu, cursize = nil, nil, false, nil, nil
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    local c = string.byte(f, 1)
    if c == 43 then adds[string.sub(f, 2)] = v          -- '+'
    elseif c == 45 then rems[string.sub(f, 2)] = true   -- '-'
    elseif f == 'state' then state = v
    elseif f == 'since' then since = v
    elseif f == 'committed' then committed = true
    elseif f == 'iu' then iu = tonumber(v)
    elseif f == 'size' then cursize = tonumber(v)
    end
  end
  if size ~= nil and (cursize == nil or size > cursize) then
    redis.call('HSET', akey, 'size', fmt(size))
  end
  local held = (state == 'reaping' or state == 'reaped')
  if held and inc_ref ~= nil and not rems[inc_ref] and tok_state(adds[inc_ref]) ~= 'dropped' then
    incident(address, ev_id, ev_type, inc_ref)
  end
  local live, comm = false, committed
  for ref, tok in pairs(adds) do
    if not rems[ref] then
      local ts = tok_state(tok)
      if ts == 'committed' then
        comm = true
        if held and commit_tok ~= nil and tok == commit_tok then
          incident(address, ev_id, ev_type, ref)
        end
      elseif ts == false or ts == 'open' or ts == 'sealed' then
        live = true
      end
    end
  end
  if comm and not committed then redis.call('HSET', akey, 'committed', '1') end
  if held then return end
  if comm or live then
    local new = comm and 'committed' or 'staged'
    if state ~= new then redis.call('HSET', akey, 'state', new) end
    if since then
      redis.call('HDEL', akey, 'since')
      redis.call('ZREM', K_UNREF, address)
    end
  elseif iu ~= nil and iu > now then
    local s = fmt(iu)
    if state ~= 'issued' or since ~= s then
      redis.call('HSET', akey, 'state', 'issued', 'since', s)
      redis.call('ZADD', K_UNREF, iu, address)
    end
  else
    redis.call('HSET', akey, 'state', 'unreferenced', 'since', NOW)
    redis.call('ZADD', K_UNREF, now, address)
  end
end

local function set_token(t, new, ev_id, ev_type)
  local cur = tok_state(t)
  if cur and RANK[new] <= RANK[cur] then return end
  redis.call('HSET', K_TOKENS, t, new .. ':' .. NOW)
  tokcache[t] = new
  local commit_tok = nil
  if cur == 'dropped' and new == 'committed' then commit_tok = t end
  local members = redis.call('SMEMBERS', TP .. t)
  for i = 1, #members do
    derive(members[i], nil, nil, ev_id, ev_type, commit_tok)
  end
end

local function branch_json(head, token)
  local h = 'null'
  if head ~= nil and head ~= '' then h = cjson.encode(head) end
  return '{"head":' .. h .. ',"staging_token":' .. cjson.encode(token) .. ',"sealed_tokens":[]}'
end

local last = tonumber(redis.call('HGET', K_APPLIED, part) or '-1')
local maxoff, applied, skipped = last, 0, 0

for i = 1, #events do
  local e = events[i]
  local off, op = e[1], e[2]
  if off <= last then
    skipped = skipped + 1
  else
    applied = applied + 1
    if off > maxoff then maxoff = off end
    if op == 4 then -- add: token, address, size, ref, rep_ref, rep_addr, event_id, type
      local tok, address, ref = e[3], e[4], e[6]
      local new = redis.call('HSETNX', AP .. address, '+' .. ref, tok)
      redis.call('SADD', TP .. tok, address)
      if new == 1 then
        derive(address, e[5], ref, e[9], e[10], nil)
      else
        derive(address, e[5], nil, nil, nil, nil)
      end
      if e[7] ~= '' then
        redis.call('HSETNX', AP .. e[8], '-' .. e[7], tok)
        derive(e[8], nil, nil, nil, nil, nil)
      end
    elseif op == 5 then -- delete: token, address, ref
      redis.call('HSETNX', AP .. e[4], '-' .. e[5], e[3])
      derive(e[4], nil, nil, nil, nil, nil)
    elseif op == 3 then -- issue: address, ttl_ms
      redis.call('HSETNX', AP .. e[3], 'iu', fmt(now + e[4]))
      derive(e[3], nil, nil, nil, nil, nil)
    elseif op == 6 then -- commit: branch, commit, sealed, staging, record, event_id
      for _, t in ipairs(e[5]) do set_token(t, 'committed', e[8], 'commit_created') end
      set_token(e[6], 'open', e[8], 'commit_created')
      redis.call('HSETNX', K_COMMITS, e[4], e[7])
      redis.call('HSET', K_BRANCHES, e[3], branch_json(e[4], e[6]))
    elseif op == 2 then -- branch created: branch, token, source_commit
      redis.call('HSET', K_BRANCHES, e[3], branch_json(e[5], e[4]))
      set_token(e[4], 'open', '', 'branch_created')
    elseif op == 7 then -- reset: branch, dropped, staging, head, event_id
      for _, t in ipairs(e[4]) do set_token(t, 'dropped', e[7], 'branch_reset') end
      set_token(e[5], 'open', e[7], 'branch_reset')
      local head = e[6]
      if head == '' then
        local prev = redis.call('HGET', K_BRANCHES, e[3])
        if prev then
          local h = cjson.decode(prev).head
          if type(h) == 'string' then head = h end
        end
      end
      redis.call('HSET', K_BRANCHES, e[3], branch_json(head, e[5]))
    elseif op == 8 then -- branch deleted: branch, dropped, event_id
      for _, t in ipairs(e[4]) do set_token(t, 'dropped', e[5], 'branch_deleted') end
      redis.call('HDEL', K_BRANCHES, e[3])
    elseif op == 9 then
      redis.call('HSET', K_TAGS, e[3], e[4])
    elseif op == 10 then
      redis.call('HDEL', K_TAGS, e[3])
    elseif op == 1 then -- repository: namespace, default_branch, retention, branch_retention
      if redis.call('HSETNX', K_META, 'namespace', e[3]) == 1 then
        redis.call('HSET', K_META, 'default_branch', e[4], 'default_retention_days', e[5],
                   'branch_retention', e[6])
      end
    else
      return redis.error_reply('unknown op ' .. tostring(op))
    end
  end
end

if maxoff > last then redis.call('HSET', K_APPLIED, part, fmt(maxoff)) end
if applied > 0 then redis.call('HINCRBY', K_STATS, 'events', applied) end
if #incidents > 0 then redis.call('HINCRBY', K_STATS, 'incidents', #incidents) end
local result = { applied, skipped }
for i = 1, #incidents do result[#result + 1] = incidents[i] end
return result
