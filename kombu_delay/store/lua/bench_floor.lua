--[[ bench_floor: the floor of any atomic sorted-set -> list move, for `kombu-delay bench` only.

It moves whole members with no bookkeeping at all (no id index, no
counts, no lateness), so its speed is what Redis itself allows on this machine for members
of this size: move.lua can only be slower.

KEYS[1] source  ZSET  members to move (any scores)
KEYS[2] dest    LIST  where they go
ARGV[1] limit   most members moved in this call
Returns: the number moved (0 when the source is empty)
Bound: ARGV[1] members.
]]
local source, dest = KEYS[1], KEYS[2]
local limit = tonumber(ARGV[1])

local members = redis.call('ZRANGE', source, 0, limit - 1)
if #members == 0 then return 0 end
redis.call('ZREMRANGEBYRANK', source, 0, #members - 1)
redis.call('LPUSH', dest, unpack(members))
return #members
