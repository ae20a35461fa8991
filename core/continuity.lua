--[[ hardelete continuity: the state machine of one ordering domain, in the repository's slot.

core/continuity.py is the specification; this implements it rule for rule (a differential test
on a real Redis and Redis Cluster proves they agree: tests/integration/core/test_continuity_lua.py).

A library: it defines one local, `continuity`, and runs nothing. A script that needs it is this
file followed by its own body (core.continuity_store.compose), which calls

  local C = continuity(P)        -- P: the repository's key prefix "hd:{<id>}:" (its slot)
  C.admit(k, inc, seq)           -> 'apply' | 'duplicate' | 'refused'
  C.certify(k, inc, M, R, A)     -- a watermark (its tick's signature checked by the caller);
                                 -- A: the seq the tracker had applied at the tick (or nil)
  C.applied_max(k)               -> the highest seq applied (the prefix or the top of above)
  C.prefix(k)                    -> every seq up to it is applied
  C.break_domain(k, reason)
  C.rebuild(k, inc, counter)     -- core.continuity.rebuilt: the export's incarnation and
                                 -- counter start the stripe again (its epoch + 1)
  C.epoch(k)                     -> the stripe's rebuilds so far
  C.incarnation(k)               -> the stripe's incarnation, or nil before its first fact
  C.is_broken(k)                 -> true when the stripe is broken
  C.stripe_horizon(k)            -> R (a number) or nil
  C.horizon(n)                   -> the repository's horizon over stripes 0..n-1, or nil
  C.gaps(k, limit)               -> {a1, b1, a2, b2, ...}: the ranges to ask again for
  C.read(k)                      -> {fields}, {above}, {pending}: the whole state (strings)
  C.clock()                      -> the slot's clock, ms (core.continuity.slot_clock): the
                                 -- node's TIME, never below what the slot read before
  C.issue(R)                     -- the slot read a tick R (kept: the newest TICKS_KEPT)
  C.issued(R)                    -> true when the slot still holds that tick
  C.defer_prefix()               -- from now on an admission moves the prefix in the cache only
  C.flush()                      -- writes the prefixes deferred so far (a script that called
                                 -- C.defer_prefix() calls it before it returns)

k is the stripe (0..63). Numbers (seq, M, R) are decimal strings (or Lua numbers) holding
integers 0..2^53-1: exact in Lua's doubles, and written with '%.0f', never tostring (which
gives 1e+15 notation). Bad input raises an error starting 'hardelete continuity:' before
anything is written.

Keys of stripe k (schemas/layout.py RepoKeys.continuity*), all in P's slot:
  P..'cont:'..k    hash  inc, prefix, horizon, broken (absent: None; prefix absent: 0),
                         retired (a JSON array of incarnations, sorted; absent: none),
                         epoch (rebuilds so far; absent: 0)
  P..'above:'..k   zset  member = score = a seq applied above the prefix
  P..'wm:'..k      zset  member '<M>:<R>', score M: the pending watermarks (M and R both
                         strictly increasing, at most PENDING_MAX)

One call of `continuity(P)` caches each stripe's hash and watermarks for the script it runs in
and writes every change through, so callers may mix it with other commands on other keys but
must not write these keys themselves, nor read them in the same script but through C. The
one exception is C.defer_prefix(): a script that admits many seqs (apply.lua, one call per
chunk of events) then writes each stripe's prefix once, in C.flush(), instead of once per seq
(an HSET per seq costs more than the rest of an admission). The script is atomic, so nothing
else sees the difference; a script that fails before its flush leaves the prefix where it
was, as it leaves the address records of the events it applied (apply.lua writes those at
its end too).
]]

