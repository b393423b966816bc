--[[ thaw: restore cold messages (listed by thaw_scan.lua, restored by the mover) into the
ordinary buckets, where movers push them when due.

KEYS[1] index   ZSET  <ns>index     the ordinary buckets' index
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] cindex  ZSET  <ns>cindex    the cold buckets' index
KEYS[6] dead    LIST  <ns>dead      dead letters: what could not be restored, kept as stored
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] db      the database's number, which a wake-up names (wake_if_first in _put.lua)
ARGV[3] now_ms  epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[4] past    "1": thaw even past maxmemory (the caller lists only messages due now, which
        must reach their queues: under maxmemory nothing else frees memory while every due
        message is compressed); "0": refused whole under maxmemory
ARGV[5..] one group of seven per message: start (its cold bucket), due (epoch ms), ref (its
        id-index ref in the cold space, "c<start>:<offset>:<seq>", as put wrote it), dest,
        member (the cold member, exactly as listed), score (as listed), message (the JSON
        string it restores to; "" when it could not be restored). The caller makes due and ref from the score
        listed: text Lua would otherwise make, per message, at a good part of its cost.
Returns: {thawed, dead, gone, recounted, blocked, damaged, blocking}; gone: members another mover
         thawed first, or that were cancelled meanwhile (nothing written for them), and the
         rare one whose identical twin was stored already (counted as cancelled); recounted:
         as thaw_scan.lua's; blocked: of the dead, those whose ordinary bucket has a key of
         another type (written by hand), where no message can be stored; damaged: an ordinary
         bucket's meta hash found of another type and set aside, each followed by the name it
         was renamed to (as move.lua's); blocking: the keys of another type the blocked messages
         met, each followed by how many it blocked.
Bound: three O(log n) commands per message (its ZSCORE, ZREM and ZADD), a constant number per bucket
       and destination (put_group), and two for the id index per 1000 messages.

Each message leaves the cold space (ZREM first, so a member already gone is left alone; and
only at the score listed: a message with no ETA of its own (an x-delay) keeps its bytes when
it is rescheduled, so a reschedule within its bucket between the listing and this call leaves
the same member at another score, which the next listing finds there, and which must not be
stored at the due time listed before)
and enters the ordinary one (put_group in _put_group.lua) in this one script, so a crash can
neither lose nor duplicate one; its id-index ref is replaced by the new one. It keeps its due time, and its bucket width, grace and
x-expires as its publisher set them; one that is overdue (no mover ran in time) goes into
a bucket that is due now, and is moved by the next move call. A message that could not be
restored leaves the cold space for the dead-letter list, counted as dead (and as expired,
so the lifetime totals add up). Under maxmemory the call is refused as a whole, unless ARGV[4]
says to go past it: then its first write is one that changes nothing (past_maxmemory in
_buckets.lua), and Redis lets every write after it go on over maxmemory.
]]
--- @include clock
--- @include refs
--- @include spaces
--- @include buckets
--- @include put_group
--- @include mover_acl
local ns = ARGV[1]
-- A shared key of another type (written by hand) would fail a command after the first ZREM
-- below, and Redis keeps the ZREMs before it: the messages taken would be lost. Refused first
-- instead, naming the key (a TYPE each, per call, not per message).
local refused_keys = wrong_types({{KEYS[6], 'list'}, {KEYS[2], 'hash'}, {KEYS[3], 'hash'}, {KEYS[4], 'hash'},
                                  {KEYS[1], 'zset'}})
if refused_keys then return refused_keys end
-- The first write may grow memory, so that under maxmemory Redis refuses the whole call, as
-- it refuses a publish: a thaw makes each message about four times larger. (ZADD XX of a
-- member that is not there writes nothing.) Moves, which free memory, go on meanwhile; where
-- nothing but compressed messages is due, there are none, and the caller thaws those due now
-- past maxmemory (ARGV[4]), so that they reach their queues and the consumers free memory.
local FIRST = 5  -- the first message's group in ARGV
-- And a command the ACL refuses (a mover's heartbeat asks too, but the ACL may change between
-- them): refused after the first ZREM, it lost the messages taken. Redis 7 is asked before
-- anything; Redis 6, asked by running commands (mover_refused in _mover_acl.lua), after the
-- write below, which decides whether maxmemory refuses the call: one before it would let the
-- call past maxmemory.
local function refusal()
  local refused = mover_refused(ns, true, true)
  if refused then return refusal_reply(refused, 'thaw', 'nothing was thawed') end
