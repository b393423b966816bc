--[[ census: count what is scheduled, overdue and by due time, without reading any message.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
ARGV[1] ns           key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms       a member is due when floor(score) <= now_ms
ARGV[3] slot_ms      width of one histogram slot, ms; slot 0 starts at now_ms
ARGV[4] slots        number of slots
ARGV[5] max_buckets  most buckets examined
ARGV[6] space        "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
Returns: {truncated (1 if max_buckets cut the census), overdue, vanished, count_slot_0, ...}
         A bucket that started already adds its due members to overdue and the rest to
         slot 0; a later one adds its size to the slot its start falls in (the resolution
         is one bucket width). vanished: messages still counted whose sorted set is gone
         (expired or evicted; a mover's next move or sweep settles them), in no slot.
Bound: ARGV[5] buckets, each one HGETALL of its meta hash (whose counts give the sizes) and
       one EXISTS per destination, plus one ZCOUNT per destination if the bucket has started;
       members are never read.
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

local starts = redis.call('ZRANGEBYSCORE', index, '-inf', horizon, 'LIMIT', 0, max_buckets + 1)
local reply = {0, 0, 0}
for i = 1, slots do reply[i + 3] = 0 end
if #starts > max_buckets then reply[1] = 1 end
for i = 1, math.min(#starts, max_buckets) do
  local start = tonumber(starts[i])
  local fields = redis.call('HGETALL', s:meta(starts[i]))
  local slot = 0
  if start > now then slot = math.min(slots - 1, math.floor((start - now) / slot_ms)) end
  for j = 1, #fields, 2 do
    local size = tonumber(fields[j + 1]) or 0
    if string.sub(fields[j], 1, 2) == 'q:' and size > 0 then
      local zset = s:zset(starts[i], string.sub(fields[j], 3))
      if redis.call('EXISTS', zset) == 0 then
        reply[3] = reply[3] + size
      else
        if start <= now then
          local due = redis.call('ZCOUNT', zset, '-inf', upper)
          reply[2] = reply[2] + due
          size = size - due
        end
        reply[slot + 4] = reply[slot + 4] + math.max(0, size)
      end
    end
  end
end
return reply
