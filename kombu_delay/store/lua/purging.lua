--[[ purging: mark destinations as being purged, or a purge of them as ended.

KEYS[1] purging HASH  <ns>purging   per destination list key: c:<dest> -> purges of it under
                                    way, x:<dest> -> until when that mark holds, epoch ms (each
                                    kind prefixed, so that no queue's field is another's)
ARGV[1] step    "1" when a purge begins, "-1" when it ends, "0" to renew the mark meanwhile
ARGV[2] hold    ms: how long the mark holds past this call
ARGV[3..] dest  the destination list keys of the purge
Returns: 1.
Bound: a constant number of commands per destination, and one HGETALL of the marks under way.

A purge walks the buckets over many calls (purge.lua). A reschedule meanwhile could take a
message from a bucket the purge has not reached into one it has passed, and the message
would outlive the purge. reschedule.lua therefore refuses a message whose destination is
marked here (the caller raises EditConflict), so a reschedule comes wholly before or after the
purge. The purge renews its marks between its calls: each destination's mark holds ARGV[2] ms
past its latest renewal, so one left by a purger that died goes by itself, whatever other
purges do meanwhile (a count whose time has passed starts again from 0), and each call drops
such marks of other destinations: the key's expiry, renewed by every purge, kept them while
another queue was purged at least once a minute.
Under maxmemory the mark is still written (past_maxmemory): a purge is how an operator frees
memory, and its calls, like a cancel's, grow it by no more than the mark.
]]
--- @include clock
--- @include buckets
--- @include mover_acl
local purging = KEYS[1]
local step, hold = tonumber(ARGV[1]), tonumber(ARGV[2])
-- A purge the ACL refuses (purge.lua asks it on Redis 7) is refused before its mark: else the
-- mark, which the same user may be refused to end, held reschedules off for its minute.
local ns = string.sub(purging, 1, -8)  -- (KEYS[1] is <ns>purging)
local refused = step == 1 and redis.acl_check_cmd and mover_refused(ns, false, false, true)
if refused then return refusal_reply(refused, 'purge', 'nothing was purged') end
past_maxmemory(purging)
local now = clock('')
for i = 3, #ARGV do
  local count_field, until_field = 'c:' .. ARGV[i], 'x:' .. ARGV[i]
  local held = redis.call('HMGET', purging, count_field, until_field)
  local count = tonumber(held[1]) or 0
  if (tonumber(held[2]) or 0) < now then count = 0 end  -- left by a purger that died
  count = count + step
  if count <= 0 then
    redis.call('HDEL', purging, count_field, until_field)
  else
    redis.call('HSET', purging, count_field, count, until_field, now + hold)
  end
end
local marks = redis.call('HGETALL', purging)
for i = 1, #marks, 2 do
  local name = marks[i]
  if string.sub(name, 1, 2) == 'x:' and (tonumber(marks[i + 1]) or 0) < now then
    redis.call('HDEL', purging, name, 'c:' .. string.sub(name, 3))
  end
end
if redis.call('EXISTS', purging) == 1 then redis.call('PEXPIREAT', purging, now + hold) end
return 1
