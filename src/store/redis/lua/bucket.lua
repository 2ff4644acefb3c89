-- Twin of src/limiter/bucket.rs (token_bucket, leaky_bucket, gcra). State: "level at_us".

local function bucket_level(key, lim, now)
  local s = load_ints(key)
  if not s then return 0 end
  local capacity = lim.burst * idiv(lim.period, lim.tick)
  -- An overdraft limit's level may be in debt, up to its cap.
  local level = min(s[1], math.max(capacity, lim.cap))
  local elapsed = math.max(idiv(now, lim.tick) - idiv(s[2], lim.tick), 0)
  if elapsed >= ceil_div(level, lim.requests) then return 0 end
  return level - elapsed * lim.requests
end

local function bucket_drain_time(lim, level, target, now)
  if level <= target then return 0 end
  local ticks = ceil_div(level - target, lim.requests)
  return (idiv(now, lim.tick) + ticks) * lim.tick - now
end

local function bucket_store(key, lim, now, level)
  if level == 0 then
    store_ints(key, nil)
  else
    store_ints(key, { level, now }, now + bucket_drain_time(lim, level, 0, now), now)
  end
end

local function bucket_decide(key, lim, now, hits)
  local p = idiv(lim.period, lim.tick)
  local capacity = lim.burst * p
  local level = bucket_level(key, lim, now)
  if lim.cap > 0 then
    -- Overdraft: allowed while one unit of room is left, every hit goes in (up to the cap).
    local next_level = min(level + hits * p, lim.cap)
    local commit = nil
    if hits > 0 then
      commit = function() bucket_store(key, lim, now, next_level) end
    end
    if level <= capacity - p then
      return { 1, idiv(math.max(capacity - next_level, 0), p), bucket_drain_time(lim, next_level, 0, now), 0 }, commit
    end
    return { 0, idiv(math.max(capacity - level, 0), p), bucket_drain_time(lim, level, 0, now),
      bucket_drain_time(lim, level, capacity - p, now) }, commit
  end
  if hits <= lim.burst and level <= capacity - hits * p then
    local next_level = level + hits * p
    local commit = function() bucket_store(key, lim, now, next_level) end
    return { 1, idiv(capacity - next_level, p), bucket_drain_time(lim, next_level, 0, now), 0 }, commit
  end
  local reset = bucket_drain_time(lim, level, 0, now)
  local retry
  if hits > lim.burst then
    retry = lim.period
  else
    retry = bucket_drain_time(lim, level, capacity - hits * p, now)
  end
  return { 0, idiv(capacity - level, p), reset, retry }, nil
end

local function bucket_refund(key, lim, now, hits)
  local p = idiv(lim.period, lim.tick)
  local level = bucket_level(key, lim, now)
  bucket_store(key, lim, now, math.max(level - hits * p, 0))
end
