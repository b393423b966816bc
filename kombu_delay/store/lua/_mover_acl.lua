--[[ mover_acl: whether this user's ACL allows what a mover's scripts run on its namespace.

mover_refused(ns, thawing)
  The first command a mover's scripts need (the move, the thaw, the sweep, the clean-up) that
  this user's ACL refuses on the keys of namespace ``ns`` they would run it on, as {command,
  key}; nil where every one is allowed. Redis 6 has no acl_check_cmd to ask: there each
  command that reads, or that writes nothing on a key that is not there, is tried on such a
  key (<ns>acl-probe, which nothing writes), and a refusal of it is the ACL's; HSET, HSETNX,
  HINCRBY, RPUSH and LPUSH, which would write, cannot be tried so. Redis keeps a script's
  writes when it refuses a later command of the same call:
  a thaw refused DEL or HSET after it took its messages out of the cold space lost them, and
  a move or thaw refused HGETALL or ZCARD took a healthy bucket for a damaged one. So a mover
  asks at each heartbeat (heartbeat.lua: one refused stops it, naming the command, before
  its first move), and a thaw asks again before its first write (thaw.lua). Left out, as each
  is handled where it is refused: LPUSH and TYPE on the queues (the move asks per queue, and
  a mover refused every LPUSH waits with its messages, telling it), LPUSH onto the dead
  letters (asked only ``thawing``: where a thaw lets go a member it cannot restore),
  SUBSCRIBE, the walk's HSCAN, the herd's handover, PEXPIRE for x-expires, SCAN and CONFIG.
  Every command asked is in the ACL line of the docs' Security page.
  Bound: a constant number of ACL checks, nothing read or written.
]]
--- @include spaces
local function probed_refusal(ns)
  local key = ns .. 'acl-probe'
  for _, call in ipairs({
    {'TIME'}, {'HGETALL', key}, {'HGET', key, 'f'}, {'HMGET', key, 'f'}, {'HKEYS', key}, {'EXISTS', key},
    {'ZRANGE', key, '0', '0'}, {'ZRANGEBYSCORE', key, '0', '1'}, {'ZSCORE', key, 'm'}, {'ZCARD', key},
    {'ZCOUNT', key, '0', '1'}, {'LRANGE', key, '0', '0'}, {'PTTL', key}, {'DEL', key}, {'HDEL', key, 'f'},
    {'ZREM', key, 'm'}, {'ZREMRANGEBYRANK', key, '1', '0'}, {'ZREMRANGEBYSCORE', key, '1', '0'},
    {'ZADD', key, 'XX', '0', 'm'}, {'PEXPIREAT', key, '1'}, {'LTRIM', key, '0', '0'},
  }) do
    local reply = redis.pcall(unpack(call))
    -- (Redis 6's words for an ACL refusal in a script; a replica's READONLY, an OOM, is none)
    if type(reply) == 'table' and reply.err
        and string.find(reply.err, "The user executing the script can't", 1, true) then
      return {call[1], call[2] or ''}
    end
  end
  return nil
end

local function mover_refused(ns, thawing)
  if not redis.acl_check_cmd then return probed_refusal(ns) end
  local calls = {{'TIME'}}
  local function add(list)
    for _, call in ipairs(list) do calls[#calls + 1] = call end
  end
  local totals, counts, ids, gc = ns .. 'totals', ns .. 'counts', ns .. 'ids', ns .. 'gc'
  local movers = ns .. 'movers'
  add({{'ZREMRANGEBYSCORE', movers, '0', '1'}, {'ZADD', movers, '0', 'm'}, {'PTTL', movers},
       {'PEXPIREAT', movers, '1'},{'HGET', totals, 'f'}, {'HSET', totals, 'f', 'v'}, {'HINCRBY', totals, 'f', '1'},
       {'PTTL', totals}, {'PEXPIREAT', totals, '1'},
       {'HGET', counts, 'f'}, {'HINCRBY', counts, 'f', '1'}, {'HDEL', counts, 'f'}, {'HKEYS', counts},
       {'HGET', ids, 'f'}, {'HMGET', ids, 'f'}, {'HSET', ids, 'f', 'v'}, {'HDEL', ids, 'f'},
       {'ZADD', gc, '0', 'm'}, {'ZREM', gc, 'm'}, {'ZRANGEBYSCORE', gc, '0', '1'}, {'PTTL', gc},
       {'PEXPIREAT', gc, '1'}})
  if thawing then add({{'LPUSH', ns .. 'dead', 'v'}}) end
  for _, tag in ipairs({'', 'c'}) do
    local s = space(ns, tag)
    local meta, zset, tasks = s:meta('0'), s:zset('0', 'q'), s:tasks('0')
    add({{'ZRANGE', s.index, '0', '0'}, {'ZRANGEBYSCORE', s.index, '0', '1'}, {'ZADD', s.index, '0', 'm'},
         {'ZREM', s.index, 'm'}, {'PTTL', s.index}, {'PEXPIREAT', s.index, '1'},
         {'HGETALL', meta}, {'HGET', meta, 'f'}, {'HMGET', meta, 'f'}, {'HSET', meta, 'f', 'v'},
         {'HSETNX', meta, 'f', 'v'}, {'HDEL', meta, 'f'}, {'HINCRBY', meta, 'f', '1'}, {'EXISTS', meta},
         {'DEL', meta}, {'PEXPIREAT', meta, '1'},
         {'ZRANGE', zset, '0', '0'}, {'ZRANGEBYSCORE', zset, '0', '1'}, {'ZSCORE', zset, 'm'},
         {'ZCARD', zset}, {'ZCOUNT', zset, '0', '1'}, {'ZADD', zset, '0', 'm'}, {'ZREM', zset, 'm'},
         {'ZREMRANGEBYRANK', zset, '1', '0'}, {'EXISTS', zset}, {'DEL', zset}, {'PEXPIREAT', zset, '1'}})
    if tasks then
      add({{'LRANGE', tasks, '0', '0'}, {'LTRIM', tasks, '0', '0'}, {'RPUSH', tasks, 'v'}, {'EXISTS', tasks},
           {'DEL', tasks}, {'PEXPIREAT', tasks, '1'}})
    end
  end
  for _, call in ipairs(calls) do
    if not redis.acl_check_cmd(unpack(call)) then return {call[1], call[2] or ''} end
  end
  return nil
end
