-- Twin of src/limiter/bucket.rs (token_bucket, leaky_bucket, gcra). State: "level at_us".

local function bucket_level(key, now, requests, period, burst, tick, cap)
  local stored, at = load_ints(key)
  if not stored then return 0 end
  local capacity = burst * idiv(period, tick)
  -- An overdraft limit's level may be in debt, up to its cap.
  local level = min(stored, math.max(capacity, cap))
  local elapsed = math.max(idiv(now, tick) - idiv(at, tick), 0)
  if elapsed >= ceil_div(level, requests) then return 0 end
  return level - elapsed * requests
end

local function bucket_drain_time(requests, tick, level, target, now)
  if level <= target then return 0 end
  local ticks = ceil_div(level - target, requests)
  return (idiv(now, tick) + ticks) * tick - now
end

local function bucket_store(key, now, requests, tick, level)
  if level == 0 then
    redis.call('DEL', key)
  else
    store_text(key, string.format('%.0f %.0f', level, now),
      now + bucket_drain_time(requests, tick, level, 0, now), now)
  end
end

-- Writes: the new level.
local function bucket_decide(key, now, hits, requests, period, burst, tick, cap)
  local p = idiv(period, tick)
  local capacity = burst * p
  local level = bucket_level(key, now, requests, period, burst, tick, cap)
  if cap > 0 then
    -- Overdraft: allowed while one unit of room is left, every hit goes in (up to the cap).
    local next_level = min(level + hits * p, cap)
    local write = nil
    if hits > 0 then write = next_level end
    if level <= capacity - p then
      return 1, idiv(math.max(capacity - next_level, 0), p),
        bucket_drain_time(requests, tick, next_level, 0, now), 0, write
    end
    return 0, idiv(math.max(capacity - level, 0), p),
      bucket_drain_time(requests, tick, level, 0, now),
      bucket_drain_time(requests, tick, level, capacity - p, now), write
  end
  if hits <= burst and level <= capacity - hits * p then
    local next_level = level + hits * p
    return 1, idiv(capacity - next_level, p),
      bucket_drain_time(requests, tick, next_level, 0, now), 0, next_level
  end
  local reset = bucket_drain_time(requests, tick, level, 0, now)
  local retry
  if hits > burst then
    retry = period
  else
    retry = bucket_drain_time(requests, tick, level, capacity - hits * p, now)
  end
  return 0, idiv(capacity - level, p), reset, retry
end

local function bucket_commit(key, now, requests, period, burst, tick, cap, level)
  bucket_store(key, now, requests, tick, level)
end

local function bucket_refund(key, now, hits, requests, period, burst, tick, cap)
  local p = idiv(period, tick)
  local level = bucket_level(key, now, requests, period, burst, tick, cap)
  bucket_store(key, now, requests, tick, math.max(level - hits * p, 0))
end
