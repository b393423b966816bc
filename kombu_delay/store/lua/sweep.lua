--[[ sweep: keep what a mover holds from expiring, and settle buckets found gone, a page at a time.

KEYS[1] index   ZSET  <ns>index     ordinary buckets holding messages (member = score = start)
KEYS[2] cindex  ZSET  <ns>cindex    cold buckets holding messages, as index
KEYS[3] ids     HASH  <ns>ids       task id -> refs (its expiry follows the buckets')
KEYS[4] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[5] totals  HASH  <ns>totals    lifetime counters (its expiry follows the buckets', as ids')
KEYS[6] gc      ZSET  <ns>gc        drained buckets whose id-index refs are still to drop
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] after   cursor: '' to begin with the first ordinary bucket, else the reply's cursor
ARGV[3] limit   most buckets visited in this call
ARGV[4] now_ms  epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[5] max_sets most sorted sets (a bucket's, one per destination it counts) looked at in this
        call, after the bucket that reaches it: with thousands of queues a bucket counts
        thousands, and ARGV[3] buckets held Redis for seconds (absent: no limit)
Returns: {renewed, lost, rebuilt, cursor, vanished}: buckets whose expiry was pushed out,
         messages whose sorted set was gone (expired or evicted; their counts are settled here
         and counted as expired), buckets whose counts read zero while their sorted sets held
         members (a meta hash evicted or deleted, members added by hand), counted again from
         the sets (recount in _buckets.lua), the cursor to pass next ('' when both indexes
         were walked to the end), and buckets let go that had vanished whole (no meta hash,
         and no sorted set found for a destination <ns>counts names: what they held cannot be
         counted; counted in the totals field vanished_buckets, as move.lua counts those it
         finds).
Bound: ARGV[3] buckets, and those whose sets reach ARGV[5] (and the one that passes it), each
       one HGETALL and one EXISTS per destination (one whose counts read
       zero: one EXISTS of the sets of every destination its meta hash names or counts
       counts, and a ZCARD per destination only where members are left); a renewed one a
       PEXPIREAT per key and one HSET.

Why: every key of a bucket is written with an expiry of its end plus the publisher's grace, so
that a system whose movers are all gone cannot grow Redis forever. A message a mover holds back
(a full list under delay_max_queue_length, a key that is not a list, a thaw refused under
maxmemory, a rate-capped backlog) would outlive that expiry while a mover runs the whole time.
So each bucket visited here is given its grace again from now, and never more: a message
expires once no mover swept it for a whole grace. A bucket due in the future has more than its
grace left already, and costs nothing but the reads. A renewal never shortens an expiry: a
bucket whose expiry (meta field x) is a grace or more from now is left as it is.

The grace is the publishers': x - end, while x is one a publisher wrote. A renewal writes x too
(publishers read it, so that none of them sets an earlier expiry), and from then on x - end is
the grace plus the time from the end to that renewal: renewing by it would add that time again
at each renewal, and a held bucket's lifetime would grow without bound (a grace of an hour,
held a day: two years). So a renewal also keeps the grace it gave (field g) and the expiry it
wrote (field r), and the next renewal gives g again. A publisher that extended x since (it only
ever writes a later x, so x then differs from r) may have asked for a longer grace: the longer
is given. A bucket no renewal has written (no g) takes x - end, or 7 days without either.
]]
--- @include clock
--- @include spaces
--- @include buckets
local ns = ARGV[1]
-- Its writes are expiries pushed out and counts settled: they must go on under maxmemory, or
-- what a mover holds back could expire (past_maxmemory in _buckets.lua).
past_maxmemory(KEYS[5])
local limit = tonumber(ARGV[3])
local now = clock(ARGV[4])
local max_sets = tonumber(ARGV[5] or '') or math.huge
local DAY = 86400000
local DEFAULT_GRACE = 7 * DAY
local sub = string.sub
local spaces = {space(ns, ''), space(ns, 'c')}  -- KEYS[1], KEYS[2]

local renewed, lost, rebuilt, vanished, visited, seen = 0, 0, 0, 0, 0, 0
local keep_shared = 0

