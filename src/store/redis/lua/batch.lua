-- sluice: decides groups of checks, each group one request's checks in one slot, all or nothing.
--
-- batches(keys, argv): argv[1] is the number of groups, argv[2] '' (time from Redis TIME) or a
-- pinned time in microseconds (tests only; TTLs are then padded, see prelude.lua): the groups of
-- a call share one time. argv[3] holds every other number, packed: 8 bytes each, little-endian
-- doubles (integers below 2^53, exact). Each group has a header of two: how many checks (keys)
-- it has and how many numbers follow its header. Then per check: a head, hits, requests,
-- period_us, and as many of burst, tick_us, cap, until, slot as the head says. The head is
-- algorithm + 8 * kind + 32 * extra: algorithm 1 fixed_window, 2 sliding_window, 3 sliding_log,
-- 4..6 the buckets, 7 concurrency; kind 1 enforce, 2 shadow, 3 refund; extra 0..5, how many of
-- the optional fields
-- follow (the caller leaves off trailing zeros), + 256 for a calendar limit: after the optional
-- fields, the four boundaries of its windows around the node's clock (see window_of), which
-- take the place of the period. cap: an overdraft limit's most recorded usage (0: not an
-- overdraft limit, see Limit); until: refunds only, applied only while now < until (0: always);
-- slot: a concurrency limit's request (see concurrency.lua; 0 elsewhere).
-- The keys are the groups' keys in order, a key per check. A call to a cluster master carrying
-- several slots' groups declares no key and sends them after argv[3] instead (argv[4] ...):
-- declared keys must share a slot, and Redis checks each access of a function flagged
-- `allow-cross-slot-keys` against the slots its node serves, refusing the rest (the caller sends
-- a refused group again on its slot: store::redis).
--
-- Why packed: each argument of a call costs Redis a string object, a Lua string (hashed and
-- interned) and a `tonumber`; ~0.1 µs each, and a fixed-window group is six numbers. One
-- string and one `struct.unpack` per call carry them all.
--
-- Reply: the time decided at (microseconds), then per group either per check allowed,
-- remaining, reset_after_us, retry_after_us, or, where the group raised an error, one string, the
-- error's text: a group's error is its own, never its neighbours'. Where no group raised one
-- (always, but for a broken key or clock), the numbers come back packed as the arguments came,
-- one string: a reply of integers costs Redis ~0.15 µs a value to write, and the node as
-- much to read. Otherwise they come back as one flat array of integers and strings. (Whether a
-- group was allowed is whether each of its enforced checks was: the caller knows which those
-- are.) Keys are unique among a group's non-refund checks (the caller merges repeats); groups
-- are independent requests, so one group's writes are seen by the groups after it, as if they
-- had been called one by one.
--
-- Why groups: the calls a node has queued while its earlier ones were in flight leave in one
-- FCALL (store::redis::batcher), so Redis's cost of a call (reading and parsing the command,
-- starting the function, TIME, writing the reply) is paid once for them all.

local ENFORCE, SHADOW, REFUND = 1, 2, 3
local FIXED_WINDOW = 1

local decide_of = {
  fixed_window_decide, sliding_window_decide, sliding_log_decide,
  bucket_decide, bucket_decide, bucket_decide, concurrency_decide,
}
local commit_of = {
  fixed_window_commit, sliding_window_commit, sliding_log_commit,
  bucket_commit, bucket_commit, bucket_commit, concurrency_commit,
}
local refund_of = {
  fixed_window_refund, sliding_window_refund, sliding_log_refund,
  bucket_refund, bucket_refund, bucket_refund, concurrency_refund,
}

-- A limit of 0 requests: nothing ever fits; a probe (0 hits) is allowed.
local function never(now, hits, period)
  local _, finish = window_of(now, period)
  local to_end = finish - now
  if hits == 0 then return 1, 0, to_end, 0 end
  return 0, 0, to_end, to_end
end

local function decide(now, key, alg, hits, requests, period, burst, tick, cap, slot)
  if requests == 0 then return never(now, hits, period) end
  return decide_of[alg](key, now, hits, requests, period, burst, tick, cap, slot)
end

-- A cost limit's charge was spent already: it is recorded whatever the batch decides.
local function is_charge(hits, requests, cap)
  return cap > 0 and hits > 0 and requests > 0
end

