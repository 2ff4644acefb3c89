-- Twin of src/limiter/sliding_log.rs. State: a list whose first element is the total of the
-- stamps' hits and whose other elements are stamps "at_us hits", oldest first.

local function sliding_log_stamp(s)
  local at, h = string.match(s, '(%d+) (%d+)')
  return tonumber(at), tonumber(h)
end

-- The total, how many of the oldest stamps have expired and their hits, and the list length.
local function sliding_log_scan(key, now, period)
  local n = redis.call('LLEN', key)
  if n == 0 then return 0, 0, 0, 0 end
  local total = tonumber(redis.call('LINDEX', key, 0))
  local gone, gone_hits = 0, 0
  local i = 1
  while i < n do
    local chunk = redis.call('LRANGE', key, i, i + 63)
    for _, s in ipairs(chunk) do
      local at, h = sliding_log_stamp(s)
      if at + period > now then return total, gone, gone_hits, n end
      gone = gone + 1
      gone_hits = gone_hits + h
    end
    i = i + 64
  end
  return total, gone, gone_hits, n
end

-- Drops `gone` expired stamps, adds `hits` at `now` (merged into a stamp of the same time),
-- and rewrites the total; an empty log is deleted.
local function sliding_log_apply(key, now, period, gone, new_total, hits)
  if gone > 0 then
    redis.call('LTRIM', key, gone + 1, -1)
    redis.call('LPUSH', key, string.format('%.0f', new_total - hits))
  elseif redis.call('EXISTS', key) == 1 then
    redis.call('LSET', key, 0, string.format('%.0f', new_total - hits))
  else
    redis.call('RPUSH', key, string.format('%.0f', new_total - hits))
  end
  if hits > 0 then
    local last = redis.call('LINDEX', key, -1)
    local at, h = nil, nil
    if redis.call('LLEN', key) > 1 then at, h = sliding_log_stamp(last) end
    if at == now then
      redis.call('LSET', key, -1, string.format('%.0f %.0f', at, h + hits))
    else
      redis.call('RPUSH', key, string.format('%.0f %.0f', now, hits))
    end
    redis.call('LSET', key, 0, string.format('%.0f', new_total))
  end
  if redis.call('LLEN', key) <= 1 then
    redis.call('DEL', key)
  else
    local newest = sliding_log_stamp(redis.call('LINDEX', key, -1))
    expire_at(key, newest + period, now)
  end
end

-- Writes: the expired stamps to drop, the new total, the hits to stamp now.
local function sliding_log_decide(key, now, hits, requests, period, burst, tick, cap)
  local total, gone, gone_hits, n = sliding_log_scan(key, now, period)
  local used = total - gone_hits
  local newest = nil
  if n - 1 > gone then newest = sliding_log_stamp(redis.call('LINDEX', key, -1)) end
  if hits <= requests and used <= requests - hits then
    local last = newest
    if hits > 0 then last = now end
    local reset = 0
    if last then reset = last + period - now end
    return 1, requests - used - hits, reset, 0, gone, used + hits, hits
  end
  local reset = 0
  if newest then reset = newest + period - now end
  local retry
  if hits > requests then
    retry = period
  else
    retry = reset
    local still = used
    local i = 1 + gone
    local found = false
    while i < n and not found do
      local chunk = redis.call('LRANGE', key, i, i + 63)
      for _, s in ipairs(chunk) do
        local at, h = sliding_log_stamp(s)
        still = still - h
        if still + hits <= requests then
          retry = at + period - now
          found = true
          break
        end
      end
      i = i + 64
    end
  end
  return 0, math.max(requests - used, 0), reset, retry
end

local function sliding_log_commit(key, now, requests, period, burst, tick, cap,
                                  gone, new_total, hits)
  sliding_log_apply(key, now, period, gone, new_total, hits)
end

local function sliding_log_refund(key, now, hits, requests, period, burst, tick, cap)
  local total, gone, gone_hits, n = sliding_log_scan(key, now, period)
  if n == 0 then return end
  sliding_log_apply(key, now, period, gone, total - gone_hits, 0)
  local left = hits
  local removed = 0
  while left > 0 and redis.call('LLEN', key) > 1 do
    local at, h = sliding_log_stamp(redis.call('LINDEX', key, -1))
    local take = min(left, h)
    if take == h then
      redis.call('RPOP', key)
    else
      redis.call('LSET', key, -1, string.format('%.0f %.0f', at, h - take))
    end
    left = left - take
    removed = removed + take
  end
  if redis.call('LLEN', key) <= 1 then
    redis.call('DEL', key)
  else
    redis.call('LSET', key, 0, string.format('%.0f', total - gone_hits - removed))
  end
end
