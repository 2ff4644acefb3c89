-- Twin of src/limiter/bucket.rs (token_bucket, leaky_bucket, gcra). State: "empty_tick:frac",
-- the tick the level is zero again plus frac/requests of one (frac < requests): the level at
-- tick t is (empty_tick - t) * requests + frac units, a hit being period/tick units. A level is
-- carried as a pair (ticks, frac), ticks from now: a cost limit's debt can pass 2^53 units,
-- its drain time cannot (the cap, 2^52 µs), so no number here passes 2^53. A key written by
-- the version before ("level at_us") is read as the same level.

local TWO_53 = 9007199254740992

-- a * b divided by m, exactly (integers below 2^53): quotient and remainder. A quotient past
-- `bound` is returned as bound + 1 (the callers cap there anyway).
local function mul_divmod(a, b, m, bound)
  local product = a * b
  if product < TWO_53 then
    local q = idiv(product, m)
    return q, product - q * m
  end
  -- b = bq * m + br, so a * b = a * bq * m + a * br.
  local bq = idiv(b, m)
  local br = b - bq * m
  local q = 0
  if bq > 0 then
    if a > idiv(bound, bq) then return bound + 1, 0 end
    q = a * bq
  end
  -- a * br by doubling and adding, a's bits from the top; r < m throughout, and each sum is
  -- compared before it is made, so none passes 2^53.
  local low, r, bit = 0, 0, 1
  while bit * 2 <= a do bit = bit * 2 end
  while bit >= 1 do
    low = low * 2
    if r >= m - r then r = r - (m - r); low = low + 1 else r = r + r end
    if a >= bit then
      a = a - bit
      if r >= m - br then r = r - (m - br); low = low + 1 else r = r + br end
    end
    if low > bound then return bound + 1, 0 end
    bit = bit / 2
  end
  q = q + low
  if q > bound then return bound + 1, 0 end
  return q, r
end

-- Whether level (t1, f1) is at most (t2, f2).
local function level_le(t1, f1, t2, f2)
  return t1 < t2 or (t1 == t2 and f1 <= f2)
end

-- `units` (at most the capacity) as a level (ticks, frac).
local function bucket_level_of(requests, units)
  local t = idiv(units, requests)
  return t, units - t * requests
end

-- Whether the level (t, f) is at most `units` (at most the capacity).
local function bucket_at_most(requests, t, f, units)
  local ut, uf = bucket_level_of(requests, units)
  return level_le(t, f, ut, uf)
end

-- Whole ticks until the level (t, f) is at most `units` (at most the capacity).
local function bucket_ticks_to(requests, t, f, units)
  local tt, tf = bucket_level_of(requests, units)
  if level_le(t, f, tt, tf) then return 0 end
  if f > tf then return t - tt + 1 end
  return t - tt
end

local function bucket_drain_time(requests, tick, t, f, target, now)
  local ticks = bucket_ticks_to(requests, t, f, target)
  if ticks == 0 then return 0 end
  return (idiv(now, tick) + ticks) * tick - now
end

-- Hits' worth of room above the level (t, f); none at or past the capacity.
local function bucket_room(requests, p, capacity, t, f)
  if bucket_at_most(requests, t, f, capacity) then
    return idiv(capacity - (t * requests + f), p)
  end
  return 0
end

-- The level (t, f) plus `hits` hits, recorded up to `cap` ticks of drain.
local function bucket_plus(requests, p, cap, t, f, hits)
  -- A quotient past the room left is as good as any: the cap.
  local room = cap - t
  local q, rem = mul_divmod(hits, p, requests, room)
  local nf, carry
  if f >= requests - rem then nf, carry = f - (requests - rem), 1 else nf, carry = f + rem, 0 end
  if q + carry < room or (q + carry == room and nf == 0) then return t + q + carry, nf end
  return cap, 0
end

