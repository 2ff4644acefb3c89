-- sluice: decides one request's checks in one slot, all or nothing.
--
-- KEYS: one per check. ARGV[1]: '' (time from Redis TIME) or a pinned time in microseconds
-- (tests only; TTLs are then padded, see prelude.lua). Then 9 arguments per check: kind (1 enforce, 2 shadow, 3 refund), algorithm
-- (1 fixed_window, 2 sliding_window, 3 sliding_log, 4..6 the buckets), hits, requests,
-- period_us, burst, tick_us, until (refunds only: applied only while now < until; 0 always),
-- cap (an overdraft limit's most recorded usage; 0: not an overdraft limit, see Limit).
-- Reply: allowed (1/0), the time decided at (microseconds), then per check: allowed,
-- remaining, reset_after_us, retry_after_us.
-- Keys are unique among the non-refund checks (the caller merges repeats).

local ENFORCE, REFUND = 1, 3

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  ttl_pad_ms = 3600000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function never(lim, hits)
  local to_end = lim.period - mod(now, lim.period)
  local retry = to_end
  if hits == 0 then retry = 0 end
  local allowed = 0
  if hits == 0 then allowed = 1 end
  return { allowed, 0, to_end, retry }
end

local function decide(alg, key, lim, hits)
  if lim.requests == 0 then return never(lim, hits), nil end
  if alg == 1 then return fixed_window_decide(key, lim, now, hits) end
  if alg == 2 then return sliding_window_decide(key, lim, now, hits) end
  if alg == 3 then return sliding_log_decide(key, lim, now, hits) end
  return bucket_decide(key, lim, now, hits)
end

local function refund(alg, key, lim, hits)
  if lim.requests == 0 then
    local v = never(lim, 0)
    v[1] = 1
    return v
  end
  if alg == 1 then fixed_window_refund(key, lim, now, hits)
  elseif alg == 2 then sliding_window_refund(key, lim, now, hits)
  elseif alg == 3 then sliding_log_refund(key, lim, now, hits)
  else bucket_refund(key, lim, now, hits) end
  -- What a probe sees now is what a refund reports.
  local v = decide(alg, key, lim, 0)
  return v
end

local checks = {}
for i = 1, #KEYS do
  local b = 1 + (i - 1) * 9
  checks[i] = {
    kind = tonumber(ARGV[b + 1]),
    alg = tonumber(ARGV[b + 2]),
    hits = tonumber(ARGV[b + 3]),
    lim = {
      requests = tonumber(ARGV[b + 4]),
      period = tonumber(ARGV[b + 5]),
      burst = tonumber(ARGV[b + 6]),
      tick = tonumber(ARGV[b + 7]),
      cap = tonumber(ARGV[b + 9]),
    },
    refund_until = tonumber(ARGV[b + 8]),
  }
end

local verdicts, commits = {}, {}
local allowed = 1
for i, c in ipairs(checks) do
  if c.kind ~= REFUND then
    local v, commit = decide(c.alg, KEYS[i], c.lim, c.hits)
    verdicts[i] = v
    -- A cost limit's charge was spent already: recorded whatever the batch does.
    c.charge = c.lim.cap > 0 and c.hits > 0 and c.lim.requests > 0
    if v[1] == 1 or c.charge then
      commits[i] = commit
    end
    if v[1] ~= 1 and c.kind == ENFORCE then
      allowed = 0
    end
  end
end

for i, c in ipairs(checks) do
  if commits[i] then
    if allowed == 1 or c.charge then
      commits[i]()
    else
      verdicts[i][2] = verdicts[i][2] + c.hits
    end
  end
end

-- Refunds apply whatever the decision: they return hits an earlier request consumed.
for i, c in ipairs(checks) do
  if c.kind == REFUND then
    local hits = c.hits
    -- A lease's leftover may only go back to the window it came from.
    if c.refund_until ~= 0 and now >= c.refund_until then hits = 0 end
    verdicts[i] = refund(c.alg, KEYS[i], c.lim, hits)
  end
end

local reply = { allowed, now }
for i = 1, #checks do
  for j = 1, 4 do reply[#reply + 1] = verdicts[i][j] end
end
return reply