end
local refused = redis.acl_check_cmd and refusal()
if refused then return refused end
if ARGV[4] == '1' then past_maxmemory(KEYS[4]) else redis.call('ZADD', KEYS[5], 'XX', 0, '') end
refused = not redis.acl_check_cmd and refusal()
if refused then return refused end
local now = clock(ARGV[3])
local thawed, dead, merged, gone, recounted = 0, 0, 0, 0, 0
local cold = in_space({ns = ns, ids = KEYS[2], counts = KEYS[3]}, 'c')
local cs = cold.space
local cold_meta, removed, touched = {}, {}, {}
local order = {}  -- the groups of messages put_group stores, in the order first met

-- What this call needs of a cold bucket's meta hash: the width and grace its publisher gave
-- it, and (filled in below) each destination's x-expires and the groups it thaws into.
local function cold_meta_of(start_s)
  local meta = cold_meta[start_s]
  if not meta then
    local known = redis.call('HMGET', cs:meta(start_s), 'end', 'x', 'g', 'r', 'n')
    local end_ms = ms_of(known[1]) or (tonumber(start_s) + 60000)
    local x, g = ms_of(known[2]) or end_ms, ms_of(known[3])
    -- The publisher's grace: x - end, unless the sweep renewed the bucket (sweep.lua: then
    -- x is its renewal, r, and g the grace it gave), and the longer where a publisher
    -- extended x since.
    local grace = x - end_ms
    if g and known[2] == known[4] then grace = g elseif g and g > grace then grace = g end
    meta = {width = math.max(1, end_ms - tonumber(start_s)), grace = grace, expires = {}, groups = {},
            no_eta = known[5] ~= false}  -- (mark_no_eta in _put.lua: carried to where it thaws)
    cold_meta[start_s] = meta
  end
  return meta
end

-- A write that fails after the first ZREM below would lose the messages taken: Redis takes
-- back nothing a script wrote before its error. So the counters put_group writes in each
-- ordinary bucket this call may thaw into are mended first, where one was written by hand
-- with text HINCRBY refuses (mend_counters).
-- A meta hash of another type (written by hand) is set aside, as a move sets it aside (set_aside
-- in _buckets.lua: renamed, the bucket counted again from its sets), so that the messages thawed
-- into it move on time; this comes first, as it may come up to delay_thaw_ahead before the
-- bucket's first move. Where RENAME is refused, and for a sorted set or task-id list of another
-- type, which no mending makes right, the messages bound for the bucket go to the dead-letter
-- list instead (``blocked``, counted as dead), kept as they are stored; the bucket's own
-- messages are the move's to let go, once (let_go_unreadable takes the bucket out of its index),
-- not each thaw's.
-- fit[start][dest]: true where its keys can take it, else the first of them of another type.
local ordinary, fit, blocked, blocking, told = space(ns, ''), {}, 0, {}, {}  -- told[key]: its count's place in blocking
local ordinary_k = in_space({ns = ns, ids = KEYS[2], counts = KEYS[3]}, '')
local damaged, aside_tried = {}, {}
local function has_type(key, wanted)
  local found = redis.call('TYPE', key)['ok']
  return found == 'none' or found == wanted
