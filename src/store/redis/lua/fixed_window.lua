-- Twin of src/limiter/fixed_window.rs. State: "start count".

local function fixed_window_current(key, lim, now)
  local start = now - mod(now, lim.period)
  local s = load_ints(key)
  local count = 0
  if s and s[1] == start then count = s[2] end
  return start, count
end

local function fixed_window_store(key, lim, now, start, count)
  if count == 0 then
    store_ints(key, nil)
  else
    store_ints(key, { start, count }, start + lim.period, now)
  end
end

local function fixed_window_decide(key, lim, now, hits)
  local start, count = fixed_window_current(key, lim, now)
  local to_end = start + lim.period - now
  if lim.cap > 0 then
    -- Overdraft: allowed while under the limit, every hit counted (up to the cap).
    local next_count = min(count + hits, lim.cap)
    local commit = nil
    if hits > 0 then
      commit = function() fixed_window_store(key, lim, now, start, next_count) end
    end
    if count < lim.requests then
      return { 1, math.max(lim.requests - next_count, 0), to_end, 0 }, commit
    end
    return { 0, math.max(lim.requests - count, 0), to_end, to_end }, commit
  end
  if hits <= lim.requests and count <= lim.requests - hits then
    count = count + hits
    local commit = function() fixed_window_store(key, lim, now, start, count) end
    return { 1, lim.requests - count, to_end, 0 }, commit
  end
  return { 0, math.max(lim.requests - count, 0), to_end, to_end }, nil
end

local function fixed_window_refund(key, lim, now, hits)
  local start, count = fixed_window_current(key, lim, now)
  fixed_window_store(key, lim, now, start, math.max(count - hits, 0))
end
