--[[ census: count what is scheduled, overdue and by due time, without reading any message.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
ARGV[1] ns           key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms       a member is due when floor(score) <= now_ms
ARGV[3] slot_ms      width of one histogram slot, ms; slot 0 starts at now_ms
ARGV[4] slots        number of slots
ARGV[5] max_buckets  most buckets examined
ARGV[6] space        "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
ARGV[7..] dests      optional: the destinations to count (stats passes those <ns>counts
                     counts, when they are few); a destination left out is not counted.
                     Without them, every destination a meta hash counts is. With them, the
                     counts of all the window's buckets are read by one SORT_RO of the index
                     that GETs their meta fields (Redis 7; a fraction of what a call per
                     bucket costs); where SORT_RO is missing (Redis 6) or refused (by the
                     ACL, or by Redis to a user who may not read every key; a key prefix with
                     a '*' or a NUL byte, which its patterns would misread), one HMGET per
                     bucket. A meta key of another type (written by hand) counts nothing.
                     SORT_RO turns an index small enough for Redis's compact encoding into a
                     skip list (some KB more, at most, kept until it is deleted).
Returns: {truncated (1 if max_buckets cut the census), overdue, vanished, count_slot_0, ...}
         A bucket that started already adds its due members to overdue and the rest to
         slot 0; a later one adds its size to the slot its start falls in (the resolution
         is one bucket width). vanished: messages still counted whose sorted set is gone
         (expired or evicted; a mover's next move or sweep settles them), in no slot.
Bound: ARGV[5] buckets: one SORT_RO, or one HMGET or HGETALL of each meta hash (whose counts
       give the sizes); one EXISTS per 1000 sorted sets (one per set where some are gone); one
       ZCOUNT per destination of a bucket that has started; members are never read.
]]
--- @include spaces
local index = KEYS[1]
local ns = ARGV[1]
local now = tonumber(ARGV[2])
local slot_ms, slots = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_buckets = tonumber(ARGV[5])
local s = space(ns, ARGV[6] or '')
local upper = '(' .. string.format('%d', now + 1)
local horizon = '(' .. string.format('%d', now + slot_ms * slots)
local dests, fields = {}, {}
for i = 7, #ARGV do
  dests[#dests + 1] = ARGV[i]
  fields[#fields + 1] = 'q:' .. ARGV[i]
end

local reply = {0, 0, 0}
for i = 1, slots do reply[i + 3] = 0 end
local in_window = redis.call('ZCOUNT', index, '-inf', horizon)
if in_window > max_buckets then reply[1] = 1 end
local n_buckets = math.min(in_window, max_buckets)

-- The window's buckets with their counts of the fields asked for, as one SORT_RO of the index
-- in its order (by start) returns them: each start followed by its counts. nil where it cannot.
local function counts_sorted()
  -- Redis reads a pattern's '*' up to the first NUL byte: a key prefix with either is left out.
  if #fields == 0 or n_buckets == 0 or not redis.acl_check_cmd or string.find(s.keys, '[%*%z]') then
    return nil
  end
  -- Asked first (redis.acl_check_cmd, Redis 7 as SORT_RO), so that no census adds to the ACL
  -- log or to the errors INFO counts: the command, and whether the user may read a key outside
  -- any namespace ('\0'), as SORT's GET wants a user who may read every key.
  if not redis.acl_check_cmd('SORT_RO', index) or not redis.acl_check_cmd('SORT_RO', '\0') then
    return nil
  end
  local args = {index, 'BY', 'nosort', 'LIMIT', 0, n_buckets, 'GET', '#'}
  for _, field in ipairs(fields) do
    args[#args + 1] = 'GET'
    args[#args + 1] = s:meta('*') .. '->' .. field
  end
  local rows = redis.pcall('SORT_RO', unpack(args))
  if type(rows) ~= 'table' or rows.err or #rows ~= n_buckets * (#fields + 1) then return nil end
  return rows
end

-- First the counts, bucket by bucket: each destination's set, its size, its slot, and whether
-- its bucket has started.
local sets, sizes, slot_of, started = {}, {}, {}, {}
local function add(start_s, dest, text, slot, has_started)
  local size = tonumber(text)
  if size and size > 0 then
    local n = #sets + 1
    sets[n], sizes[n], slot_of[n], started[n] = s:zset(start_s, dest), size, slot, has_started
  end
end
local function slot_at(start)
  if start > now then return math.min(slots - 1, math.floor((start - now) / slot_ms)) end
  return 0
end
local rows = counts_sorted()
if rows then
  local width = #fields + 1
  for i = 0, n_buckets - 1 do
    local start_s = rows[i * width + 1]
    local start = tonumber(start_s)
    for j = 1, #dests do
      local text = rows[i * width + 1 + j]
      if text then add(start_s, dests[j], text, slot_at(start), start <= now) end
    end
  end
else
  local starts = redis.call('ZRANGEBYSCORE', index, '-inf', horizon, 'LIMIT', 0, n_buckets)
  for i = 1, #starts do
    local start_s = starts[i]
    local start = tonumber(start_s)
    -- (A meta key of another type, written by hand, counts nothing, as SORT_RO's GET reads it.)
    if #dests > 0 then
      local counts = redis.pcall('HMGET', s:meta(start_s), unpack(fields))
      if counts.err then counts = {} end
      for j = 1, #dests do
        if counts[j] then add(start_s, dests[j], counts[j], slot_at(start), start <= now) end
      end
    else
      local all = redis.pcall('HGETALL', s:meta(start_s))
      if all.err then all = {} end
      for j = 1, #all, 2 do
        if string.sub(all[j], 1, 2) == 'q:' then add(start_s, string.sub(all[j], 3), all[j + 1], slot_at(start), start <= now) end
      end
    end
  end
end

-- Then whether the sets are there: one EXISTS for a slice of them, and one for each of its
-- sets only when some of them are gone.
for first = 1, #sets, 1000 do
  local last = math.min(#sets, first + 999)
  local whole = redis.call('EXISTS', unpack(sets, first, last)) == last - first + 1
  for n = first, last do
    local size = sizes[n]
    if not whole and redis.call('EXISTS', sets[n]) == 0 then
      reply[3] = reply[3] + size
    else
      if started[n] then
        local due = redis.call('ZCOUNT', sets[n], '-inf', upper)
        reply[2] = reply[2] + due
        size = size - due
      end
      reply[slot_of[n] + 4] = reply[slot_of[n] + 4] + math.max(0, size)
    end
  end
end
return reply
