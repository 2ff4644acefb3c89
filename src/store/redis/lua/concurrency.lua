-- Twin of src/limiter/concurrency.rs. State: a sorted set, a member per slot held (the slot's
-- number, "%.0f"), scored by when it expires (µs since the epoch; below 2^53, exact in a
-- double). Members scored at or before now have expired: they count for nothing, and a write
-- drops them. The key lives as long as its latest slot.

local function concurrency_member(slot)
  return string.format('%.0f', slot)
end

-- How many slots are live at `now`, and how long until the oldest of them expires (0: none).
local function concurrency_live(key, now)
  local after = '(' .. string.format('%.0f', now)
  local live = redis.call('ZCOUNT', key, after, '+inf')
  if live == 0 then return 0, 0 end
  local oldest = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return live, tonumber(oldest[2]) - now
end

-- A look (0 hits) or a slot held already (a retried call) keeps one slot; else one is taken if
-- any is free. Writes: the slot and when it expires.
local function concurrency_decide(key, now, hits, requests, period, burst, tick, cap, slot)
  local live, until_oldest = concurrency_live(key, now)
  local free = math.max(requests - live, 0)
  if hits == 0 then return 1, free, until_oldest, 0 end
  local score = redis.call('ZSCORE', key, concurrency_member(slot))
  if score and tonumber(score) > now then
    -- Held already (a retried call): kept as it was, rewritten as it is.
    return 1, free, until_oldest, 0, slot, tonumber(score)
  end
  if free > 0 then
    local until_us = now + period
    local reset = period
    if live > 0 then reset = math.min(now + until_oldest, until_us) - now end
    return 1, free - 1, reset, 0, slot, until_us
  end
  return 0, 0, until_oldest, until_oldest
end

local function concurrency_commit(key, now, requests, period, burst, tick, cap, slot, until_us)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now))
  redis.call('ZADD', key, string.format('%.0f', until_us), concurrency_member(slot))
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  expire_at(key, tonumber(latest[2]), now)
end

-- Releases `slot` (any hits; 0 only looks; a slot not held changes nothing) and drops the
-- expired ones; a set left empty is gone. With `only_until` (0: any), only the slot that
-- expires then: the one a call acquired, which a rollback undoes.
local function concurrency_refund(key, now, hits, requests, period, burst, tick, cap, slot,
                                  only_until)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.0f', now))
  if hits == 0 then return end
  if only_until ~= 0 then
    local score = redis.call('ZSCORE', key, concurrency_member(slot))
    if not score or tonumber(score) ~= only_until then return end
  end
  redis.call('ZREM', key, concurrency_member(slot))
end
