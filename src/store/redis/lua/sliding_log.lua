-- Twin of src/limiter/sliding_log.rs. State: a list whose first element is the total of the
-- stamps' hits and whose other elements are stamps "at_us hits", oldest first.

local function sliding_log_stamp(s)
  local space = string.find(s, ' ', 1, true)
  return tonumber(string.sub(s, 1, space - 1)), tonumber(string.sub(s, space + 1))
end

-- The total (nil: no log), how many of the oldest stamps have expired and their hits, and
-- whether a stamp is left after them. The first read brings the total and four stamps; later
-- chunks grow. A call usually finds one or two stamps expired since the last, and every stamp
-- read becomes a Lua string.
local function sliding_log_scan(key, now, period)
  local chunk = redis.call('LRANGE', key, 0, 4)
  if #chunk == 0 then return nil, 0, 0, false end
  local total = tonumber(chunk[1])
  local gone, gone_hits = 0, 0
  local first, asked, size, next_index = 2, 5, 4, 5
  while true do
    for j = first, #chunk do
      local at, h = sliding_log_stamp(chunk[j])
      if at + period > now then return total, gone, gone_hits, true end
      gone = gone + 1
      gone_hits = gone_hits + h
    end
    if #chunk < asked then return total, gone, gone_hits, false end
    size = min(size * 4, 256)
    chunk = redis.call('LRANGE', key, next_index, next_index + size - 1)
    first, asked, next_index = 1, size, next_index + size
  end
end

-- Writes (only where hits are stamped; a probe leaves expired stamps for the next write to
-- drop, which every read skips): the expired stamps to drop, the new total, the hits, and
-- whether there is a log (0) or not (-1). A stamp at the same time as the newest is a stamp of
-- its own, not merged as the Rust twin merges it: the verdicts are the same (they sum hits by
-- time), and merging would read the newest stamp on every call.
local function sliding_log_decide(key, now, hits, requests, period, burst, tick, cap)
  local total, gone, gone_hits, left = sliding_log_scan(key, now, period)
  local used = (total or 0) - gone_hits
  local fits = hits <= requests and used <= requests - hits
  if fits and hits > 0 then
    local tail = 0
    if not total then tail = -1 end
    return 1, requests - used - hits, period, 0, gone, used + hits, hits, tail
  end
  local reset = 0
  if left then reset = sliding_log_stamp(redis.call('LINDEX', key, -1)) + period - now end
  if fits then return 1, requests - used, reset, 0 end
  local retry
  if hits > requests then
    retry = period
  else
    -- When enough of the oldest stamps will have expired for the hits to fit.
    retry = reset
    local still, i, found = used, 1 + gone, false
    while not found do
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
      if #chunk < 64 then break end
      i = i + 64
    end
  end
  return 0, math.max(requests - used, 0), reset, retry
end

-- Drops `gone` expired stamps, stamps `hits` (> 0) at `now` and rewrites the total. The
-- total goes where the last expired stamp was (LTRIM keeps it, LSET overwrites it).
local function sliding_log_commit(key, now, requests, period, burst, tick, cap,
                                  gone, new_total, hits, tail)
  local stamp = string.format('%.0f %.0f', now, hits)
  if tail < 0 then
    redis.call('RPUSH', key, new_total, stamp)
  else
    if gone > 0 then redis.call('LTRIM', key, gone, -1) end
    redis.call('RPUSH', key, stamp)
    redis.call('LSET', key, 0, new_total)
  end
  expire_at(key, now + period, now)
end

-- Drops the expired stamps, then takes `hits` back from the newest stamps; a log left with no
-- stamp is deleted. Its TTL stays: the newest stamp left is no newer than before.
local function sliding_log_refund(key, now, hits, requests, period, burst, tick, cap)
  local total, gone, gone_hits = sliding_log_scan(key, now, period)
  if not total then return end
  if gone > 0 then redis.call('LTRIM', key, gone, -1) end
  local kept = redis.call('LLEN', key) - 1
  local left = hits
  while left > 0 and kept > 0 do
    local at, h = sliding_log_stamp(redis.call('LINDEX', key, -1))
    local take = min(left, h)
    if take == h then
      redis.call('RPOP', key)
      kept = kept - 1
    else
      redis.call('LSET', key, -1, string.format('%.0f %.0f', at, h - take))
    end
    left = left - take
  end
  if kept == 0 then
    redis.call('DEL', key)
  else
    redis.call('LSET', key, 0, total - gone_hits - (hits - left))
  end
end
