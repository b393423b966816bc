--[[ reschedule: replace one stored message by a new payload due at another time, atomically.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dest    LIST  kombu's queue list key (written only when the new due time has passed)
KEYS[6] gc      ZSET  <ns>gc        drained buckets whose id-index refs are still to drop
KEYS[7] purging HASH  <ns>purging   per destination list key, purges of it under way and until
                                    when that mark holds (purging.lua)
ARGV[1] ns         key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] width      bucket width, ms
ARGV[3] grace      how long a bucket outlives its end, ms (at least: the old bucket's, where longer)
ARGV[4] old_ref    "start:offset:seq" of the message to replace
ARGV[5] old_start  its bucket start, epoch ms ("c<start>" for a cold bucket)
ARGV[6] old        its member, exactly as stored (compressed in a cold bucket)
ARGV[7] task_id    id-index key (the id inside both payloads)
ARGV[8] dest       same string as KEYS[5]
ARGV[9] payload    the new JSON string (its ETA rewritten by the caller); stored as it is
ARGV[10] due       new due time, epoch ms
ARGV[11] db        the database's number, which a wake-up names (wake_if_first in _put.lua)
ARGV[12] max_delay furthest delay accepted, ms (0 = no limit)
ARGV[13] max_due   latest due time accepted, epoch ms
ARGV[14] cold      "1" when ARGV[9] is a cold member (kombu_delay/cold.py), to store cold
ARGV[15] thaw      ms: a cold member due no later than now + this is refused (code -3)
ARGV[16] now_ms    epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[17] no_eta    optional: "1" when the message carries no ETA of its own (an x-delay): its
                   new bucket is marked as schedule.lua marks it (mark_no_eta in _put.lua)
ARGV[18] mark      optional: what the old message is noted by once taken (note_taken in
                   _buckets.lua)
Returns: {code, due_ms, now_ms}; code 1 rescheduled, 0 the old message is gone (moved or
         cancelled meanwhile; nothing written), 3 new due time passed so pushed onto dest now,
         2 an identical payload was already stored at the new time (the old one is removed),
         -1 due time beyond max_delay or max_due (nothing written), -2 new due time passed but
         dest holds something other than a list (nothing written: the message stays as it was),
         -3 a cold member due too soon (nothing written: the caller sends the message itself),
         -4 a purge of dest is under way (nothing written: see purging.lua)
Raises: NOPERM when the due time has passed and the ACL refuses LPUSH onto the destination,
        before the old message is taken (Redis 7+ is asked first; on Redis 6 the push comes
        before the take).
Bound: a constant number of O(log n) commands.

The old message is claimed in this one script (ZSCORE, then ZREM in take in _buckets.lua): if
a mover moved it a moment ago, nothing happens, so a message is never both delivered and
rescheduled.
]]
--- @include clock
--- @include push
--- @include spaces
--- @include buckets
--- @include put
local dest_key = KEYS[5]
local due = tonumber(ARGV[10])
local max_delay, max_due = tonumber(ARGV[12]), tonumber(ARGV[13])
local task_id, dest, payload = ARGV[7], ARGV[8], ARGV[9]

local now = clock(ARGV[16])
if due > max_due or (max_delay > 0 and due - now > max_delay) then
  return {-1, due, now}
end
local cold = ARGV[14] == '1'
if cold and due <= now + tonumber(ARGV[15]) then
  return {-3, due, now}
end
local old_sp, old_start = split_bucket(ARGV[5])

-- Checked before anything is written: an ACL refusal (asked on Redis 7+) names the
-- destination, and a destination that is not a list leaves the message as it was.
if due <= now then
  assert_may_push(dest_key)
  local kind = redis.call('TYPE', dest_key)['ok']
  if kind ~= 'list' and kind ~= 'none' then return {-2, due, now} end
end

-- The keys the take and the put write, checked too (wrong_types in _buckets.lua).
local old_space = space(ARGV[1], old_sp)
local expected = {{old_space.index, 'zset'}, {KEYS[2], 'hash'}, {KEYS[3], 'hash'}, {KEYS[4], 'hash'},
                  {KEYS[6], 'zset'}, {old_space:meta(old_start), 'hash'}}
