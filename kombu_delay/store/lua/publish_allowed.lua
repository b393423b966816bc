--[[ publish_allowed: whether this user's ACL allows what a delayed publish may run, on the
keys it would run it on (Redis 7; a publisher asks once per destination, and again after a
refusal: see Publishing._may_publish).

Redis keeps a script's writes when it refuses a later command of the same call: a publish
refused after it stored its message would leave it unindexed, without its expiry or
uncounted, and a retry of the publish would store it again. So a publisher asks first, and
refuses to publish, writing nothing, where a command would be refused. The wake-up PUBLISH is
left out: its refusal is taken and counted (wake_if_first in _put.lua).

ARGV[1] ns    key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] dest  the destination list key
ARGV[3] edit  optional: "1" asks too for what a reschedule runs once it has taken the old
              message out (take and retire in _buckets.lua, the purge mark): refused then, the
              message would be lost
Returns: {} when all are allowed; {'?'} where Redis cannot be asked (no acl_check_cmd:
         Redis 6); else {command, key} of the first refused.
Bound: a constant number of ACL checks, nothing read or written.
]]
--- @include spaces
if not redis.acl_check_cmd then return {'?'} end
local ns, dest = ARGV[1], ARGV[2]
local calls = {{'TIME'}, {'ZCOUNT', ns .. 'movers', '0', '1'}}
local function add(call) calls[#calls + 1] = call end
-- The shared keys: counted (count_up: HINCRBY, else HSET) and kept (keep_until: PTTL, PEXPIREAT).
for _, shared in ipairs({ns .. 'ids', ns .. 'counts', ns .. 'totals'}) do
  for _, call in ipairs({{'HINCRBY', shared, 'f', '1'}, {'HSET', shared, 'f', 'v'}, {'PTTL', shared},
                         {'PEXPIREAT', shared, '1'}}) do add(call) end
end
add({'HSETNX', ns .. 'ids', 'f', 'v'})  -- the ref (add_ref), and HGET, HSET where the id has one
add({'HGET', ns .. 'ids', 'f'})
add({'HSETNX', ns .. 'totals', 'f', 'v'})  -- the storage format
for _, tag in ipairs({'', 'c'}) do
  local s = space(ns, tag)
  local meta, zset, tasks = s:meta('0'), s:zset('0', dest), s:tasks('0')
  for _, call in ipairs({
    {'ZADD', s.index, '0', 'm'}, {'ZRANGE', s.index, '0', '0'}, {'PTTL', s.index}, {'PEXPIREAT', s.index, '1'},
    {'HINCRBY', meta, 'f', '1'}, {'HSET', meta, 'f', 'v'}, {'HMGET', meta, 'f'}, {'HGETALL', meta},
    {'HDEL', meta, 'f'}, {'PEXPIREAT', meta, '1'},
    {'ZADD', zset, 'NX', '0', 'm'}, {'PEXPIREAT', zset, '1'},
    {'DEL', s:staged('0', dest)},  -- a herd's copy made wrong (UNLINK, else DEL)
  }) do add(call) end
  if tasks then
    add({'RPUSH', tasks, 'v'})
    add({'PEXPIREAT', tasks, '1'})
  end
end
if ARGV[3] == '1' then
  local gc, ids, counts = ns .. 'gc', ns .. 'ids', ns .. 'counts'
  for _, call in ipairs({{'TYPE', dest}, {'HMGET', ns .. 'purging', 'f'}, {'ZADD', gc, '0', 'm'},
                         {'PTTL', gc}, {'PEXPIREAT', gc, '1'}, {'HDEL', ids, 'f'}, {'HMGET', ids, 'f'},
                         {'HDEL', counts, 'f'}, {'HKEYS', counts}}) do add(call) end
  for _, tag in ipairs({'', 'c'}) do
    local s = space(ns, tag)
    local meta, zset, tasks = s:meta('0'), s:zset('0', dest), s:tasks('0')
    for _, call in ipairs({
      {'ZREM', s.index, 'm'}, {'HKEYS', meta}, {'HSETNX', meta, 'f', 'v'}, {'EXISTS', meta}, {'DEL', meta},
      {'ZSCORE', zset, 'm'}, {'ZREM', zset, 'm'}, {'ZCARD', zset}, {'ZRANGE', zset, '0', '0'},
      {'ZREMRANGEBYRANK', zset, '1', '0'},
      {'TYPE', zset}, {'EXISTS', zset}, {'DEL', zset},
    }) do add(call) end
    if tasks then
      add({'EXISTS', tasks})
      add({'DEL', tasks})
    end
  end
end
for _, call in ipairs(calls) do
  if not redis.acl_check_cmd(unpack(call)) then return {call[1], call[2] or ''} end
end
return {}
