-- Twin of src/limiter/fixed_window.rs. State: "start count".

local function fixed_window_current(key, now, period)
  local start = now - mod(now, period)
  local s, count = load_ints(key)
  if s ~= start then count = 0 end
  return start, count
end

local function fixed_window_store(key, now, period, start, count)
  if count == 0 then
    redis.call('DEL', key)
  else
    store_text(key, string.format('%.0f %.0f', start, count), start + period, now)
  end
end

-- Writes: the new count, the window's start.
local function fixed_window_decide(key, now, hits, requests, period, burst, tick, cap)
  local start, count = fixed_window_current(key, now, period)
  local to_end = start + period - now
  if cap > 0 then
    -- Overdraft: allowed while under the limit, every hit counted (up to the cap).
    local next_count = min(count + hits, cap)
    local write = nil
    if hits > 0 then write = next_count end
    if count < requests then
      return 1, math.max(requests - next_count, 0), to_end, 0, write, start
    end
    return 0, math.max(requests - count, 0), to_end, to_end, write, start
  end
  if hits <= requests and count <= requests - hits then
    return 1, requests - count - hits, to_end, 0, count + hits, start
  end
  return 0, math.max(requests - count, 0), to_end, to_end
end

local function fixed_window_commit(key, now, requests, period, burst, tick, cap, count, start)
  fixed_window_store(key, now, period, start, count)
end

local function fixed_window_refund(key, now, hits, requests, period, burst, tick, cap)
  local start, count = fixed_window_current(key, now, period)
  fixed_window_store(key, now, period, start, math.max(count - hits, 0))
end