-- Returns the sorted sets it looked at (one per destination its meta hash counts).
local function visit(s, start_s)
  local meta = s:meta(start_s)
  local fields = redis.pcall('HGETALL', meta)
  if other_type(fields, 'HGETALL', meta) then return 0 end  -- written by hand (move.lua's visit)
  local end_ms, x, g, r, live, left, sets = nil, nil, nil, nil, {}, 0, 0
  for i = 1, #fields, 2 do
    local name, n = fields[i], count_of(fields[i + 1])
    if name == 'end' then
      end_ms = n
    elseif name == 'x' then
      x = n
    elseif name == 'g' then
      g = n
    elseif name == 'r' then
      r = n
    elseif sub(name, 1, 2) == 'q:' and (n or 0) > 0 then
      sets = sets + 1
      local dest = sub(name, 3)
      local zset = s:zset(start_s, dest)
      if redis.call('EXISTS', zset) == 0 then
        lost = lost + n
        settle_gone(meta, name, KEYS[4], dest, n)
      else
        left = left + n
        live[#live + 1] = zset
      end
    end
  end
  if left == 0 then
    -- Drained, or its counts read zero while its sorted sets hold members (a meta hash
    -- evicted or deleted, members added by hand): those are counted again (recount).
    if retire(in_space({ns = ns, gc = KEYS[6]}, s.tag), start_s, end_ms, now) > 0 then
      rebuilt = rebuilt + 1
    elseif #fields == 0 and string.find(start_s, '^%d+$') and #start_s <= 15 then
      -- No meta hash, and nothing found: vanished whole, told as move.lua's visit tells it (a
      -- bucket due later reaches the sweep first). A member of the index that names no bucket
      -- (by hand) is no bucket.
      vanished = vanished + 1
    end
    return sets
  end
  -- The grace: the one the last renewal gave (g), or a publisher's (x - end) where x is not
  -- that renewal's (r), the longer of the two (see Why above).
  local grace = nil
  if g and g > 0 then grace = g end
  if end_ms and x and x ~= r and x > end_ms and (not grace or x - end_ms > grace) then grace = x - end_ms end
  grace = grace or DEFAULT_GRACE
  local until_ms = now + grace
  if x and x >= until_ms then return sets end
  -- The expiries first: under maxmemory Redis refuses a script whose first write may grow
  -- memory (HSET), and a held message must keep its expiry pushed out then too.
  for _, zset in ipairs(live) do redis.call('PEXPIREAT', zset, until_ms) end
  redis.call('PEXPIREAT', meta, until_ms + DAY)
  local tasks = s:tasks(start_s)
  if tasks then redis.call('PEXPIREAT', tasks, until_ms + DAY) end
  redis.call('HSET', meta, 'x', until_ms, 'g', grace, 'r', until_ms)
  renewed = renewed + 1
  if until_ms + DAY > keep_shared then keep_shared = until_ms + DAY end
  return sets
end

local function finish(cursor)
  if keep_shared > 0 then
    for _, key in ipairs({KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}) do
      if redis.call('EXISTS', key) == 1 then keep_until(key, now, keep_shared) end
    end
    -- The queues' other lists (note_lists in _put.lua), a hint: kept as long, where it is there.
    local lists = ns .. 'lists'
    if redis.pcall('EXISTS', lists) == 1 then pcall(keep_until, lists, now, keep_shared) end
  end
  if lost > 0 then count_up(KEYS[5], 'expired', lost) end
  if vanished > 0 then count_up(KEYS[5], 'vanished_buckets', vanished) end
  return {renewed, lost, rebuilt, cursor, vanished}
end

local first, lower = 1, '-inf'
if ARGV[2] ~= '' then
  local sp, start_s = string.match(ARGV[2], '^(c?):(%d+)$')
  if sp == spaces[2].tag then first = 2 end
  lower = '(' .. start_s
end
for i = first, 2 do
  local s = spaces[i]
  if i > first then lower = '-inf' end
  local starts = redis.call('ZRANGEBYSCORE', s.index, lower, '+inf', 'LIMIT', 0, limit - visited)
  for _, start_s in ipairs(starts) do
    seen = seen + visit(s, start_s)
    visited = visited + 1
    if visited >= limit or seen >= max_sets then return finish(s.tag .. ':' .. start_s) end
  end
end
return finish('')
