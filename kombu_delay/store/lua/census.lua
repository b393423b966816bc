--[[ census: count what is scheduled, overdue and by due time, without reading any message.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
ARGV[1] ns           key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms       a member is due when floor(score) <= now_ms
ARGV[3] slot_ms      width of one histogram slot, ms; slot 0 starts at now_ms
ARGV[4] slots        number of slots
ARGV[5] max_buckets  most buckets examined
ARGV[6] space        "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
ARGV[7..] dests      optional: the destinations to count (stats passes those <ns>counts
                     counts, when they are few). Each bucket's counts are then read with one
                     HMGET of their fields instead of an HGETALL of its whole meta hash (about
                     half the work); a destination left out is not counted. Without them,
                     every destination a meta hash counts is.
Returns: {truncated (1 if max_buckets cut the census), overdue, vanished, count_slot_0, ...}
         A bucket that started already adds its due members to overdue and the rest to
         slot 0; a later one adds its size to the slot its start falls in (the resolution
         is one bucket width). vanished: messages still counted whose sorted set is gone
         (expired or evicted; a mover's next move or sweep settles them), in no slot.
Bound: ARGV[5] buckets, each one HMGET or HGETALL of its meta hash (whose counts give the
       sizes); one EXISTS per 1000 sorted sets (one per set where some are gone); one ZCOUNT
       per destination of a bucket that has started; members are never read.
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

local starts = redis.call('ZRANGEBYSCORE', index, '-inf', horizon, 'LIMIT', 0, max_buckets + 1)
local reply = {0, 0, 0}
for i = 1, slots do reply[i + 3] = 0 end
if #starts > max_buckets then reply[1] = 1 end

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
for i = 1, math.min(#starts, max_buckets) do
  local start_s = starts[i]
  local start = tonumber(start_s)
  local slot = 0
  if start > now then slot = math.min(slots - 1, math.floor((start - now) / slot_ms)) end
  if #dests > 0 then
    local counts = redis.call('HMGET', s:meta(start_s), unpack(fields))
    for j = 1, #dests do
      if counts[j] then add(start_s, dests[j], counts[j], slot, start <= now) end
    end
  else
    local all = redis.call('HGETALL', s:meta(start_s))
    for j = 1, #all, 2 do
      if string.sub(all[j], 1, 2) == 'q:' then add(start_s, string.sub(all[j], 3), all[j + 1], slot, start <= now) end
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
