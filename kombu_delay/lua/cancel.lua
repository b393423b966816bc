--[[ cancel: remove the scheduled envelopes of one task id (all of them: a retry reuses the id).

KEYS[1] index   ZSET  <ns>buckets   member = score = bucket start (epoch ms)
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] task_id  id-index key
ARGV[3] limit    most refs handled in this call
Returns: {cancelled, refs_left}; refs_left > 0 means the caller calls again.
Bound: ARGV[3] refs; each is one ZRANGEBYSCORE of a single score, which holds one member
       unless more than 2048 messages of one bucket share a due millisecond.

A ref names a score, so the envelope is found in O(log n) without reading its bucket. The
task id inside the member is checked too: members of other ids may share the score.
A ref whose bucket expired finds nothing; the mover settles that bucket's counts.
]]
local index, ids, counts, totals = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ns = ARGV[1]
local task_id = ARGV[2]
local limit = tonumber(ARGV[3])

local refs = redis.call('HGET', ids, task_id)
if not refs then return {0, 0} end
local list = {}
for ref in string.gmatch(refs, '%S+') do list[#list + 1] = ref end
local n = math.min(limit, #list)

local cancelled = 0
local touched, order = {}, {}
for i = 1, n do
  local start_s, offset, seq = string.match(list[i], '^(%d+):(%d+):(%d+)$')
  if start_s then
    local bucket = ns .. 'bucket:' .. start_s
    local meta = ns .. 'meta:' .. start_s
    local score = string.format('%.17g', tonumber(start_s) + tonumber(offset) + tonumber(seq) / 2048)
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', bucket, score, score)) do
      local _, hdr_end, il, dl = string.find(member, '^(%d+):(%d+):')
      if hdr_end then
        il, dl = tonumber(il), tonumber(dl)
        if string.sub(member, hdr_end + 1, hdr_end + il) == task_id then
          local dest = string.sub(member, hdr_end + il + 1, hdr_end + il + dl)
          redis.call('ZREM', bucket, member)
          cancelled = cancelled + 1
          if redis.call('HINCRBY', counts, dest, -1) <= 0 then redis.call('HDEL', counts, dest) end
          redis.call('HINCRBY', meta, 'q:' .. dest, -1)
          if not touched[start_s] then
            touched[start_s] = true
            order[#order + 1] = start_s
          end
        end
      end
    end
  end
end

-- A bucket emptied here is dropped now, as move.lua would: nothing is left to settle.
for _, start_s in ipairs(order) do
  if redis.call('EXISTS', ns .. 'bucket:' .. start_s) == 0 then
    redis.call('DEL', ns .. 'meta:' .. start_s)
    redis.call('ZREM', index, start_s)
  end
end

if n < #list then
  redis.call('HSET', ids, task_id, table.concat(list, ' ', n + 1))
else
  redis.call('HDEL', ids, task_id)
end
if cancelled > 0 then redis.call('HINCRBY', totals, 'cancelled', cancelled) end
return {cancelled, #list - n}
