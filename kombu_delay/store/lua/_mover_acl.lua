--[[ mover_acl: whether this user's ACL allows what a mover's scripts run on its namespace.

mover_refused(ns, thawing, probe)
  The first command a mover's scripts need (the move, the thaw, the sweep, the clean-up) that
  this user's ACL refuses on the keys of namespace ``ns`` they would run it on, as {command,
  key}; nil where every one is allowed. Redis 6 has no acl_check_cmd to ask: there, only with
  ``probe``, each command that reads, or that writes nothing on a key that is not there, is
  run on a key of its kind that no script writes (the bucket of 1970: a message due then is
  pushed at once), a refusal of it being the ACL's; HSET, HSETNX, HINCRBY, RPUSH and LPUSH,
  which would write, cannot be tried so. Each read of a missing key counts in Redis's
  keyspace_misses, so a mover probes once at its start and then at each thaw, not at every
  heartbeat. Redis keeps a script's writes when it refuses a later command of the same call:
  a thaw refused DEL or HSET after it took its messages out of the cold space lost them, and
  a move or thaw refused HGETALL or ZCARD took a healthy bucket for a damaged one. So a mover
  asks at each heartbeat (heartbeat.lua: one refused stops it, naming the command, before
  its first move), and a thaw asks again before its first write (thaw.lua). Left out, as each
  is handled where it is refused: LPUSH and TYPE on the queues (the move asks per queue, and
  a mover refused every LPUSH waits with its messages, telling it), LPUSH onto the dead
  letters (asked only ``thawing``: where a thaw lets go a member it cannot restore),
  SUBSCRIBE, the walk's HSCAN, the herd's handover, PEXPIRE for x-expires, SCAN and CONFIG.
  Every command asked is in the ACL line of the docs' Security page.
  Bound: a constant number of ACL checks (Redis 7: nothing read or written; Redis 6: a
  constant number of commands that change nothing).
]]
--- @include spaces
local function probed_refusal(ns)
  local shared = {ns .. 'ids', ns .. 'counts', ns .. 'totals'}
  local calls = {{'TIME'}, {'ZRANGE', ns .. 'gc', '0', '0'}, {'ZRANGEBYSCORE', ns .. 'gc', '0', '1'}}
  for _, key in ipairs(shared) do
    calls[#calls + 1] = {'HGET', key, 'f'}
    calls[#calls + 1] = {'PTTL', key}
  end
  for _, tag in ipairs({'', 'c'}) do
    local s = space(ns, tag)
    local meta, zset, tasks = s:meta('0'), s:zset('0', 'q'), s:tasks('0')
    for _, call in ipairs({
      {'ZRANGE', s.index, '0', '0'}, {'ZRANGEBYSCORE', s.index, '0', '1'}, {'ZREM', s.index, '0'},
      {'HGETALL', meta}, {'HGET', meta, 'f'}, {'HMGET', meta, 'f'}, {'HKEYS', meta}, {'EXISTS', meta},
      {'PTTL', meta}, {'HDEL', meta, 'f'}, {'DEL', meta}, {'PEXPIREAT', meta, '1'},
      {'ZRANGE', zset, '0', '0'}, {'ZRANGEBYSCORE', zset, '0', '1'}, {'ZSCORE', zset, 'm'}, {'ZCARD', zset},
      {'ZCOUNT', zset, '0', '1'}, {'ZREM', zset, 'm'}, {'ZREMRANGEBYRANK', zset, '1', '0'},
      {'ZREMRANGEBYSCORE', zset, '1', '0'}, {'ZADD', zset, 'XX', '0', 'm'}, {'DEL', zset},
    }) do calls[#calls + 1] = call end
    if tasks then
      calls[#calls + 1] = {'LRANGE', tasks, '0', '0'}
      calls[#calls + 1] = {'LTRIM', tasks, '0', '0'}
    end
  end
  for _, call in ipairs(calls) do
    local reply = redis.pcall(unpack(call))
    -- (Redis 6's words for an ACL refusal in a script; a replica's READONLY, an OOM, is none)
    if type(reply) == 'table' and reply.err
        and string.find(reply.err, "The user executing the script can't", 1, true) then
      return {call[1], call[2] or ''}
    end
  end
  return nil
end

local function mover_refused(ns, thawing, probe)
  if not redis.acl_check_cmd then return probe and probed_refusal(ns) or nil end
  local calls = {{'TIME'}}
  local function add(list)
    for _, call in ipairs(list) do calls[#calls + 1] = call end
  end
  local totals, counts, ids, gc = ns .. 'totals', ns .. 'counts', ns .. 'ids', ns .. 'gc'
  local movers = ns .. 'movers'
  add({{'ZREMRANGEBYSCORE', movers, '0', '1'}, {'ZADD', movers, '0', 'm'}, {'PTTL', movers},
       {'PEXPIREAT', movers, '1'}, {'HGET', totals, 'f'}, {'HSET', totals, 'f', 'v'},
       {'HINCRBY', totals, 'f', '1'}, {'PTTL', totals}, {'PEXPIREAT', totals, '1'},
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
