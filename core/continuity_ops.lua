-- The continuity functions one call at a time (composed after core/continuity.lua by
-- core.continuity_store; the tracker's apply.lua and the claim script call them in their own
-- scripts instead).
--
-- KEYS[1] any key of the repository's slot (routes the call), ARGV[1] its key prefix
-- "hd:{<id>}:", ARGV[2] the op, then:
--   admit   k, incarnation, seq      -> 'apply' | 'duplicate' | 'refused'
--   certify k, incarnation, M, R, A  -> 'ok'  (A: the seq applied at the tick)
--   applied k                        -> the highest seq applied, a decimal string
--   break   k, reason                -> 'ok'
--   rebuild k, incarnation, counter  -> 'ok'
--   read    k                        -> {{field, value, ...}, {above seqs}, {'<M>:<R>', ...}}
--   gaps    k, limit                 -> {a1, b1, a2, b2, ...}
--   horizon n (stripes)              -> R as a decimal string, or '' (none)
local C = continuity(ARGV[1])
local op = ARGV[2]
if op == 'admit' then
  return C.admit(ARGV[3], ARGV[4], ARGV[5])
elseif op == 'certify' then
  C.certify(ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
  return 'ok'
elseif op == 'applied' then
  return string.format('%.0f', C.applied_max(ARGV[3]))
elseif op == 'break' then
  C.break_domain(ARGV[3], ARGV[4])
  return 'ok'
elseif op == 'rebuild' then
  C.rebuild(ARGV[3], ARGV[4], ARGV[5])
  return 'ok'
elseif op == 'read' then
  local fields, above, pending = C.read(ARGV[3])
  return {fields, above, pending}
elseif op == 'gaps' then
  return C.gaps(ARGV[3], ARGV[4])
elseif op == 'horizon' then
  local h = C.horizon(ARGV[3])
  if h == nil then return '' end
  return string.format('%.0f', h)
end
return redis.error_reply('hardelete continuity: unknown op ' .. tostring(op))
