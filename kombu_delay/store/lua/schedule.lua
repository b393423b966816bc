--[[ schedule: store one message in its time bucket, or push it now if it is already due.

KEYS[1] dest       LIST  kombu's queue list key (written only when already due)
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:": the other keys are named
                   from it (keys.py): <ns>index, <ns>ids, <ns>counts, <ns>totals, the
                   bucket's own keys, <ns>movers (read only with ARGV[14]) and the channel
                   <ns>wake that wakes movers
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms
ARGV[4] when       due time, epoch ms, or with ARGV[10] = "1" a delay from now, ms
ARGV[5] task_id    id-index key (Celery task id, message id or delivery tag)
ARGV[6] payload    the exact JSON string plain kombu would LPUSH; stored as it is, never decoded
ARGV[7..17] are optional: the caller leaves out those after the last one it needs (each
  argument costs Redis work in every call, and almost no publish needs any but the first two).
ARGV[7] now_ms     epoch ms to judge by; absent or '' = Redis TIME (tests drive time through it)
ARGV[8] estimated  "1": ARGV[7] is a publisher's estimate of Redis's clock, given for a message
                   due well after it (kombu_delay/store/clock.py), which this script then stores
                   without a TIME call (a good part of a publish's cost); the expiries, set once
                   per new set or bucket (put), then read Redis's clock
ARGV[9] max_delay  furthest delay accepted, ms (absent or "0" = no limit)
ARGV[10] relative  "1": ARGV[4] is a delay from now (an x-delay: the message carries no ETA
                   of its own, so the bucket is marked for movers never to move it ahead of
                   its due time, see move.lua); absent or "0": a due time
ARGV[11] cold      "1" when ARGV[6] is a cold member (kombu_delay/cold.py): stored in the cold
                   space (keys.py), never pushed from here; absent or "0": a payload
ARGV[12] thaw      ms: a cold member due no later than now + this is refused (code -2), so
                   movers, which thaw that far ahead, always have time to thaw one (read only
                   with ARGV[11] = "1")
ARGV[13] expires   the queue's x-expires, ms (absent or "0" = none): kept in the bucket's meta
                   hash, so the mover renews the list's expiry when it pushes the message
ARGV[14] fresh     ms: when given and not "0", also count the movers with a heartbeat this
                   fresh (a publisher asks once, to warn when no mover serves its namespace)
ARGV[15] leave_due "1": a message already due is not pushed here (code 3, nothing written): the
                   caller pushes it itself, in a publish batch that must keep it (kombu's
                   Producer.batch); absent or "0": pushed onto dest
ARGV[16] db        the number of the database, which a wake-up names (absent = 0; see
                   wake_if_first in _put.lua)
ARGV[17] siblings  with ARGV[13]: the JSON array of the keys of the queue's other lists (its
                   other priority steps), whose expiry the push renews with dest's, as
                   kombu's own publish renews every list of the queue (absent or '' = none;
                   kept in <ns>lists, see note_lists in _put.lua)
The storage format (recorded in totals with a bucket's first message) and the latest due
time accepted are constants of the script (keys.py FORMAT, MAX_DUE_MS).
Returns: 1 alone for a message stored for the due time ARGV[4] gave (no ARGV[10]) when there
         is nothing more to tell (no movers asked for, no refused wake-up): almost every
         publish, and a table costs Redis more to send (about 4 % of a publish's instructions);
         else {code, due_ms, now_ms, movers[, 1]}; movers: the fresh movers counted (ARGV[14]), else -1;
         a fifth element, 1, when the message was stored but the ACL refused the PUBLISH that
         wakes movers (counted in <ns>totals as wake_refused; see wake_if_first in _put.lua);
         code 1 stored, 0 pushed onto dest now, 3 due now and left to the caller (ARGV[15]),
         2 duplicate (this
         payload is already stored for dest in that bucket), -1 due time beyond max_delay or
         MAX_DUE_MS (nothing written), -2 a cold member due too soon (nothing written: the
         caller stores the message itself)
Bound: a constant number of O(log n) commands (put in _put.lua).

Only kombu's own key is declared: the namespace's keys are named from ARGV[1], and the
bucket's own (<ns>m:<start>, <ns>z:<start>:<dest>, <ns>t:<start>) from the due time, here.
Redis Cluster is not supported, so they need not be declared in KEYS, and each argument less
is Redis work saved in every publish.
]]
--- @include clock
--- @include publish
--- @include put
--- @const MAX_DUE_MS FUTURE_BEAT_MS
local dest_key, ns, task_id, payload = KEYS[1], ARGV[1], ARGV[5], ARGV[6]
local when = tonumber(ARGV[4])
-- The optional arguments are compared as text: tonumber costs more, and only a non-default
-- value needs it.
local cold, estimated = ARGV[11] == '1', ARGV[8] == '1'
local max_delay, expires, fresh = ARGV[9] or '0', ARGV[13] or '0', ARGV[14] or '0'

local now = clock(ARGV[7])
local due = when
if ARGV[10] == '1' then due = now + when end
local movers = -1
if fresh ~= '0' then  -- (one far ahead of Redis's clock, by hand, is none)
  movers = redis.call('ZCOUNT', ns .. 'movers', now - tonumber(fresh), now + FUTURE_BEAT_MS)
end
if cold and due <= now + (ms_of(ARGV[12]) or 0) then  -- ms_of: read once per text (_clock.lua)
  return {-2, due, now, movers}
end
if due <= now then
  if ARGV[15] == '1' then return {3, due, now, movers} end
  redis.call('LPUSH', dest_key, payload)
  return {0, due, now, movers}
end
if due > MAX_DUE_MS or (max_delay ~= '0' and due - now > tonumber(max_delay)) then
  return {-1, due, now, movers}
end

local k = publish_k(ns, cold, ARGV[2], ARGV[3], expires, ARGV[16] or '0')
-- The queue's, not the settings': set on k for this call (k may be shared, see publish_k).
if k.expires then k.siblings = ARGV[17] ~= '' and ARGV[17] or nil end
local code, wake_refused = put(k, now, due, task_id, dest_key, payload, estimated)
if code == 1 and ARGV[10] == '1' then mark_no_eta(k, due) end
if wake_refused then return {code, due, now, movers, 1} end
if code == 1 and movers == -1 and ARGV[10] ~= '1' then return 1 end
return {code, due, now, movers}
