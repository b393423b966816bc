--[[ heartbeat: record that a mover is alive, by the Redis clock, and forget long-dead movers.

KEYS[1] movers  ZSET  <ns>movers   mover id -> last heartbeat, epoch ms
ARGV[1] mover_id
ARGV[2] forget_after  drop movers silent for longer than this, ms
ARGV[3] now_ms        epoch ms to judge by; '' = Redis TIME (tests drive time through it)
Returns: now_ms
Bound: O(log n + dropped) in the number of movers.
]]
--- @include clock
local movers = KEYS[1]
local mover_id = ARGV[1]
local forget_after = tonumber(ARGV[2])
local now = clock(ARGV[3])
-- Trim first: Redis refuses a script whose first write may grow memory (ZADD) while
-- maxmemory is exceeded, and a mover must keep its heartbeat then.
redis.call('ZREMRANGEBYSCORE', movers, '-inf', '(' .. string.format('%d', now - forget_after))
redis.call('ZADD', movers, now, mover_id)
return now
