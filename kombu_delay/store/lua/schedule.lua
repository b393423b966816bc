--[[ schedule: store one message in its time bucket, or push it now if it is already due.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dest    LIST  kombu's queue list key (written only when already due)
KEYS[6] movers  ZSET  <ns>movers    mover id -> last heartbeat (read only with ARGV[16])
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms
ARGV[4] when       due time, epoch ms (ARGV[5] = "0") or delay from now, ms (ARGV[5] = "1")
ARGV[5] relative   "1" or "0"
ARGV[6] task_id    id-index key (Celery task id, message id or delivery tag)
ARGV[7] dest       same string as KEYS[5]
ARGV[8] payload    the exact JSON string plain kombu would LPUSH; stored as it is, never decoded
ARGV[9] wake       pub/sub channel that wakes movers
ARGV[10] max_delay furthest delay accepted, ms (0 = no limit)
ARGV[11] max_due   latest due time accepted, epoch ms
ARGV[12] expires   the queue's x-expires, ms (0 = none): kept in the bucket's meta hash, so
                   the mover renews the list's expiry when it pushes the message
ARGV[13] cold      "1" when ARGV[8] is a cold member (kombu_delay/cold.py): stored in the cold
                   space (keys.py), never pushed from here
ARGV[14] thaw      ms: a cold member due no later than now + this is refused (code -2), so
                   movers, which thaw that far ahead, always have time to thaw one
ARGV[15] now_ms    epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[16] fresh     ms: when not '0', also count the movers with a heartbeat this fresh (a
                   publisher asks once, to warn when no mover serves its namespace)
ARGV[17] format    the storage format (keys.py FORMAT), recorded in totals when none is (with
                   a bucket's first message: the namespace's first message starts a bucket)
Returns: {code, due_ms, now_ms, movers}; movers: the fresh movers counted (ARGV[16]), else -1;
         code 1 stored, 0 pushed onto dest now, 2 duplicate (this
         payload is already stored for dest in that bucket), -1 due time beyond max_delay or
         max_due (nothing written), -2 a cold member due too soon (nothing written: the
         caller stores the message itself)
Bound: a constant number of O(log n) commands (put in _put.lua).

The bucket's own keys (<ns>m:<start>, <ns>z:<start>:<dest>, <ns>t:<start>) are named from the
due time here; Redis Cluster is not supported, so they need not be declared in KEYS.
]]
--- @include clock
--- @include spaces
--- @include put
local ids, counts, totals, dest_key = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ns = ARGV[1]
local when = tonumber(ARGV[4])
local relative = ARGV[5] == '1'
local task_id, dest, payload = ARGV[6], ARGV[7], ARGV[8]
local max_delay, max_due = tonumber(ARGV[10]), tonumber(ARGV[11])

local cold = ARGV[13] == '1'

local now = clock(ARGV[15])
local due = when
if relative then due = now + when end
local movers = -1
local fresh = tonumber(ARGV[16])
if fresh > 0 then movers = redis.call('ZCOUNT', KEYS[6], now - fresh, '+inf') end
if cold and due <= now + tonumber(ARGV[14]) then
  return {-2, due, now, movers}
end
if due <= now then
  redis.call('LPUSH', dest_key, payload)
  return {0, due, now, movers}
end
if due > max_due or (max_delay > 0 and due - now > max_delay) then
  return {-1, due, now, movers}
end

-- k for put, as in_space would make it for this space, in one constructor: no copy.
local sp = space(ns, cold and 'c' or '')
local k = {ns = ns, space = sp, index = sp.index, ids = ids, counts = counts, totals = totals,
           width = tonumber(ARGV[2]), grace = tonumber(ARGV[3]), wake = ARGV[9],
           counter = 'scheduled', expires = tonumber(ARGV[12]), format = ARGV[17]}
return {put(k, now, due, task_id, dest, payload), due, now, movers}