local function continuity(P)
  local SEQ_MAX = 9007199254740991  -- core.continuity.SEQ_MAX (2^53 - 1)
  local PENDING_MAX = 32            -- core.continuity.PENDING_MAX
  local RETIRED_MAX = 8             -- core.continuity.RETIRED_MAX
  local STRIPES_MAX = 64
  local RUN = 128                   -- seqs read at a time when the prefix advances

  local function fail(msg) error({err = 'hardelete continuity: ' .. msg}) end

  local function fmt(n) return string.format('%.0f', n) end

  -- An integer lo..hi from a decimal string (no sign, no leading zero) or a Lua number.
  local function int(v, what, lo, hi)
    local n
    if type(v) == 'number' then
      n = v
    elseif type(v) == 'string' and (v == '0' or (#v <= 16 and string.match(v, '^[1-9]%d*$'))) then
      n = tonumber(v)
    end
    if n == nil or n ~= math.floor(n) or n < lo or n > hi then
      fail(what .. ' must be an integer in ' .. fmt(lo) .. '..' .. fmt(hi) .. ', got '
           .. tostring(v))
    end
    return n
  end

  -- Python's repr() of a str (the reason a changed incarnation gives): exact for ASCII and
  -- for U+0080..U+00FF; other characters pass through as they are (Python escapes the few
  -- it deems unprintable).
  local function pyrepr(s)
    local q = "'"
    if string.find(s, "'", 1, true) and not string.find(s, '"', 1, true) then q = '"' end
    local out, i, n = {}, 1, #s
    while i <= n do
      local b = string.byte(s, i)
      local ch = string.sub(s, i, i)
      if ch == q or ch == '\\' then out[#out + 1] = '\\' .. ch
      elseif ch == '\t' then out[#out + 1] = '\\t'
      elseif ch == '\n' then out[#out + 1] = '\\n'
      elseif ch == '\r' then out[#out + 1] = '\\r'
      elseif b < 32 or b == 127 then out[#out + 1] = string.format('\\x%02x', b)
      elseif (b == 0xC2 or b == 0xC3) and i < n then
        local cp = (b - 0xC0) * 64 + (string.byte(s, i + 1) - 0x80)
        if cp <= 0xA0 or cp == 0xAD then out[#out + 1] = string.format('\\x%02x', cp)
        else out[#out + 1] = string.sub(s, i, i + 1) end
        i = i + 1
      else out[#out + 1] = ch end
      i = i + 1
    end
    return q .. table.concat(out) .. q
  end

  local S = {}  -- stripe -> {k, hash, above, wm, inc, prefix, horizon, broken, pending}
  local defer = false  -- C.defer_prefix(): settle leaves the prefix to C.flush (s.dirty)

  local function stripe(k)
    k = int(k, 'stripe', 0, STRIPES_MAX - 1)
    local s = S[k]
    if s then return s end
    local name = fmt(k)
    s = {hash = P .. 'cont:' .. name, above = P .. 'above:' .. name, wm = P .. 'wm:' .. name}
    local h = redis.call('HMGET', s.hash, 'inc', 'prefix', 'horizon', 'broken', 'retired',
                         'epoch')
    s.inc = h[1] or nil
    s.prefix = h[2] and tonumber(h[2]) or 0
    s.horizon = h[3] and tonumber(h[3]) or nil
    s.broken = h[4] or nil  -- '' is a reason too
    s.retired = h[5] and cjson.decode(h[5]) or {}
    s.epoch = h[6] and tonumber(h[6]) or 0
    s.nabove = redis.call('ZCARD', s.above)  -- (kept by this script: in-order seqs skip it)
    local pending = {}
    local raw = redis.call('ZRANGE', s.wm, 0, -1)
    for j = 1, #raw do
      local m, r = string.match(raw[j], '^(%d+):(%d+)$')
      pending[#pending + 1] = {m = tonumber(m), r = tonumber(r), member = raw[j]}
    end
    s.pending = pending
    S[k] = s
    return s
  end

  local function watermark(m, r) return {m = m, r = r, member = fmt(m) .. ':' .. fmt(r)} end

  -- Replace the stored watermarks by `kept` (the cached list is the truth of this script).
  local function write_pending(s, kept)
    local keep = {}
    for _, w in ipairs(kept) do keep[w.member] = true end
    for _, w in ipairs(s.pending) do
      if not keep[w.member] then redis.call('ZREM', s.wm, w.member) end
      keep[w.member] = nil
    end
    for _, w in ipairs(kept) do
      if keep[w.member] then redis.call('ZADD', s.wm, fmt(w.m), w.member) end
    end
    s.pending = kept
  end

  local function break_stripe(s, reason)
    if s.broken ~= nil then return end
    s.broken = reason
    s.horizon = nil
    s.pending = {}
    redis.call('HSET', s.hash, 'broken', reason)
    redis.call('HDEL', s.hash, 'horizon')
    redis.call('DEL', s.wm)
  end

  -- The domain's incarnation, set by the first sequenced fact; a second one breaks it.
  local function bind(s, inc)
    if type(inc) ~= 'string' or inc == '' then fail('incarnation must be a non-empty string') end
    if s.inc == nil then
      s.inc = inc
      redis.call('HSET', s.hash, 'inc', inc)
    elseif s.inc ~= inc then
      break_stripe(s, 'incarnation changed from ' .. pyrepr(s.inc) .. ' to ' .. pyrepr(inc))
    end
  end

  -- The prefix moved to seq: take the run of seqs above it that now follows it.
  local function advance(s)
    while s.nabove > 0 do
      local low = redis.call('ZRANGE', s.above, 0, RUN - 1)
      local n = 0
      for j = 1, #low do
        if tonumber(low[j]) ~= s.prefix + 1 then break end
        s.prefix = s.prefix + 1
        n = n + 1
      end
      if n > 0 then
        redis.call('ZREMRANGEBYRANK', s.above, 0, n - 1)
        s.nabove = s.nabove - n
      end
      if n < RUN then return end
    end
  end

  -- Watermarks the prefix now covers become the horizon (core.continuity._settle).
  local function settle(s)
    if defer and #s.pending == 0 then  -- (nothing to settle: the common case)
      s.dirty = true
      return
    end
    local h = s.horizon
    for _, w in ipairs(s.pending) do
      if w.m <= s.prefix and (h == nil or w.r > h) then h = w.r end
    end
    local kept = {}
    for _, w in ipairs(s.pending) do
      if w.m > s.prefix and (h == nil or w.r > h) then kept[#kept + 1] = w end
    end
    if #kept ~= #s.pending then write_pending(s, kept) end
    if h ~= s.horizon then
      s.horizon = h
      redis.call('HSET', s.hash, 'prefix', fmt(s.prefix), 'horizon', fmt(h))
      s.dirty = false
    elseif defer then
      s.dirty = true
    else
      redis.call('HSET', s.hash, 'prefix', fmt(s.prefix))
    end
  end

  local function retired(s, inc)
    for _, r in ipairs(s.retired) do
      if r == inc then return true end
    end
    return false
  end

  local C = {}

  -- (the hot path of apply.lua, once per sequenced event: the checks that cannot change a
  -- verdict are skipped, as the cache of a stripe already read, an incarnation already bound)
  function C.admit(k, inc, seq)
    seq = int(seq, 'seq', 0, SEQ_MAX)
    if seq == 0 then fail('seq starts at 1') end
    local s = S[k] or stripe(k)  -- (S holds checked stripes only)
    if s.broken ~= nil or (#s.retired > 0 and retired(s, inc)) then return 'refused' end
    if s.inc ~= inc then
      bind(s, inc)
      if s.broken ~= nil then return 'refused' end
    end
    if seq <= s.prefix then return 'duplicate' end
    if seq == s.prefix + 1 then  -- (never in `above`: the prefix would have taken it)
      s.prefix = seq
      if s.nabove > 0 then advance(s) end
    else
      if redis.call('ZSCORE', s.above, fmt(seq)) then return 'duplicate' end
      redis.call('ZADD', s.above, fmt(seq), fmt(seq))
      s.nabove = s.nabove + 1
    end
    settle(s)
    return 'apply'
  end

  function C.certify(k, inc, m, r, a)
    m = int(m, 'watermark seq', 0, SEQ_MAX)
    r = int(r, 'watermark tick', 0, SEQ_MAX)
    a = int(a or 0, 'watermark applied', 0, SEQ_MAX)
    local s = stripe(k)
    if s.broken ~= nil or retired(s, inc) then return end
    bind(s, inc)
    if s.broken ~= nil then return end
    if m < a then  -- core.continuity.lied
      break_stripe(s, 'a watermark says seq <= ' .. fmt(m) .. ' at tick ' .. fmt(r)
                   .. ', when seq ' .. fmt(a) .. ' was applied already: its relay read a '
                   .. 'store that lags (a standby or a replica?)')
      return
    end
    if s.horizon ~= nil and r <= s.horizon then return end  -- certifies nothing new
    if m <= s.prefix then
      local kept = {}
      for _, p in ipairs(s.pending) do
        if p.r > r then kept[#kept + 1] = p end
      end
      if #kept ~= #s.pending then write_pending(s, kept) end
      s.horizon = r
      redis.call('HSET', s.hash, 'horizon', fmt(r))
      return
    end
    -- Keep M and R increasing: drop what w dominates; drop w if something dominates it.
    local kept = {}
    for _, p in ipairs(s.pending) do
      if not (p.m >= m and p.r <= r) then kept[#kept + 1] = p end
    end
    for _, p in ipairs(kept) do
      if p.m <= m and p.r >= r then return end  -- (and the stored list stays as it was)
    end
    local w = watermark(m, r)
    local at = #kept + 1
    for j, p in ipairs(kept) do
      if p.m > m then at = j break end
    end
    table.insert(kept, at, w)
    if #kept > PENDING_MAX then  -- the lowest PENDING_MAX - 1 and the highest
      local trimmed = {}
      for j = 1, PENDING_MAX - 1 do trimmed[j] = kept[j] end
      trimmed[PENDING_MAX] = kept[#kept]
      kept = trimmed
    end
    write_pending(s, kept)
  end

  function C.break_domain(k, reason)
    if type(reason) ~= 'string' then fail('reason must be a string') end
    break_stripe(stripe(k), reason)
  end

  function C.rebuild(k, inc, counter)
    counter = int(counter, 'counter', 0, SEQ_MAX)
    if type(inc) ~= 'string' or inc == '' then fail('incarnation must be a non-empty string') end
    local s = stripe(k)
    local set = {}
    for _, r in ipairs(s.retired) do set[r] = true end
    if s.inc ~= nil then set[s.inc] = true end
    set[inc] = nil
    local list = {}
    for r in pairs(set) do list[#list + 1] = r end
    table.sort(list)  -- (byte order, as Python sorts str of these: code point order in UTF-8)
    local keep = {}
    for j = math.max(1, #list - RETIRED_MAX + 1), #list do keep[#keep + 1] = list[j] end
    redis.call('DEL', s.hash, s.above, s.wm)
    redis.call('HSET', s.hash, 'inc', inc, 'prefix', fmt(counter), 'epoch', fmt(s.epoch + 1))
    if #keep > 0 then redis.call('HSET', s.hash, 'retired', cjson.encode(keep)) end
    s.inc, s.prefix, s.horizon, s.broken = inc, counter, nil, nil
    s.nabove, s.pending, s.retired, s.epoch = 0, {}, keep, s.epoch + 1
    s.dirty = false
  end

  function C.defer_prefix() defer = true end

  function C.flush()
    for _, s in pairs(S) do
      if s.dirty then
        redis.call('HSET', s.hash, 'prefix', fmt(s.prefix))
        s.dirty = false
      end
    end
  end

  function C.epoch(k) return stripe(k).epoch end

  function C.incarnation(k) return stripe(k).inc end

  function C.is_broken(k) return stripe(k).broken ~= nil end

  function C.stripe_horizon(k) return stripe(k).horizon end

  function C.prefix(k) return stripe(k).prefix end

  function C.applied_max(k)
    local s = stripe(k)
    if s.nabove == 0 then return s.prefix end
    return tonumber(redis.call('ZRANGE', s.above, -1, -1)[1])
  end

  -- Every time a since is stamped with or a tick is read at comes from here: a clock that
  -- steps back (or a failover to a replica whose clock is behind) only stalls it, so a since
  -- stamped after a tick is never below it (schemas/README.md, "Assumptions", A7).
  function C.clock()
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local high = tonumber(redis.call('GET', P .. 'clock') or '0') or 0
    if now <= high then return high end
    redis.call('SET', P .. 'clock', fmt(now))
    return now
  end

  -- A watermark certifies only a tick this slot holds the reading of: one read on a state the
  -- slot then lost (a failover to a replica that missed it) would certify past sinces it
  -- stamps afterwards on a clock that may be behind (schemas/README.md, A7).
  local TICKS_KEPT = 64
  function C.issue(r)
    r = int(r, 'tick', 0, SEQ_MAX)
    redis.call('ZADD', P .. 'ticks', r, fmt(r))
    redis.call('ZREMRANGEBYRANK', P .. 'ticks', 0, -(TICKS_KEPT + 1))
  end

  function C.issued(r)
    return redis.call('ZSCORE', P .. 'ticks', fmt(int(r, 'tick', 0, SEQ_MAX))) ~= false
  end

  function C.horizon(n)
    n = int(n, 'stripes', 0, STRIPES_MAX)
    if n == 0 then return nil end
    local least
    for k = 0, n - 1 do
      local h = stripe(k).horizon
      if h == nil then return nil end
      if least == nil or h < least then least = h end
    end
    return least
  end

  function C.gaps(k, limit)
    limit = int(limit, 'limit', 0, SEQ_MAX)
    local s = stripe(k)
    local out = {}
    if s.broken ~= nil or limit == 0 then return out end
    local top = s.prefix
    local last = redis.call('ZRANGE', s.above, -1, -1)
    if #last > 0 then top = tonumber(last[1]) end
    if #s.pending > 0 and s.pending[#s.pending].m > top then top = s.pending[#s.pending].m end
    local start = s.prefix + 1
    local function visit(v)  -- true when the list is full
      if v > start then
        out[#out + 1] = fmt(start)
        out[#out + 1] = fmt(v - 1)
        if #out >= 2 * limit then return true end
      end
      if v + 1 > start then start = v + 1 end
      return false
    end
    local from = 0
    while true do
      local chunk = redis.call('ZRANGE', s.above, from, from + RUN - 1)
      for j = 1, #chunk do
        if visit(tonumber(chunk[j])) then return out end
      end
      if #chunk < RUN then break end
      from = from + RUN
    end
    visit(top + 1)
    return out
  end

  function C.read(k)
    local s = stripe(k)
    local fields = {}
    local function put(name, v)
      if v ~= nil then fields[#fields + 1] = name; fields[#fields + 1] = v end
    end
    put('inc', s.inc)
    put('prefix', fmt(s.prefix))
    if s.horizon ~= nil then put('horizon', fmt(s.horizon)) end
    put('broken', s.broken)
    if #s.retired > 0 then put('retired', cjson.encode(s.retired)) end
    if s.epoch > 0 then put('epoch', fmt(s.epoch)) end
    local pending = {}
    for _, w in ipairs(s.pending) do pending[#pending + 1] = w.member end
    return fields, redis.call('ZRANGE', s.above, 0, -1), pending
  end

  return C
end
