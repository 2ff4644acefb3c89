-- Twin of src/limiter/sliding_window.rs. State: "start current previous".

local function sliding_window_current(key, lim, now)
  local start = now - mod(now, lim.period)
  local s = load_ints(key)
  local current, previous = 0, 0
  if s then
    if s[1] == start then
      current, previous = s[2], s[3]
    elseif s[1] + lim.period == start then
      current, previous = 0, s[2]
    end
  end
  return start, min(current, lim.requests), min(previous, lim.requests)
end

local function sliding_window_store(key, lim, now, start, current, previous)
  if current == 0 and previous == 0 then
    store_ints(key, nil)
  else
    store_ints(key, { start, current, previous }, start + 2 * lim.period, now)
  end
end

local function sliding_window_decide(key, lim, now, hits)
  local start, current, previous = sliding_window_current(key, lim, now)
  local p = idiv(lim.period, lim.tick)
  local elapsed = idiv(now - start, lim.tick)
  local weight = p - elapsed
  local used = previous * weight + current * p
  local capacity = lim.requests * p
  local to_end = start + lim.period - now
  if hits <= lim.requests and used + hits * p <= capacity then
    local next_current = current + hits
    local reset
    if next_current > 0 then
      reset = to_end + lim.period
    elseif previous > 0 then
      reset = to_end
    else
      reset = 0
    end
    local commit = function()
      sliding_window_store(key, lim, now, start, next_current, previous)
    end
    return { 1, idiv(capacity - used - hits * p, p), reset, 0 }, commit
  end
  local full_reset = to_end
  if current > 0 then full_reset = to_end + lim.period end
  local retry
  if hits > lim.requests then
    retry = lim.period
  elseif current + hits <= lim.requests then
    local room = (lim.requests - current - hits) * p
    local max_weight = idiv(room, previous)
    retry = (start + (p - max_weight) * lim.tick) - now
  else
    local e_at = 0
    if current > 0 then
      e_at = p - min(idiv((lim.requests - hits) * p, current), p)
    end
    retry = to_end + e_at * lim.tick
  end
  return { 0, idiv(capacity - min(used, capacity), p), full_reset, retry }, nil
end

local function sliding_window_refund(key, lim, now, hits)
  local start, current, previous = sliding_window_current(key, lim, now)
  local from_current = min(hits, current)
  local from_previous = min(hits - from_current, previous)
  sliding_window_store(key, lim, now, start, current - from_current, previous - from_previous)
end
