-- Twin of src/limiter/fixed_window.rs. State: a hash under "<key>#" (the key the caller sends)
-- with one field, the window's start in seconds, whose value is the window's count, expiring
-- when the window ends. So a decision is one HINCRBY where the window already counts (the fast
-- path below), and one more command, its TTL, on the window's first hit; else an HGET and an
-- HINCRBY, with no string to parse or format. The window is a field, not part of the key's
-- name, because the caller names every key a script touches: Redis Cluster moves a slot key by
-- key, and routes a call by the keys it declares.
--
-- Before December 2026, a window was "start_us count", a string under "<key>" itself. Where the
-- node says so (`read_string_windows`, for a rolling upgrade from such a build), a window not
-- yet in the hash takes its count from that form (what old nodes record before the first new
-- one's hit is kept; what they record after it is theirs alone until they go). That read is of
-- a key the call does not declare, in the same slot; it is the one exception, and only on the
-- first hit of a window.

-- A window's field, by its start: kept, since the checks of a call (and of the calls in the
-- same second) share a few windows. A number given to redis.call is formatted for it ('%.17g',
-- ~0.2 µs), and so is one given to string.format: text made once is passed as it is.
local field_texts, field_texts_kept = {}, 0

local function fixed_window_field(start)
  local field = field_texts[start]
  if field then return field end
  local s = idiv(start, 1000000)
  if s * 1000000 == start and s < 1e14 then
    field = string.format('%d', s)
  else
    -- Periods are whole seconds, so every start is; anything else is spelled out in µs.
    field = string.format('%.0fus', start)
  end
  if field_texts_kept >= 64 then field_texts, field_texts_kept = {}, 0 end
  field_texts[start], field_texts_kept = field, field_texts_kept + 1
  return field
end

-- `hits` for redis.call: one hit (most requests) as text made once.
local function hits_arg(hits)
  if hits == 1 then return '1' end
  return hits
end

-- The window's start, its field, its count, whether the hash holds it, and the window's end.
local function fixed_window_current(key, now, period)
  local start, finish = window_of(now, period)
  local field = fixed_window_field(start)
  local count = tonumber(redis.call('HGET', key, field))
  if count then return start, field, count, true, finish end
  if read_string_windows then
    local s, c = load_ints(string.sub(key, 1, -2))
    if s == start then return start, field, c, false, finish end
  end
  return start, field, 0, false, finish
end

-- Writes the count `to` in place of `from` (`held`: the hash holds `from`). A new window
-- replaces the hash (and its last window). A zero is kept, not deleted, where the string form
-- holds a count: deleted, the window would read it again.
local function fixed_window_store(key, field, now, period, from, to, held)
  if held then
    if to ~= from then redis.call('HINCRBY', key, field, to - from) end
  elseif to ~= 0 or from ~= 0 then
    local _, finish = window_of(now, period)
    redis.call('DEL', key)
    redis.call('HSET', key, field, to)
    expire_at(key, finish, now)
  end
end

-- Writes: the new count, the window's field, the count before, and whether the hash holds
-- it (1) or not yet (0).
local function fixed_window_decide(key, now, hits, requests, period, burst, tick, cap)
  local _, field, count, held, finish = fixed_window_current(key, now, period)
  local in_hash = 0
  if held then in_hash = 1 end
  local to_end = finish - now
  if cap > 0 then
    -- Overdraft: allowed while under the limit, every hit counted (up to the cap).
    local next_count = min(count + hits, cap)
    local write = nil
    if hits > 0 then write = next_count end
    if count < requests then
      return 1, math.max(requests - next_count, 0), to_end, 0, write, field, count, in_hash
    end
    return 0, math.max(requests - count, 0), to_end, to_end, write, field, count, in_hash
  end
  if hits <= requests and count <= requests - hits then
    return 1, requests - count - hits, to_end, 0, count + hits, field, count, in_hash
  end
  return 0, math.max(requests - count, 0), to_end, to_end
end

local function fixed_window_commit(key, now, requests, period, burst, tick, cap, count, field,
                                   before, in_hash)
  fixed_window_store(key, field, now, period, before, count, in_hash == 1)
end

local function fixed_window_refund(key, now, hits, requests, period, burst, tick, cap)
  local _, field, count, held = fixed_window_current(key, now, period)
  fixed_window_store(key, field, now, period, count, math.max(count - hits, 0), held)
end

-- The fast path (run inline by batch.lua's `batches`): a check that is not a cost limit and has
-- hits adds them first, in one command, where a decision otherwise reads (HGET) and then writes
-- (HINCRBY); the count before is the result less the hits. Where the window already counts (the
-- common case) that is the decision. Where the count before was 0 the hash may not have held the
-- window — a window's first hit, which is most hits where keys are many (a key per user or
-- address, touched a few times a window) — and `fixed_window_first` settles it.

-- The first hit of a window on the fast path (the count before it 0, `hits` within the limit):
-- the addition stands, as the general path would have decided, and the key expires with the
-- window. Where the key was new (most first hits: the last window's key expired with it) that
-- makes the hash what the general path makes it. Where the hash held the window at 0, the TTL
-- is the one it had. Where it still holds a window that ended within the last millisecond (a TTL
-- is rounded up to one), that field stays beside this one until the key expires: every read is
-- of the current window's field. No reading first: a PTTL and an HLEN cost Redis more than
-- the field they would save. Where the string form is read and counts this window, the
-- addition does not stand (false): the caller takes it back and the general path decides.
local ttl_text, ttl_text_finish, ttl_text_now = nil, nil, nil

local function fixed_window_first(key, start, finish, now)
  if read_string_windows then
    local s, c = load_ints(string.sub(key, 1, -2))
    if s == start and c ~= 0 then return false end
  end
  -- The calls' groups share a time and mostly a window: its TTL as text made once (a number
  -- given to redis.call is formatted for it).
  if ttl_text_finish ~= finish or ttl_text_now ~= now then
    ttl_text = string.format('%d', ttl_arg(finish, now))
    ttl_text_finish, ttl_text_now = finish, now
  end
  redis.call('PEXPIRE', key, ttl_text)
  return true
end

-- Takes back what the fast path added: the count goes back to what it was (a window's first
-- hit taken back leaves its field at 0 until the key expires with the window, which reads as
-- no count).
local function fixed_window_take_back(key, field, hits, before)
  if before == 0 and redis.call('PTTL', key) < 0 then
    -- Made by the addition and never given its TTL (the first hit's PEXPIRE failed): gone again.
    redis.call('DEL', key)
    return
  end
  redis.call('HINCRBY', key, field, -hits)
end
