--[[ schedule: store one message in its time bucket, or push it now if it is already due.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dest    LIST  kombu's queue list key (written only when already due)
KEYS[6] movers  ZSET  <ns>movers    mover id -> last heartbeat (read only with ARGV[15])
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms
ARGV[4] when       due time, epoch ms, or with ARGV[11] = "1" a delay from now, ms
ARGV[5] task_id    id-index key (Celery task id, message id or delivery tag)
ARGV[6] payload    the exact JSON string plain kombu would LPUSH; stored as it is, never decoded
ARGV[7] wake       pub/sub channel that wakes movers
ARGV[8] max_delay  furthest delay accepted, ms (0 = no limit)
ARGV[9] max_due    latest due time accepted, epoch ms
ARGV[10] format    the storage format (keys.py FORMAT), recorded in totals when none is (with
                   a bucket's first message: the namespace's first message starts a bucket)
ARGV[11..16] are optional: the caller leaves out those after the last one it needs (each
  argument costs Redis work in every call, and almost no publish needs any of them).
ARGV[11] relative  "1": ARGV[4] is a delay from now; absent or "0": a due time
ARGV[12] cold      "1" when ARGV[6] is a cold member (kombu_delay/cold.py): stored in the cold
                   space (keys.py), never pushed from here; absent or "0": a payload
ARGV[13] thaw      ms: a cold member due no later than now + this is refused (code -2), so
                   movers, which thaw that far ahead, always have time to thaw one (read only
                   with ARGV[12] = "1")
ARGV[14] expires   the queue's x-expires, ms (absent or "0" = none): kept in the bucket's meta
                   hash, so the mover renews the list's expiry when it pushes the message
ARGV[15] fresh     ms: when given and not "0", also count the movers with a heartbeat this
                   fresh (a publisher asks once, to warn when no mover serves its namespace)
ARGV[16] now_ms    epoch ms to judge by; absent or '' = Redis TIME (tests drive time through it)
Returns: {code, due_ms, now_ms, movers}; movers: the fresh movers counted (ARGV[15]), else -1;
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
local ns, task_id, payload = ARGV[1], ARGV[5], ARGV[6]
local when = tonumber(ARGV[4])
-- The optional arguments are compared as text: tonumber costs more, and only a non-default
-- value needs it.
local cold = ARGV[12] == '1'
local max_delay, fresh, expires = ARGV[8], ARGV[15] or '0', ARGV[14] or '0'

local now = clock(ARGV[16])
local due = when
if ARGV[11] == '1' then due = now + when end
local movers = -1
if fresh ~= '0' then movers = redis.call('ZCOUNT', KEYS[6], now - tonumber(fresh), '+inf') end
if cold and due <= now + tonumber(ARGV[13] or '0') then
  return {-2, due, now, movers}
end
if due <= now then
  redis.call('LPUSH', dest_key, payload)
  return {0, due, now, movers}
end
if due > tonumber(ARGV[9]) or (max_delay ~= '0' and due - now > tonumber(max_delay)) then
  return {-1, due, now, movers}
end

-- k for put, as in_space would make it for this space, in one constructor: no copy.
local sp = space(ns, cold and 'c' or '')
local k = {ns = ns, space = sp, index = sp.index, ids = ids, counts = counts, totals = totals,
           width = tonumber(ARGV[2]), grace = tonumber(ARGV[3]), wake = ARGV[7],
           counter = 'scheduled', expires = expires ~= '0' and tonumber(expires), format = ARGV[10]}
return {put(k, now, due, task_id, dest_key, payload), due, now, movers}
