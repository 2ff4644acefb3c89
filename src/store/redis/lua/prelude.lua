-- sluice: shared helpers for the limiter scripts. Every number stays an integer below 2^53,
-- which a Lua double holds exactly; division is corrected so it is exact floor division.
--
-- The scripts are loaded once as a Redis Functions library (script.rs): the code at this level
-- runs at load time, and each call runs only `batch`. So nothing here may hold per-call state
-- except what `batch` sets at its start (`ttl_pad_ms`).
--
-- A limit travels as five numbers, in this order in every algorithm's signature: requests,
-- period (µs), burst, tick (µs), cap (an overdraft limit's most recorded usage; 0 otherwise).
-- An algorithm's `decide` returns allowed, remaining, reset_after_us, retry_after_us and, when
-- the check would change the state, up to four values that its `commit` writes (nil: nothing
-- to write). Multiple values instead of a verdict table and a commit closure: a call allocates
-- no table of its own for a verdict.

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

-- The window holding `now`: its start and end. `period` is an epoch-aligned period in µs or,
-- for a calendar limit, the four boundaries the node sent (the window before its own clock's,
-- that one and the next; calendar.rs): Redis's clock picks among the three, so a node a little
-- off still counts in the window Redis is in. Further off than a window, nothing is decided.
local function window_of(now, period)
  if type(period) == 'number' then
    local start = now - mod(now, period)
    return start, start + period
  end
  for i = 1, 3 do
    if now >= period[i] and now < period[i + 1] then return period[i], period[i + 1] end
  end
  error(string.format('sluice: Redis TIME %.0f is outside the calendar windows the node sent '
    .. '(%.0f to %.0f): the clocks are a window apart', now, period[1], period[4]))
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

-- Whether a fixed window also reads the form builds before December 2026 wrote (fixed_window.lua).
-- Set at load: the library that reads it differs from the one that does not in this line alone
-- (script.rs makes it), so each version of it has its own name.
local read_string_windows = false

-- A state kept as two or three space-separated integers in a string key ("a b" or "a b c"):
-- the numbers, or nil when there is no state (or one this version cannot read).
local function load_ints(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local a, b, c = string.match(v, '^(%d+) (%d+) ?(%d*)$')
  if not a then return nil end
  return tonumber(a), tonumber(b), tonumber(c)
end

-- A number, not a string: Redis passes a number argument on as '%.17g', exact below 2^53, and
-- a string.format per write cost ~0.5 µs.
local function ttl_arg(expires_at, now)
  return math.max(1, ceil_div(math.max(expires_at - now, 0), 1000)) + ttl_pad_ms
end

-- Writes `text` (from `string.format`) with a TTL until `expires_at`, when the state is empty
-- anyway. No key is ever written without a TTL.
local function store_text(key, text, expires_at, now)
  redis.call('SET', key, text, 'PX', ttl_arg(expires_at, now))
end

local function expire_at(key, expires_at, now)
  redis.call('PEXPIRE', key, ttl_arg(expires_at, now))
end