end
-- Keyed by the start as a number, as the groups are: text made per message would cost a good
-- part of a thaw (see the groups below).
for i = FIRST, #ARGV, 7 do
  local due, dest = tonumber(ARGV[i + 1]), ARGV[i + 3]
  local start = due - due % cold_meta_of(ARGV[i]).width
  local of_start = fit[start]
  if not of_start then
    of_start = {}
    fit[start] = of_start
  end
  if of_start[dest] == nil then
    local start_s = string.format('%d', start)
    local meta = ordinary:meta(start_s)
    if not aside_tried[start] and not has_type(meta, 'hash') then
      aside_tried[start] = true
      local aside = renamed_aside(ordinary_k, start_s, now)
      if aside then
        recount(ordinary_k, start_s, now)
        damaged[#damaged + 1] = meta
        damaged[#damaged + 1] = aside
      end
    end
    local zset, tasks = ordinary:zset(start_s, dest), ordinary:tasks(start_s)
    of_start[dest] = (not has_type(meta, 'hash') and meta) or (not has_type(zset, 'zset') and zset)
      or (not has_type(tasks, 'list') and tasks) or true
    if of_start[dest] == true then mend_counters(meta, {'seq', 'end', 'x', 'q:' .. dest}) end
  end
end

-- Each message is taken from its cold set first (ZREM: a member another mover thawed, or
-- that was cancelled, is gone, and nothing is written for it). The counts stay: the
-- messages are still scheduled. The ordinary buckets' work is then done per bucket and
-- destination (put_group), and the cold buckets' meta counts once per bucket.
for i = FIRST, #ARGV, 7 do
  local start_s, due_s, ref, dest, member, message = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 6]
  local meta = cold_meta_of(start_s)
  if meta.expires[dest] == nil then
    meta.expires[dest] = tonumber(redis.call('HGET', cs:meta(start_s), 'e:' .. dest) or 0)
  end
  local zset, listed = cs:zset(start_s, dest), ARGV[i + 5]
  local score = redis.call('ZSCORE', zset, member)
  if score ~= listed and (not score or tonumber(score) ~= tonumber(listed)) then
    gone = gone + 1  -- taken, or rescheduled in its bucket since it was listed
  elseif redis.call('ZREM', zset, member) == 0 then
    gone = gone + 1
  else
    local due = tonumber(due_s)
    local task_id = cold_task_id(member)
    local start = due - due % meta.width
    local unfit = fit[start][dest]
    if message ~= '' and unfit ~= true then
      message = ''
      blocked = blocked + 1
      if not told[unfit] then
        blocking[#blocking + 1] = unfit
        blocking[#blocking + 1] = 0
        told[unfit] = #blocking
      end
      blocking[told[unfit]] = blocking[told[unfit]] + 1
    end
    if not removed[start_s] then
      removed[start_s] = {}
      touched[#touched + 1] = start_s
    end
    removed[start_s][dest] = (removed[start_s][dest] or 0) + 1
    if message == '' then
      -- Counted as dead and as expired (lost to delivery), so the lifetime totals still
      -- add up to what is stored (see reschedule.lua).
      redis.call('LPUSH', KEYS[6], member)
      drop_refs(KEYS[2], {task_id}, function() return ref end)
      uncount(KEYS[3], dest, 1)
      dead = dead + 1
    else
      -- The group of its ordinary bucket and destination, found by table lookups: a key made
      -- of text would turn three numbers into text for every message.
      local of_start = meta.groups[start]
      if not of_start then
        of_start = {}
        meta.groups[start] = of_start
      end
      local group = of_start[dest]
      if not group then
        group = {start = start, dest = dest, width = meta.width, grace = meta.grace,
                 expires = meta.expires[dest], msgs = {}, first_due = due, no_eta = meta.no_eta}
        of_start[dest] = group
        order[#order + 1] = group
      end
      group.msgs[#group.msgs + 1] = {due = due, task_id = task_id, payload = message, old_ref = ref}
      if due < group.first_due then group.first_due = due end
    end
  end
end

for _, start_s in ipairs(touched) do
  local meta = cs:meta(start_s)
  redis.call('HDEL', meta, 'w')  -- its wake mark's message may be thawed (_put.lua)
  for dest, n in pairs(removed[start_s]) do uncount_meta(meta, 'q:' .. dest, n) end
  local empty, end_ms = drained_counts(meta)
  if empty then recounted = recounted + retire(cold, start_s, end_ms, now) end
end

for _, g in ipairs(order) do
  local k = in_space({ns = ns, ids = KEYS[2], counts = KEYS[3], totals = KEYS[4],
             width = g.width,
             -- An overdue message's bucket must not expire before its mover comes.
             grace = g.grace + math.max(0, now - g.first_due),
             wake = ns .. 'wake', wake_tag = '@' .. ARGV[2], expires = g.expires, counted = true},
             '')  -- index: KEYS[1]
  local codes = put_group(k, now, g.start, g.dest, g.msgs)
  for i, code in ipairs(codes) do
    if code == 2 then
      -- Its identical twin is stored already (a publish retried across the threshold): one
      -- of them is gone, as reschedule.lua counts a merge.
      local m = g.msgs[i]
      drop_refs(KEYS[2], {m.task_id}, function() return m.old_ref end)
      uncount(KEYS[3], g.dest, 1)
      merged = merged + 1
    else
      thawed = thawed + 1
      if g.no_eta then  -- once per group, on the meta hash put_group wrote
        mark_no_eta(k, g.start)
        g.no_eta = false
      end
    end
  end
end
if dead > 0 then
  count_up(KEYS[4], 'dead', dead)
  count_up(KEYS[4], 'expired', dead)
end
if merged > 0 then count_up(KEYS[4], 'cancelled', merged) end
return {thawed, dead, gone + merged, recounted, blocked, damaged, blocking}
