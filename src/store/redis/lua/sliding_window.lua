-- Twin of src/limiter/sliding_window.rs. State: "start current previous".

local function sliding_window_current(key, now, requests, period)
  local start = now - mod(now, period)
  local s, c, p = load_ints(key)
  local current, previous = 0, 0
  if s == start then
    current, previous = c, p or 0
  elseif s and s + period == start then
    current, previous = 0, c
  end
  return start, min(current, requests), min(previous, requests)
end

local function sliding_window_store(key, now, period, start, current, previous)
  if current == 0 and previous == 0 then
    redis.call('DEL', key)
  else
    store_text(key, string.format('%.0f %.0f %.0f', start, current, previous),
      start + 2 * period, now)
  end
end

-- Writes: the new current count, the window's start, the previous count.
local function sliding_window_decide(key, now, hits, requests, period, burst, tick, cap)
  local start, current, previous = sliding_window_current(key, now, requests, period)
  local p = idiv(period, tick)
  local elapsed = idiv(now - start, tick)
  local weight = p - elapsed
  local used = previous * weight + current * p
  local capacity = requests * p
  local to_end = start + period - now
  if hits <= requests and used + hits * p <= capacity then
    local next_current = current + hits
    local reset
    if next_current > 0 then
      reset = to_end + period
    elseif previous > 0 then
      reset = to_end
    else
      reset = 0
    end
    return 1, idiv(capacity - used - hits * p, p), reset, 0, next_current, start, previous
  end
  local full_reset = to_end
  if current > 0 then full_reset = to_end + period end
  local retry
  if hits > requests then
    retry = period
  elseif current + hits <= requests then
    local room = (requests - current - hits) * p
    local max_weight = idiv(room, previous)
    retry = (start + (p - max_weight) * tick) - now
  else
    local e_at = 0
    if current > 0 then
      e_at = p - min(idiv((requests - hits) * p, current), p)
    end
    retry = to_end + e_at * tick
  end
  return 0, idiv(capacity - min(used, capacity), p), full_reset, retry
end

local function sliding_window_commit(key, now, requests, period, burst, tick, cap,
                                     current, start, previous)
  sliding_window_store(key, now, period, start, current, previous)
end

local function sliding_window_refund(key, now, hits, requests, period, burst, tick, cap)
  local start, current, previous = sliding_window_current(key, now, requests, period)
  local from_current = min(hits, current)
  local from_previous = min(hits - from_current, previous)
  sliding_window_store(key, now, period, start, current - from_current,
    previous - from_previous)
end
