--[[ hardelete: the in-slot part of the evidence every delete request is judged on, read at once
(core/gate.py read_evidence). One script, so the address records, their claims and the
repository's continuity horizon come from one moment of the repository's slot (assumption A5
of schemas/README.md, "Continuity": a horizon never judges records older than the state that
certified it). core/continuity.lua is prepended.

KEYS[1] the repository's hash (sequenced, stripes); ARGV[1] its key prefix "hd:{R}:",
ARGV[2] the address key prefix, ARGV[3] the claims zset, ARGV[4..] addresses.
Returns {sequenced ('1' or '0'), horizon ('' when none), record_1, ..., record_n,
claim_1, ..., claim_n} (records as HGETALL, claims as ZSCORE).
]]
local out = {'0', ''}
if redis.call('HGET', KEYS[1], 'sequenced') == '1' then
  out[1] = '1'
  local h = continuity(ARGV[1]).horizon(tonumber(redis.call('HGET', KEYS[1], 'stripes') or '1')
                                        or 1)
  if h ~= nil then out[2] = string.format('%.0f', h) end
end
for i = 4, #ARGV do out[#out + 1] = redis.call('HGETALL', ARGV[2] .. ARGV[i]) end
for i = 4, #ARGV do out[#out + 1] = redis.call('ZSCORE', ARGV[3], ARGV[i]) or false end
return out
