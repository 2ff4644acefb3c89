-- sluice: decides one request's checks in one slot, all or nothing.
--
-- batch(keys, argv): a key per check. argv[1]: '' (time from Redis TIME) or a pinned time in
-- microseconds (tests only; TTLs are then padded, see prelude.lua). Then 9 arguments per
-- check: kind (1 enforce, 2 shadow, 3 refund), algorithm (1 fixed_window, 2 sliding_window,
-- 3 sliding_log, 4..6 the buckets), hits, requests, period_us, burst, tick_us, until (refunds
-- only: applied only while now < until; 0 always), cap (an overdraft limit's most recorded
-- usage; 0: not an overdraft limit, see Limit).
-- Reply: allowed (1/0), the time decided at (microseconds), then per check: allowed,
-- remaining, reset_after_us, retry_after_us.
-- Keys are unique among the non-refund checks (the caller merges repeats).

local ENFORCE, REFUND = 1, 3
local STRIDE = 9

local decide_of = {
  fixed_window_decide, sliding_window_decide, sliding_log_decide,
  bucket_decide, bucket_decide, bucket_decide,
}
local commit_of = {
  fixed_window_commit, sliding_window_commit, sliding_log_commit,
  bucket_commit, bucket_commit, bucket_commit,
}
local refund_of = {
  fixed_window_refund, sliding_window_refund, sliding_log_refund,
  bucket_refund, bucket_refund, bucket_refund,
}

-- A limit of 0 requests: nothing ever fits; a probe (0 hits) is allowed.
local function never(now, hits, period)
  local to_end = period - mod(now, period)
  if hits == 0 then return 1, 0, to_end, 0 end
  return 0, 0, to_end, to_end
end

local function decide(now, key, alg, hits, requests, period, burst, tick, cap)
  if requests == 0 then return never(now, hits, period) end
  return decide_of[alg](key, now, hits, requests, period, burst, tick, cap)
end

-- What a probe sees after a refund is what the refund reports.
local function refund(now, key, alg, hits, requests, period, burst, tick, cap)
  if requests == 0 then
    local _, r, reset, retry = never(now, 0, period)
    return 1, r, reset, retry
  end
  refund_of[alg](key, now, hits, requests, period, burst, tick, cap)
  local a, r, reset, retry = decide(now, key, alg, 0, requests, period, burst, tick, cap)
  return a, r, reset, retry
end

-- The limit of the check whose arguments start after `b`: requests, period, burst, tick, cap.
local function limit_at(argv, b)
  return tonumber(argv[b + 4]), tonumber(argv[b + 5]), tonumber(argv[b + 6]),
    tonumber(argv[b + 7]), tonumber(argv[b + 9])
end

local function batch(keys, argv)
  local now
  if argv[1] ~= '' then
    now = tonumber(argv[1])
    ttl_pad_ms = 3600000
  else
    ttl_pad_ms = 0
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  local n = #keys
  local reply = { 1, now }
  for j = 3, 2 + 4 * n do reply[j] = 0 end
  -- What would be written, 5 numbers per check that would write: its index, whether it is a
  -- cost limit's charge (1: written whatever the batch decides), and its writes.
  local pending = {}
  local allowed = 1
  for i = 1, n do
    local b = 1 + (i - 1) * STRIDE
    local kind = tonumber(argv[b + 1])
    if kind ~= REFUND then
      local alg, hits = tonumber(argv[b + 2]), tonumber(argv[b + 3])
      local requests, period, burst, tick, cap = limit_at(argv, b)
      local a, r, reset, retry, w1, w2, w3 =
        decide(now, keys[i], alg, hits, requests, period, burst, tick, cap)
      local o = 2 + (i - 1) * 4
      reply[o + 1], reply[o + 2], reply[o + 3], reply[o + 4] = a, r, reset, retry
      -- A cost limit's charge was spent already: recorded whatever the batch does.
      local charge = 0
      if cap > 0 and hits > 0 and requests > 0 then charge = 1 end
      if w1 ~= nil and (a == 1 or charge == 1) then
        if n == 1 then
          -- Alone, a check that would write decides the batch (or is a charge): write now.
          commit_of[alg](keys[i], now, requests, period, burst, tick, cap, w1, w2, w3)
        else
          local p = #pending
          pending[p + 1], pending[p + 2], pending[p + 3] = i, charge, w1
          pending[p + 4], pending[p + 5] = w2 or 0, w3 or 0
        end
      end
      if a ~= 1 and kind == ENFORCE then allowed = 0 end
    end
  end

  for p = 1, #pending, 5 do
    local i = pending[p]
    local b = 1 + (i - 1) * STRIDE
    if allowed == 1 or pending[p + 1] == 1 then
      local requests, period, burst, tick, cap = limit_at(argv, b)
      commit_of[tonumber(argv[b + 2])](keys[i], now, requests, period, burst, tick, cap,
        pending[p + 2], pending[p + 3], pending[p + 4])
    else
      -- Not consumed after all: what was left is left still.
      local o = 2 + (i - 1) * 4
      reply[o + 2] = reply[o + 2] + tonumber(argv[b + 3])
    end
  end

  -- Refunds apply whatever the decision: they return hits an earlier request consumed.
  for i = 1, n do
    local b = 1 + (i - 1) * STRIDE
    if tonumber(argv[b + 1]) == REFUND then
      local hits = tonumber(argv[b + 3])
      -- A lease's leftover may only go back to the window it came from.
      local refund_until = tonumber(argv[b + 8])
      if refund_until ~= 0 and now >= refund_until then hits = 0 end
      local requests, period, burst, tick, cap = limit_at(argv, b)
      local o = 2 + (i - 1) * 4
      reply[o + 1], reply[o + 2], reply[o + 3], reply[o + 4] =
        refund(now, keys[i], tonumber(argv[b + 2]), hits, requests, period, burst, tick, cap)
    end
  end
  reply[1] = allowed
  return reply
end
