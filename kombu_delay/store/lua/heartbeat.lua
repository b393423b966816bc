--[[ heartbeat: record that a mover is alive, by the Redis clock, and forget long-dead movers;
refuse data in another storage format.

KEYS[1] movers  ZSET  <ns>movers   mover id -> last heartbeat, epoch ms
KEYS[2] totals  HASH  <ns>totals   lifetime counters, and the field "format"
ARGV[1] mover_id
ARGV[2] forget_after  drop movers silent for longer than this, ms
ARGV[3] now_ms        epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[4] format        the storage format this mover reads and writes (keys.py FORMAT)
ARGV[5] ns            optional: the key namespace, whose keys this user's ACL is asked about
                      (mover_refused in _mover_acl.lua)
ARGV[6] probe         "1": on Redis 6, which cannot be asked, the commands are tried instead
                      (a mover's first heartbeat)
Returns: {now_ms, format, added}: the format found, or ARGV[4] when none was recorded yet (it
         is recorded then); added: 1 where this mover had no heartbeat recorded (its first, or
         one whose record is gone: Redis's data flushed or replaced), else 0.
         {now_ms, format} where another format is found: nothing is written, the mover stops.
         {0, format, command, key} where the ACL refuses a command a mover needs on a key it
         would run it on: nothing is written, and the mover stops.
Both keys live at least forget_after past the latest heartbeat (then every mover in movers
would be dropped as dead anyway), and totals as long as a bucket's keys too (put, in
_put.lua): a namespace nothing uses leaves no key behind.
Bound: O(log n + dropped) in the number of movers.
]]
--- @include clock
--- @include mover_acl
local movers, totals = KEYS[1], KEYS[2]
local mover_id = ARGV[1]
local forget_after = tonumber(ARGV[2])
local format = ARGV[4]
-- Before TIME, so that a refusal of it is named too.
local refused = ARGV[5] and mover_refused(ARGV[5], false, ARGV[6] == '1')
if refused then return {0, format, refused[1], refused[2]} end
local now = clock(ARGV[3])
local found = redis.call('HGET', totals, 'format')
if found and found ~= format then return {now, found} end
-- Trim first: Redis refuses a script whose first write may grow memory (ZADD) while
-- maxmemory is exceeded, and a mover must keep its heartbeat then.
redis.call('ZREMRANGEBYSCORE', movers, '-inf', '(' .. string.format('%d', now - forget_after))
local added = redis.call('ZADD', movers, now, mover_id)
if not found then redis.call('HSET', totals, 'format', format) end
keep_until(movers, now, now + forget_after)
keep_until(totals, now, now + forget_after)
return {now, format, added}
