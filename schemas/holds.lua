--[[ hardelete holds: a hold is a set of claims (schemas/holds.py is the specification; a
differential test proves this script agrees with it).

A field of a holds hash (hd:{R}:holds: address -> json, hd:{R}:holdprefixes: prefix -> json)
exists while at least one party claims it; every delete path only asks whether it exists.
Its value:

  {"claims": {<claim id>: {"source", "reason", "at_ms", ...}}, "reason", "source", "at_ms"}

The top-level reason/source/at_ms summarise the oldest claim for readers that show one line.
A value of the shape before claims (no "claims" object, or not json) is one claim, "legacy",
that only a forced removal lifts. Claims are read, changed and written in one script, so a
claim added while another is removed is never lost.

KEYS[1]  the holds hash
ARGV[1]  'add': ARGV[2] '1' replaces a claim of the same id ('0': the first one stays),
                ARGV[3..] triples target, claim id, claim json.   Returns claims added.
         'remove': ARGV[2] target, ARGV[3] '1' force (every claim goes), ARGV[4..] claim ids.
                Returns {status, removed ids json, remaining ids json}; status is
                'none' (no hold), 'lifted' (no claim left: the field is gone) or 'kept'.
         'restore': KEYS[2] the reaper's claims zset, KEYS[3] the target's address record;
                ARGV[2] target, ARGV[3] claim id, ARGV[4] claim json. The claim is placed (or
                replaced) only while no reaper claims the target (in the claims set, or its
                record says 'reaping', whatever the lease: its delete may be in flight); then
                nothing is written. Returns {status, added '1'|'0', state, lease_until,
                claimer}: status 'held' or 'claimed' (schemas/holds.py restore_claim).
]]

local LEGACY = 'legacy'

local function claims_of(raw)
  if not raw then return {} end
  local ok, v = pcall(cjson.decode, raw)
  if ok and type(v) == 'table' and type(v.claims) == 'table' then return v.claims end
  local old = { reason = raw, source = '?' }
  if ok and type(v) == 'table' then old = v end
  return { [LEGACY] = old }
end

local function text(v)  -- a non-empty string, else nil
  if type(v) == 'string' and v ~= '' then return v end
  return nil
end

local function summary(claims)
  local first_id, first, first_at, n = nil, nil, nil, 0
  for id, c in pairs(claims) do
    n = n + 1
    local at = 0
    if type(c) == 'table' and type(c.at_ms) == 'number' then at = c.at_ms end
    if first == nil or at < first_at or (at == first_at and id < first_id) then
      first_id, first, first_at = id, c, at
    end
  end
  if first == nil then return nil end
  if type(first) ~= 'table' then first = {} end
  local reason = text(first.reason) or first_id
  if n > 1 then reason = reason .. ' (+' .. (n - 1) .. ' more)' end
  local at_ms = first.at_ms
  if at_ms == nil then at_ms = cjson.null end
  return cjson.encode({ claims = claims, reason = reason, source = text(first.source) or '?',
                        at_ms = at_ms })
end

local key = KEYS[1]
if ARGV[1] == 'add' then
  local replace = ARGV[2] == '1'
  local added = 0
  local values = {}  -- target -> claims, written once each
  local order = {}
  for i = 3, #ARGV, 3 do
    local target, id, claim = ARGV[i], ARGV[i + 1], cjson.decode(ARGV[i + 2])
    local claims = values[target]
    if claims == nil then
      claims = claims_of(redis.call('HGET', key, target))
      values[target] = claims
      order[#order + 1] = target
    end
    if claims[id] == nil then added = added + 1 end
    if claims[id] == nil or replace then claims[id] = claim end
  end
  for _, target in ipairs(order) do
    redis.call('HSET', key, target, summary(values[target]))
  end
  return added
end

if ARGV[1] == 'remove' then
  local target, force = ARGV[2], ARGV[3] == '1'
  local raw = redis.call('HGET', key, target)
  if not raw then return { 'none', '[]', '[]' } end
  local claims = claims_of(raw)
  local removed, remaining = {}, {}
  if force then
    for id in pairs(claims) do removed[#removed + 1] = id end
    claims = {}
  else
    for i = 4, #ARGV do
      local id = ARGV[i]
      if id ~= LEGACY and claims[id] ~= nil then
        claims[id] = nil
        removed[#removed + 1] = id
      end
    end
  end
  for id in pairs(claims) do remaining[#remaining + 1] = id end
  table.sort(removed)
  table.sort(remaining)
  local function ids(t) if #t == 0 then return '[]' end return cjson.encode(t) end
  if #remaining == 0 then
    redis.call('HDEL', key, target)
    return { 'lifted', ids(removed), '[]' }
  end
  if #removed > 0 then redis.call('HSET', key, target, summary(claims)) end
  return { 'kept', ids(removed), ids(remaining) }
end

if ARGV[1] == 'restore' then
  local target, id = ARGV[2], ARGV[3]
  local rec = redis.call('HMGET', KEYS[3], 'state', 'lease_until', 'claimer')
  local state = rec[1] or ''
  if state == 'reaping' or redis.call('ZSCORE', KEYS[2], target) then
    return { 'claimed', '0', state, rec[2] or '', rec[3] or '' }
  end
  local claims = claims_of(redis.call('HGET', key, target))
  local added = '0'
  if claims[id] == nil then added = '1' end
  claims[id] = cjson.decode(ARGV[4])
  redis.call('HSET', key, target, summary(claims))
  return { 'held', added, state, '', '' }
end

return redis.error_reply('hardelete holds: unknown op ' .. tostring(ARGV[1]))
