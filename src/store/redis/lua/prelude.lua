-- sluice: shared helpers for the limiter scripts. Every number stays an integer below 2^53,
-- which a Lua double holds exactly; division is corrected so it is exact floor division.

local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local function ceil_div(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

local function mod(a, b)
  return a - idiv(a, b) * b
end

local function min(a, b)
  if a < b then return a end
  return b
end

-- Added to every TTL. 0 in service; a test that pins the script's time sets an hour (batch.lua):
-- Redis still expires keys by its own clock, and a state whose pinned time left it 1 ms to live
-- would vanish between two test steps that the pinned clock puts microseconds apart. A key kept
-- past its end holds a stale state, which every algorithm reads as empty (as it must: a real
-- TTL is rounded up to the millisecond).
local ttl_pad_ms = 0

-- A state kept as space-separated integers in a string key.
local function load_ints(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local out = {}
  for n in string.gmatch(v, '%d+') do out[#out + 1] = tonumber(n) end
  return out
end

-- Writes `ints` with a TTL until `expires_at` (the state is empty then), or deletes the key
-- when the state is empty now. No key is ever written without a TTL.
local function store_ints(key, ints, expires_at, now)
  if ints == nil then
    redis.call('DEL', key)
    return
  end
  local parts = {}
  for i, n in ipairs(ints) do parts[i] = string.format('%.0f', n) end
  local ttl_ms = math.max(1, ceil_div(math.max(expires_at - now, 0), 1000)) + ttl_pad_ms
  redis.call('SET', key, table.concat(parts, ' '), 'PX', string.format('%.0f', ttl_ms))
end

local function expire_at(key, expires_at, now)
  local ttl_ms = math.max(1, ceil_div(math.max(expires_at - now, 0), 1000)) + ttl_pad_ms
  redis.call('PEXPIRE', key, string.format('%.0f', ttl_ms))
end
