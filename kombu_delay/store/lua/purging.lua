--[[ purging: mark destinations as being purged, or a purge of them as ended.

KEYS[1] purging HASH  <ns>purging   destination list key -> purges of it under way
ARGV[1] step    "1" when a purge begins, "-1" when it ends
ARGV[2] hold    ms: how long the mark outlives the last purge call that renewed it
ARGV[3..] dest  the destination list keys of the purge
Returns: 1.
Bound: one HINCRBY per destination.

A purge walks the buckets over many calls (purge.lua). A reschedule meanwhile could take a
message from a bucket the purge has not reached into one it has passed, and the message
would outlive the purge. reschedule.lua therefore refuses a message whose destination is
marked here (the caller raises EditConflict), so a reschedule comes wholly before or after the
purge. Each purge call renews the mark's expiry (purge.lua), so one left by a purger that died
goes after ARGV[2] ms.
]]
--- @include clock
local purging = KEYS[1]
local step = tonumber(ARGV[1])
for i = 3, #ARGV do
  if redis.call('HINCRBY', purging, ARGV[i], step) <= 0 then redis.call('HDEL', purging, ARGV[i]) end
end
if redis.call('EXISTS', purging) == 1 then redis.call('PEXPIREAT', purging, clock('') + tonumber(ARGV[2])) end
return 1
