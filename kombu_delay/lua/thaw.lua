--[[ thaw: restore cold messages (listed by thaw_scan.lua, restored by the mover) into the
ordinary buckets, where movers push them when due.

KEYS[1] index   ZSET  <ns>index     the ordinary buckets' index
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see put in _common.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] cindex  ZSET  <ns>cindex    the cold buckets' index
KEYS[6] dead    LIST  <ns>dead      dead letters: what could not be restored, kept as stored
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] wake    pub/sub channel that wakes movers
ARGV[3..] one group of five per message: start (its cold bucket), score, dest, member (the
        cold member, exactly as listed), message (the JSON string it restores to; "" when it
        could not be restored)
Returns: {thawed, dead, gone}; gone: members another mover thawed first, or that were
         cancelled meanwhile (nothing written for them).
Bound: a constant number of O(log n) commands per message.

Each message leaves the cold space (take in _common.lua: ZREM first, so a member already
gone is left alone) and enters the ordinary one (put) in this one script, so a crash can
neither lose nor duplicate one. It keeps its due time, and its bucket width, grace and
x-expires as its publisher set them; one that is overdue (no mover ran in time) goes into
a bucket that is due now, and is moved by the next move call. A message that could not be
restored leaves the cold space for the dead-letter list, counted as dead.
]]
local ns = ARGV[1]
local now = clock()
local thawed, dead, gone = 0, 0, 0
local cold = {ns = ns, sp = 'c', index = KEYS[5], ids = KEYS[2], counts = KEYS[3]}
for i = 3, #ARGV, 5 do
  local start_s, score_s, dest, member, message = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local task_id = cold_task_id(member)
  local score = tonumber(score_s)
  local due = math.floor(score)
  -- Read before take, which deletes the meta hash of a bucket it drains.
  local known = redis.call('HMGET', ns .. 'cm:' .. start_s, 'end', 'x', 'e:' .. dest)
  local ref = 'c' .. score_ref(start_s, score)
  if not take(cold, start_s, dest, member, task_id, ref, now) then
    gone = gone + 1
  elseif message == '' then
    redis.call('LPUSH', KEYS[6], member)
    dead = dead + 1
  else
    local end_ms = tonumber(known[1]) or (tonumber(start_s) + 60000)
    local grace = (tonumber(known[2]) or end_ms) - end_ms
    local k = {ns = ns, index = KEYS[1], ids = KEYS[2], counts = KEYS[3], totals = KEYS[4],
               width = math.max(1, end_ms - tonumber(start_s)),
               -- An overdue message's bucket must not expire before its mover comes.
               grace = grace + math.max(0, now - due),
               wake = ARGV[2], expires = tonumber(known[3])}
    if put(k, now, due, task_id, dest, message) == 2 then
      -- Its identical twin is stored already (a publish retried across the threshold):
      -- one of them is gone, as reschedule.lua counts a merge.
      redis.call('HINCRBY', KEYS[4], 'cancelled', 1)
    end
    thawed = thawed + 1
  end
end
if dead > 0 then redis.call('HINCRBY', KEYS[4], 'dead', dead) end
return {thawed, dead, gone}