-- The level (t, f) less `hits` hits, never below zero.
local function bucket_minus(requests, p, t, f, hits)
  -- A quotient past the level is as good as any: empty.
  local q, rem = mul_divmod(hits, p, requests, t)
  if level_le(t, f, q, rem) then return 0, 0 end
  if f >= rem then return t - q, f - rem end
  return t - q - 1, requests - (rem - f)
end

-- The level now, as (ticks, frac), bounded by the capacity or a cost limit's cap.
local function bucket_level(key, now_tick, requests, capacity, tick, cap)
  local v = redis.call('GET', key)
  if not v then return 0, 0 end
  local e, f
  local a, b = string.match(v, '^(%d+):(%d+)$')
  if a then
    e, f = tonumber(a), tonumber(b)
  else
    local level, at = string.match(v, '^(%d+) (%d+)$')
    if not level then return 0, 0 end
    level = tonumber(level)
    e = idiv(tonumber(at), tick) + idiv(level, requests)
    f = mod(level, requests)
  end
  -- A fraction of another rate (the rule changed since): its whole ticks carried over.
  e = e + idiv(f, requests)
  f = mod(f, requests)
  if e < now_tick then return 0, 0 end
  local t = e - now_tick
  if cap > 0 then
    if t > cap or (t == cap and f > 0) then return cap, 0 end
  elseif not bucket_at_most(requests, t, f, capacity) then
    return bucket_level_of(requests, capacity)
  end
  return t, f
end

local function bucket_store(key, now, tick, t, f)
  if t == 0 and f == 0 then
    redis.call('DEL', key)
  else
    local e = idiv(now, tick) + t
    local empty = e
    if f > 0 then empty = e + 1 end
    store_text(key, string.format('%.0f:%.0f', e, f), empty * tick, now)
  end
end

-- Writes: the new level's ticks and fraction.
local function bucket_decide(key, now, hits, requests, period, burst, tick, cap)
  local p = idiv(period, tick)
  local capacity = burst * p
  local t, f = bucket_level(key, idiv(now, tick), requests, capacity, tick, cap)
  if cap > 0 then
    -- Overdraft: allowed while one unit of room is left, every hit goes in (up to the cap).
    local nt, nf, write, write_f = t, f, nil, nil
    if hits > 0 then
      nt, nf = bucket_plus(requests, p, cap, t, f, hits)
      write, write_f = nt, nf
    end
    local room_at = capacity - p
    if bucket_at_most(requests, t, f, room_at) then
      return 1, bucket_room(requests, p, capacity, nt, nf),
        bucket_drain_time(requests, tick, nt, nf, 0, now), 0, write, write_f
    end
    return 0, bucket_room(requests, p, capacity, t, f),
      bucket_drain_time(requests, tick, t, f, 0, now),
      bucket_drain_time(requests, tick, t, f, room_at, now), write, write_f
  end
  if hits <= burst and bucket_at_most(requests, t, f, capacity - hits * p) then
    local nt, nf = bucket_level_of(requests, t * requests + f + hits * p)
    return 1, bucket_room(requests, p, capacity, nt, nf),
      bucket_drain_time(requests, tick, nt, nf, 0, now), 0, nt, nf
  end
  local reset = bucket_drain_time(requests, tick, t, f, 0, now)
  local retry
  if hits > burst then
    retry = period
  else
    retry = bucket_drain_time(requests, tick, t, f, capacity - hits * p, now)
  end
  return 0, bucket_room(requests, p, capacity, t, f), reset, retry
end

local function bucket_commit(key, now, requests, period, burst, tick, cap, t, f)
  bucket_store(key, now, tick, t, f)
end

local function bucket_refund(key, now, hits, requests, period, burst, tick, cap)
  local p = idiv(period, tick)
  local t, f = bucket_level(key, idiv(now, tick), requests, burst * p, tick, cap)
  bucket_store(key, now, tick, bucket_minus(requests, p, t, f, hits))
end
