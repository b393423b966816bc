--[[ reschedule: replace one scheduled envelope by a new one (new payload) at a new due time.

KEYS[1] index   ZSET  <ns>buckets   member = score = bucket start (epoch ms)
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dest    LIST  kombu's queue list key (written only when the new due time has passed)
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms
ARGV[4] old_ref    "start:offset:seq" of the envelope to replace
ARGV[5] old_member the envelope to replace, exactly as stored
ARGV[6] task_id    id-index key (the same id as inside old_member)
ARGV[7] dest       same string as KEYS[5]
ARGV[8] payload    the new JSON string (its ETA rewritten by the caller); copied, never decoded
ARGV[9] due        new due time, epoch ms
ARGV[10] wake      pub/sub channel that wakes movers
ARGV[11] max_delay furthest delay accepted, ms (0 = no limit)
ARGV[12] max_due   latest due time accepted, epoch ms
Returns: {code, due_ms, now_ms}; code 1 rescheduled, 0 the old envelope is gone (moved or
         cancelled meanwhile; nothing written), 3 new due time passed so pushed onto dest now,
         2 an identical envelope was already stored at the new time (the old one is removed),
         -1 due time beyond max_delay or max_due (nothing written)
Bound: a constant number of O(log n) commands.

The old envelope is claimed with ZREM first: if a mover moved it a moment ago, ZREM returns 0
and nothing happens, so a message is never both delivered and rescheduled.
]]
local index, ids, counts, totals, dest_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ns = ARGV[1]
local width = tonumber(ARGV[2])
local grace = tonumber(ARGV[3])
local old_ref, old_member = ARGV[4], ARGV[5]
local task_id, dest, payload = ARGV[6], ARGV[7], ARGV[8]
local due = tonumber(ARGV[9])
local wake = ARGV[10]
local max_delay, max_due = tonumber(ARGV[11]), tonumber(ARGV[12])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if due > max_due or (max_delay > 0 and due - now > max_delay) then
  return {-1, due, now}
end

local old_start = string.match(old_ref, '^(%d+):')
if not old_start then return {0, due, now} end
local old_bucket = ns .. 'bucket:' .. old_start
if redis.call('ZREM', old_bucket, old_member) == 0 then
  return {0, due, now}
end

local function uncount()
  if redis.call('HINCRBY', counts, dest, -1) <= 0 then redis.call('HDEL', counts, dest) end
end

redis.call('HINCRBY', ns .. 'meta:' .. old_start, 'q:' .. dest, -1)
drop_refs(ids, {task_id}, function() return old_ref end)
if redis.call('EXISTS', old_bucket) == 0 then
  redis.call('DEL', ns .. 'meta:' .. old_start)
  redis.call('ZREM', index, old_start)
end
redis.call('HINCRBY', totals, 'rescheduled', 1)

if due <= now then
  redis.call('LPUSH', dest_key, payload)
  uncount()
  return {3, due, now}
end

local start = due - due % width
local start_s = string.format('%d', start)
local bucket = ns .. 'bucket:' .. start_s
local meta = ns .. 'meta:' .. start_s
local seq = (redis.call('HINCRBY', meta, 'seq', 1) - 1) % 2048
local member = #task_id .. ':' .. #dest .. ':' .. task_id .. dest .. payload
if redis.call('ZADD', bucket, 'NX', due + seq / 2048, member) == 0 then
  uncount()
  return {2, due, now}
end
redis.call('HINCRBY', meta, 'q:' .. dest, 1)
redis.call('ZADD', index, start, start_s)

-- The same expiry rules as schedule.lua.
local expire_at = start + width + grace
local meta_expire_at = expire_at + 86400000
redis.call('PEXPIREAT', bucket, expire_at)
redis.call('PEXPIREAT', meta, meta_expire_at)

local ref = start_s .. ':' .. string.format('%d', due - start) .. ':' .. string.format('%d', seq)
local refs = redis.call('HGET', ids, task_id)
if refs then ref = refs .. ' ' .. ref end
redis.call('HSET', ids, task_id, ref)
keep_until(ids, now, meta_expire_at)
keep_until(counts, now, meta_expire_at)

local first = redis.call('ZRANGE', index, 0, 0)[1]
if first == start_s and redis.call('ZRANK', bucket, member) == 0 then
  redis.call('PUBLISH', wake, string.format('%d', due))
end
return {1, due, now}