if due > now then
  local new_space = space(ARGV[1], cold and 'c' or '')
  local start_s = string.format('%d', due - due % tonumber(ARGV[2]))
  expected[#expected + 1] = {new_space.index, 'zset'}
  expected[#expected + 1] = {new_space:meta(start_s), 'hash'}
  expected[#expected + 1] = {new_space:zset(start_s, dest), 'zset'}
  if not new_space.cold then expected[#expected + 1] = {new_space:tasks(start_s), 'list'} end
end
expected[#expected + 1] = {KEYS[7], 'hash'}
local refused = wrong_types(expected)
if refused then return refused end
local purge = redis.call('HMGET', KEYS[7], 'c:' .. dest, 'x:' .. dest)
if (tonumber(purge[1]) or 0) > 0 and (tonumber(purge[2]) or 0) >= clock('') then return {-4, due, now} end

-- The queue's x-expires, if its publish gave one, goes with the message (its other lists are
-- the queue's, in <ns>lists: see note_lists in _put.lua).
-- So does the grace its bucket was kept for, where longer than ARGV[3]: an editor's settings
-- (the CLI's, the dashboard's) need not be its publisher's. Taken as its expiry ``x`` past its
-- start (its end is the widest publisher's, and a narrower one's grace reached past it by the
-- difference), less this bucket's width, which put adds back: the new bucket is kept as long
-- past its start as the old one was. (Taken whole, it kept each reschedule a width longer than
-- the last, which the sweep carried on to the shared keys: 1,601 reschedules, 4.4 hours.)
local old = redis.call('HMGET', old_space:meta(old_start), 'e:' .. dest, 'x')
local expires = tonumber(old[1] or 0) or 0
local grace = tonumber(ARGV[3])
if ms_of(old[2]) then grace = math.max(grace, ms_of(old[2]) - tonumber(old_start) - tonumber(ARGV[2])) end
local k = {ns = ARGV[1], index = KEYS[1], ids = KEYS[2], counts = KEYS[3], totals = KEYS[4],
           gc = KEYS[6], width = tonumber(ARGV[2]), grace = grace,
           wake = ARGV[1] .. 'wake', wake_tag = '@' .. ARGV[11],
           expires = expires, keep_lists = true}  -- (the lists entry: see below)
-- A user the ACL refuses HINCRBY (Redis 6, which cannot be asked beforehand) would take the old
-- message and store the new one uncounted, where no mover delivers it: refused first, by an
-- HINCRBY that changes nothing (count_up's strict NOPERM, naming the key). Where the totals are
-- gone, so is every stored message (the take finds none): no probe, which would make them anew
-- without an expiry.
if redis.call('EXISTS', k.totals) == 1 then count_up(k.totals, 'rescheduled', 0, true) end
if due <= now then
  -- Push, then take, as the move does (move_head in move.lua): a refused LPUSH (an ACL that
  -- Redis 6 cannot check beforehand) then takes nothing. So only once the old message is
  -- known to be there; the empty ZREMRANGEBYRANK is this script's first write, one that
  -- cannot grow memory, so that under maxmemory the push is still allowed.
  local old_set = old_space:zset(old_start, dest)
  if not redis.call('ZSCORE', old_set, ARGV[6]) then return {0, due, now} end
  checked_call('ZREMRANGEBYRANK', old_set, 1, 0)
  checked_call('LPUSH', dest_key, payload)
end
if not take(in_space(k, old_sp), old_start, dest, ARGV[6], task_id, ARGV[4], now, ARGV[18]) then
  return {0, due, now}
end
count_up(k.totals, 'rescheduled', 1)

-- The lifetime totals keep scheduled - moved - expired - cancelled - purged equal to what is
-- stored: a message pushed now has moved, and one merged into its identical twin is gone as
-- a cancelled one is.
if due <= now then
  count_up(k.totals, 'moved', 1)
  -- Best effort, as kombu's own renewal: a refusal must not undo the move (it cannot).
  if expires > 0 then renew_lists(ARGV[1] .. 'lists', dest_key, expires) end
  -- Its queue's last scheduled message: the entry goes, as a move's (move.lua).
  if not redis.call('HGET', KEYS[3], dest) then redis.pcall('HDEL', ARGV[1] .. 'lists', dest) end
  return {3, due, now}
end
-- (keep: the old message is taken, so the new one stays, whatever is refused after it)
local code = put(in_space(k, cold and 'c' or ''), now, due, task_id, dest, payload, nil, true)
if code == 1 and ARGV[17] == '1' then mark_no_eta(in_space(k, cold and 'c' or ''), due) end
-- The queue's other lists, kept while its new bucket is (note_lists in _put.lua).
if code == 1 and expires > 0 then keep_lists(ARGV[1] .. 'lists', dest, now, due + k.width + k.grace + 86400000) end
if code == 2 then count_up(k.totals, 'cancelled', 1) end
return {code, due, now}
