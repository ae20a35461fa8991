"""The script that changes a repository's pause (``RepoKeys.paused``): a set of claims, one per
operator, as holds are (``hardelete/pause.py`` is the command; ``core/facts.py`` runs it for the
durable pause facts).

KEYS[1] the paused key; ARGV[1] 'add' (ARGV[2] who, ARGV[3] reason, ARGV[4] at ms) | 'remove'
(ARGV[2] who) | 'force' (every claim). Returns the value left ('' when no claim is left).
"""

PAUSE_LUA = """
local raw = redis.call('GET', KEYS[1])
local v = nil
if raw then
  local ok, d = pcall(cjson.decode, raw)
  if ok and type(d) == 'table' then v = d end
end
local claims = {}
if v and type(v['claims']) == 'table' then
  claims = v['claims']
elseif raw then
  claims['legacy'] = {reason = (v and v['reason']) or raw, at_ms = (v and v['at_ms']) or 0}
end
if ARGV[1] == 'add' then
  claims[ARGV[2]] = {reason = ARGV[3], at_ms = tonumber(ARGV[4])}
elseif ARGV[1] == 'remove' then
  claims[ARGV[2]] = nil
  claims['legacy'] = nil
else
  claims = {}
end
local reasons, first, n = {}, nil, 0
for _, c in pairs(claims) do
  n = n + 1
  reasons[#reasons + 1] = tostring(c['reason'])
  local at = tonumber(c['at_ms']) or 0
  if first == nil or at < first then first = at end
end
if n == 0 then
  redis.call('DEL', KEYS[1])
  return ''
end
table.sort(reasons)
local out = cjson.encode({reason = table.concat(reasons, '; '), at_ms = first, claims = claims})
redis.call('SET', KEYS[1], out)
return out
"""