-- What a probe sees after a refund is what the refund reports. A lease's leftover may only go
-- back to the window it came from: after `refund_until` (0: no such bound) nothing goes back.
local function refund(now, key, alg, hits, requests, period, burst, tick, cap, refund_until,
                      slot)
  if refund_until ~= 0 and now >= refund_until then hits = 0 end
  if requests == 0 then
    local _, r, reset, retry = never(now, 0, period)
    return 1, r, reset, retry
  end
  refund_of[alg](key, now, hits, requests, period, burst, tick, cap, slot, refund_until)
  local a, r, reset, retry = decide(now, key, alg, 0, requests, period, burst, tick, cap, slot)
  return a, r, reset, retry
end

-- The check whose numbers start at nums[b]: its algorithm, kind, hits, limit (requests,
-- period, burst, tick, cap), until, where the next check's numbers start, and its slot.
local function check_at(nums, b)
  local head = nums[b]
  local extra = math.floor(head / 32) % 8
  local alg, kind = head % 8, math.floor(head / 8) % 4
  local hits, requests, period = nums[b + 1], nums[b + 2], nums[b + 3]
  local burst, tick, cap, refund_until, slot = 0, 0, 0, 0, 0
  if extra > 0 then burst = nums[b + 4] end
  if extra > 1 then tick = nums[b + 5] end
  if extra > 2 then cap = nums[b + 6] end
  if extra > 3 then refund_until = nums[b + 7] end
  if extra > 4 then slot = nums[b + 8] end
  local next_b = b + 4 + extra
  if head >= 256 then
    period = { nums[next_b], nums[next_b + 1], nums[next_b + 2], nums[next_b + 3] }
    next_b = next_b + 4
  end
  return alg, kind, hits, requests, period, burst, tick, cap, refund_until, next_b, slot
end

-- Takes back what the fast path (in `batches`) added to the first `upto` checks, each within
-- its limit: its count before is what its verdict's remaining says. Keys are unique among them.
local function fixed_windows_take_back(now, keys, k, upto, nums, b, replies, m)
  for i = 1, upto do
    local _, _, hits, requests, period, _, _, _, _, next_b = check_at(nums, b)
    b = next_b
    local start = window_of(now, period)
    local count = requests - hits - replies[m + (i - 1) * 4 + 2]
    fixed_window_take_back(keys[k + i], fixed_window_field(start), hits, count)
  end
end

