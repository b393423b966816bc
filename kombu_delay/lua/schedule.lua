--[[ schedule: store one message in its time bucket, or push it now if it is already due.

KEYS[1] index   ZSET  <ns>buckets   member = score = bucket start (epoch ms)
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dest    LIST  kombu's queue list key (written only when already due)
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms
ARGV[4] when       due time, epoch ms (ARGV[5] = "0") or delay from now, ms (ARGV[5] = "1")
ARGV[5] relative   "1" or "0"
ARGV[6] task_id    id-index key (Celery task id, message id or delivery tag)
ARGV[7] dest       same string as KEYS[5]
ARGV[8] payload    the exact JSON string plain kombu would LPUSH; copied, never decoded
ARGV[9] wake       pub/sub channel that wakes movers
ARGV[10] max_delay furthest delay accepted, ms (0 = no limit)
ARGV[11] max_due   latest due time accepted, epoch ms
Returns: {code, due_ms, now_ms}; code 1 stored, 0 pushed onto dest now, 2 duplicate member,
         -1 due time beyond max_delay or max_due (nothing written)
Bound: a constant number of O(log n) commands.
]]
local index, ids, counts, totals, dest_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ns = ARGV[1]
local width = tonumber(ARGV[2])
local grace = tonumber(ARGV[3])
local when = tonumber(ARGV[4])
local relative = ARGV[5] == '1'
local task_id, dest, payload = ARGV[6], ARGV[7], ARGV[8]
local wake = ARGV[9]
local max_delay, max_due = tonumber(ARGV[10]), tonumber(ARGV[11])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = when
if relative then due = now + when end
if due <= now then
  redis.call('LPUSH', dest_key, payload)
  return {0, due, now}
end
if due > max_due or (max_delay > 0 and due - now > max_delay) then
  return {-1, due, now}
end

local start = due - due % width
local start_s = string.format('%d', start)
local bucket = ns .. 'bucket:' .. start_s
local meta = ns .. 'meta:' .. start_s
local n_seq = redis.call('HINCRBY', meta, 'seq', 1)
local seq = (n_seq - 1) % 2048
local member = #task_id .. ':' .. #dest .. ':' .. task_id .. dest .. payload
if redis.call('ZADD', bucket, 'NX', due + seq / 2048, member) == 0 then
  return {2, due, now}
end
redis.call('HINCRBY', meta, 'q:' .. dest, 1)
local n_dest = redis.call('HINCRBY', counts, dest, 1)
redis.call('HINCRBY', totals, 'scheduled', 1)

-- Written before the expiry below, which needs the ids hash to exist.
local ref = start_s .. ':' .. string.format('%d', due - start) .. ':' .. seq
if redis.call('HSETNX', ids, task_id, ref) == 0 then  -- a retry reuses its task id
  redis.call('HSET', ids, task_id, redis.call('HGET', ids, task_id) .. ' ' .. ref)
end

-- A dead system must not grow Redis forever: the bucket expires after its grace, its
-- counts a day later (so a mover can still reconcile them), the shared hashes never
-- before the last meta key. Every call is a round of Redis commands inside one script, so
-- this is done only when it can change something: when the meta hash is new (a new
-- bucket: every script that empties a bucket deletes its meta and its index entry in the
-- same call, so "meta new" is "bucket new"), or when this destination's count was zero
-- (the shared hashes may have emptied and vanished, taking their expiry with them).
local expire_at = start + width + grace
local meta_expire_at = expire_at + 86400000
if n_seq == 1 then
  redis.call('ZADD', index, start, start_s)
  redis.call('PEXPIREAT', bucket, expire_at)
  redis.call('PEXPIREAT', meta, meta_expire_at)
end
if n_seq == 1 or n_dest == 1 then
  keep_until(ids, now, meta_expire_at)
  keep_until(counts, now, meta_expire_at)
end

-- Wake the movers only when this message is now the earliest one scheduled (its
-- rank first: cheap, and false for almost every publish).
if redis.call('ZRANK', bucket, member) == 0 and redis.call('ZRANGE', index, 0, 0)[1] == start_s then
  redis.call('PUBLISH', wake, string.format('%d', due))
end
return {1, due, now}