-- One group decided on the state as it is, each check read before anything is written: `n`
-- checks on keys[k + 1 .. k + n], their numbers from nums[b]; its verdicts (4 values a check)
-- written to replies[m + 1 ..], no table of its own (a table that grows costs Redis a
-- reallocation each time it doubles).
local function decide_group(now, keys, k, n, nums, b, replies, m)
  if n == 1 then
    -- Alone, a check that would write decides the batch (or is a charge): it writes at once.
    local alg, kind, hits, requests, period, burst, tick, cap, refund_until, _, slot =
      check_at(nums, b)
    local key = keys[k + 1]
    local a, r, reset, retry, w1, w2, w3, w4
    if kind == REFUND then
      a, r, reset, retry =
        refund(now, key, alg, hits, requests, period, burst, tick, cap, refund_until, slot)
    else
      a, r, reset, retry, w1, w2, w3, w4 =
        decide(now, key, alg, hits, requests, period, burst, tick, cap, slot)
      if w1 ~= nil and (a == 1 or is_charge(hits, requests, cap)) then
        commit_of[alg](key, now, requests, period, burst, tick, cap, w1, w2, w3, w4)
      end
    end
    replies[m + 1], replies[m + 2], replies[m + 3], replies[m + 4] = a, r, reset, retry
    return
  end

  for j = 1, 4 * n do replies[m + j] = 0 end
  -- What would be written, 7 values per check that would write: its index, where its numbers
  -- start, whether it is a cost limit's charge (1: written whatever the batch decides), and its
  -- up to 4 writes.
  local pending = {}
  local refunds = {}
  local allowed = 1
  for i = 1, n do
    local at = b
    local alg, kind, hits, requests, period, burst, tick, cap, _, next_b, slot =
      check_at(nums, b)
    b = next_b
    if kind == REFUND then
      refunds[#refunds + 1] = i
      refunds[#refunds + 1] = at
    else
      local a, r, reset, retry, w1, w2, w3, w4 =
        decide(now, keys[k + i], alg, hits, requests, period, burst, tick, cap, slot)
      local o = m + (i - 1) * 4
      replies[o + 1], replies[o + 2], replies[o + 3], replies[o + 4] = a, r, reset, retry
      local charge = 0
      if is_charge(hits, requests, cap) then charge = 1 end
      if w1 ~= nil and (a == 1 or charge == 1) then
        local p = #pending
        pending[p + 1], pending[p + 2], pending[p + 3] = i, at, charge
        pending[p + 4], pending[p + 5] = w1, w2 or 0
        pending[p + 6], pending[p + 7] = w3 or 0, w4 or 0
      end
      if a ~= 1 and kind == ENFORCE then allowed = 0 end
    end
  end

  for p = 1, #pending, 7 do
    local i = pending[p]
    local alg, _, hits, requests, period, burst, tick, cap = check_at(nums, pending[p + 1])
    if allowed == 1 or pending[p + 2] == 1 then
      commit_of[alg](keys[k + i], now, requests, period, burst, tick, cap,
        pending[p + 3], pending[p + 4], pending[p + 5], pending[p + 6])
    else
      -- Not consumed after all: what was left is left still.
      local o = m + (i - 1) * 4
      replies[o + 2] = replies[o + 2] + hits
    end
  end

  -- Refunds apply whatever the decision: they return hits an earlier request consumed.
  for p = 1, #refunds, 2 do
    local i = refunds[p]
    local alg, _, hits, requests, period, burst, tick, cap, refund_until, _, slot =
      check_at(nums, refunds[p + 1])
    local o = m + (i - 1) * 4
    replies[o + 1], replies[o + 2], replies[o + 3], replies[o + 4] =
      refund(now, keys[k + i], alg, hits, requests, period, burst, tick, cap, refund_until, slot)
  end
end

-- What follows the fast path (in `batches`) where check `i` of the group ended it: everything
-- added before it is taken back, and its own addition where it made one (`before`, the count
-- before it, is nil where the check may not take the fast path). A lone check that was over its
-- limit already is the answer (denied); otherwise the general path decides on the state as it
-- was (a count of 0 may be a window the hash does not hold yet).
local function after_fast(now, keys, k, n, nums, b, replies, m, i, key, field, hits, before,
                          requests, finish)
  if before ~= nil then fixed_window_take_back(key, field, hits, before) end
  fixed_windows_take_back(now, keys, k, i - 1, nums, b, replies, m)
  if n == 1 and before ~= nil and before > 0 then
    local to_end = finish - now
    replies[m + 1], replies[m + 2], replies[m + 3], replies[m + 4] =
      0, math.max(requests - before, 0), to_end, to_end
    return
  end
  decide_group(now, keys, k, n, nums, b, replies, m)
end

-- Where check `i` of the fast path met an error (Redis refused its HINCRBY, or a calendar
-- window does not hold Redis's time): what the checks before it added goes back, and the error
-- is the group's.
local function fast_refused(now, keys, k, i, nums, b, replies, m, err)
  fixed_windows_take_back(now, keys, k, i - 1, nums, b, replies, m)
  error(err, 0)
end

-- An error raised in a group (a redis.call's error is a table), as its reply: a string.
local function error_text(e)
  if type(e) == 'table' then e = e.err end
  return tostring(e)
end

-- `count` doubles, little-endian: struct's format, made once per count.
local formats = {}
local function format_of(count)
  local f = formats[count]
  if not f then
    f = '<' .. string.rep('d', count)
    formats[count] = f
  end
  return f
end

-- The most values one struct call takes or gives: Lua's C stack holds 8 000.
local CHUNK = 1000

-- The packed numbers (argv[3]) as a table.
local function numbers_of(packed)
  local count = #packed / 8
  if count ~= math.floor(count) then error('sluice: packed numbers of ' .. #packed .. ' bytes') end
  if count <= CHUNK then return { struct.unpack(format_of(count), packed) } end
  local nums, at = {}, 1
  for from = 0, count - 1, CHUNK do
    local take = min(CHUNK, count - from)
    local part = { struct.unpack(format_of(take), packed, at) }
    for i = 1, take do nums[from + i] = part[i] end
    at = part[take + 1]
  end
  return nums
end

-- The reply's numbers, packed as the arguments are.
local function packed_of(values)
  local count = #values
  if count <= CHUNK then return struct.pack(format_of(count), unpack(values)) end
  local parts = {}
  for from = 1, count, CHUNK do
    local to = min(from + CHUNK - 1, count)
    parts[#parts + 1] = struct.pack(format_of(to - from + 1), unpack(values, from, to))
  end
  return table.concat(parts)
end

-- The head of a fixed-window check with no optional fields, enforced or shadow: the common
-- check, its numbers read inline by `batches` (below).
local FIXED_ENFORCE, FIXED_SHADOW = FIXED_WINDOW + 8 * ENFORCE, FIXED_WINDOW + 8 * SHADOW

local function batches(keys, argv)
  if #argv > 3 then
    local undeclared = {}
    for i = 4, #argv do undeclared[i - 3] = argv[i] end
    keys = undeclared
  end
  local now
  if argv[2] ~= '' then
    now = tonumber(argv[2])
    ttl_pad_ms = 3600000
  else
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    ttl_pad_ms = 0
  end
  local nums = numbers_of(argv[3])
  local replies = { now }
  local failed = false
  -- m: the values replied so far (the time and every group before).
  local b, k, m = 1, 0, 1
  local pcall_redis = redis.pcall
  -- Each period's window, its field, its start and its end, made once per call: a call's groups
  -- share a time, and mostly a few periods. The last period's, kept apart: mostly it is the next
  -- one's.
  local fields, starts, finishes = {}, {}, {}
  local w_period, w_field, w_start, w_finish = nil, nil, 0, 0
  for _ = 1, tonumber(argv[1]) do
    local n, count = nums[b], nums[b + 1]
    local at = b + 2
    local ok, e = true, nil
    -- The fast path (see fixed_window.lua), inline: each check of a group of fixed windows adds
    -- its hits at once, one HINCRBY where reading first and writing after take two; where every
    -- window counted already and each check is within its limit, that is the group's answer.
    -- Anything else goes to `after_fast`. Inline because the calls a function-per-step path
    -- makes (pcall, check_at, window_of, the field's text) cost Redis more than the HINCRBY
    -- (scripts/batch-cost: a lone check ~1 µs of ~3.5, two tiers ~1.2 of ~3.8).
    local c = at
    for i = 1, n do
      local head = nums[c]
      local hits, requests, period, next_c
      if head == FIXED_ENFORCE or head == FIXED_SHADOW then
        hits, requests, period, next_c = nums[c + 1], nums[c + 2], nums[c + 3], c + 4
      else
        local alg, kind, cap, _
        alg, kind, hits, requests, period, _, _, cap, _, next_c = check_at(nums, c)
        -- Not a refund nor a cost limit: those never take the fast path.
        if alg ~= FIXED_WINDOW or kind == REFUND or cap ~= 0 then hits = 0 end
      end
      -- Not one of more hits than its limit either: it can never be allowed (the general path
      -- says so without a write), and its hits, any u64 from the wire, need not fit HINCRBY.
      if hits <= 0 or hits > requests then
        ok, e = pcall(after_fast, now, keys, k, n, nums, at, replies, m, i)
        break
      end
      if period ~= w_period then
        local field, start, finish = fields[period], starts[period], finishes[period]
        if field == nil then
          -- A calendar limit's windows (a table) may not hold Redis's time: its error is the
          -- group's.
          local fine
          fine, start, finish = pcall(window_of, now, period)
          if not fine then
            ok, e = pcall(fast_refused, now, keys, k, i, nums, at, replies, m, start)
            break
          end
          field = fixed_window_field(start)
          fields[period], starts[period], finishes[period] = field, start, finish
        end
        w_period, w_field, w_start, w_finish = period, field, start, finish
      end
      local key = keys[k + i]
      local counted = pcall_redis('HINCRBY', key, w_field, hits_arg(hits))
      if type(counted) == 'table' then
        -- Redis refused (a key of another type).
        ok, e = pcall(fast_refused, now, keys, k, i, nums, at, replies, m, counted)
        break
      end
      local before = counted - hits
      -- A window's first hit stands once it has its TTL, unless the string form counts the
      -- window (where giving it or reading that failed, the general path meets the same error,
      -- as the group's).
      local first = false
      if before == 0 then
        local fine, stands = pcall(fixed_window_first, key, w_start, w_finish, now)
        first = fine and stands
      end
      if not first and (before <= 0 or before > requests - hits) then
        ok, e = pcall(after_fast, now, keys, k, n, nums, at, replies, m, i, key, w_field, hits,
          before, requests, w_finish)
        break
      end
      local r = m + 4 * (i - 1)
      replies[r + 1], replies[r + 2], replies[r + 3], replies[r + 4] =
        1, requests - counted, w_finish - now, 0
      c = next_c
    end
    if ok then
      m = m + 4 * n
    else
      -- What the group wrote before its error goes; its reply is the error's text.
      for i = #replies, m + 1, -1 do replies[i] = nil end
      replies[m + 1] = error_text(e)
      m = m + 1
      failed = true
    end
    b, k = b + 2 + count, k + n
  end
  if failed then return replies end
  return packed_of(replies)
end
