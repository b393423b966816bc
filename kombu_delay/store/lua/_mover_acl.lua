--[[ mover_acl: whether this user's ACL allows what a mover's scripts run on its namespace.

mover_refused(ns, thawing, probe, purging)
  The first command a mover's scripts need (the move, the thaw, the sweep, the clean-up) that
  this user's ACL refuses on the keys of namespace ``ns`` they would run it on, as {command,
  key}; nil where every one is allowed. Redis 6 has no acl_check_cmd to ask: there, only with
  ``probe``, each command that reads, or that writes nothing (on a key of its kind that no
  script writes, the bucket of 1970: a message due then is pushed at once; or a member no
  script writes), is run so, a refusal of it being the ACL's; HSET, HSETNX, HINCRBY, RPUSH and
  LPUSH, which would write, cannot be tried so. Each read of a missing key counts in Redis's
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
  Every command asked is in the ACL line of the docs' Security page. With ``purging``, those a
  purge runs (purge.lua: the same, less the heartbeat's on <ns>movers, and the purge mark's
  on <ns>purging, purging.lua).

refusal_reply(refused, job, nothing)
  The error reply of a script that does ``job`` and wrote ``nothing``, for the refusal
  ``refused`` (as mover_refused returns it).
  Bound: a constant number of ACL checks (Redis 7: nothing read or written; Redis 6: a
  constant number of commands that change nothing).
]]
--- @include spaces
-- The calls mover_refused asks about, each as {command, key, args...}: those of ``tried``
-- also run on Redis 6 as they are (a read, or a write of nothing on a key no script writes).
local function mover_calls(ns, thawing, purging)
  local asked, tried = {}, {{'TIME'}}
  local function add(list, calls)
    for _, call in ipairs(calls) do list[#list + 1] = call end
  end
  local totals, counts, ids, gc = ns .. 'totals', ns .. 'counts', ns .. 'ids', ns .. 'gc'
  local movers = ns .. 'movers'
  if purging then
    local marks = ns .. 'purging'
    add(asked, {{'HSET', marks, 'f', 'v'}, {'HDEL', marks, 'f'}, {'PEXPIREAT', marks, '1'}})
    add(tried, {{'HMGET', marks, 'f'}, {'EXISTS', marks}})
  else
    add(asked, {{'ZREMRANGEBYSCORE', movers, '0', '1'}, {'ZADD', movers, '0', 'm'}, {'PEXPIREAT', movers, '1'}})
    add(tried, {{'PTTL', movers}})
  end
  add(asked, {{'HSET', totals, 'f', 'v'}, {'HINCRBY', totals, 'f', '1'}, {'PEXPIREAT', totals, '1'},
              {'HINCRBY', counts, 'f', '1'}, {'HDEL', counts, 'f'}, {'HKEYS', counts},
              {'HMGET', ids, 'f'}, {'HSET', ids, 'f', 'v'}, {'HDEL', ids, 'f'},
              {'ZADD', gc, '0', 'm'}, {'PEXPIREAT', gc, '1'}})
  add(tried, {{'HGET', totals, 'f'}, {'PTTL', totals}, {'HGET', counts, 'f'},
              {'HGET', ids, 'f'}, {'ZREM', gc, 'm'}, {'ZRANGEBYSCORE', gc, '0', '1'}, {'PTTL', gc}})
  if thawing then add(asked, {{'LPUSH', ns .. 'dead', 'v'}}) end
  for _, tag in ipairs({'', 'c'}) do
    local s = space(ns, tag)
    local meta, zset, tasks = s:meta('0'), s:zset('0', 'q'), s:tasks('0')  -- (the bucket of 1970)
    add(asked, {{'ZADD', s.index, '0', 'm'}, {'PEXPIREAT', s.index, '1'},
                {'HSET', meta, 'f', 'v'}, {'HSETNX', meta, 'f', 'v'}, {'HINCRBY', meta, 'f', '1'}})
    add(tried, {{'ZRANGE', s.index, '0', '0'}, {'ZRANGEBYSCORE', s.index, '0', '1'}, {'ZREM', s.index, 'm'},
                {'PTTL', s.index}, {'HGETALL', meta}, {'HGET', meta, 'f'}, {'HMGET', meta, 'f'},
                {'HKEYS', meta}, {'EXISTS', meta}, {'PTTL', meta}, {'HDEL', meta, 'f'}, {'DEL', meta},
                {'PEXPIREAT', meta, '1'},
                {'ZRANGE', zset, '0', '0'}, {'ZRANGEBYSCORE', zset, '0', '1'}, {'ZSCORE', zset, 'm'},
                {'ZCARD', zset}, {'ZCOUNT', zset, '0', '1'}, {'EXISTS', zset},
                {'ZADD', zset, 'XX', '0', 'm'}, {'ZREM', zset, 'm'}, {'ZREMRANGEBYRANK', zset, '1', '0'},
                {'DEL', zset}, {'PEXPIREAT', zset, '1'}})
    if tasks then
      add(asked, {{'RPUSH', tasks, 'v'}})
      add(tried, {{'LRANGE', tasks, '0', '0'}, {'LTRIM', tasks, '0', '0'}, {'EXISTS', tasks},
                  {'DEL', tasks}, {'PEXPIREAT', tasks, '1'}})
    end
  end
  return asked, tried
end

local function mover_refused(ns, thawing, probe, purging)
  local asked, tried = mover_calls(ns, thawing, purging)
  if redis.acl_check_cmd then
    for _, calls in ipairs({tried, asked}) do
      for _, call in ipairs(calls) do
        if not redis.acl_check_cmd(unpack(call)) then return {call[1], call[2] or ''} end
      end
    end
    return nil
  end
  if not probe then return nil end
  for _, call in ipairs(tried) do
    local reply = redis.pcall(unpack(call))
    -- (Redis 6's words for an ACL refusal in a script; a replica's READONLY, an OOM, is none)
    if type(reply) == 'table' and reply.err
        and string.find(reply.err, "The user executing the script can't", 1, true) then
      return {call[1], call[2] or ''}
    end
  end
  return nil
end

local function refusal_reply(refused, job, nothing)
  return redis.error_reply('NOPERM this user may not run ' .. refused[1] .. ' on ' .. refused[2]
    .. ', which a ' .. job .. ' needs; ' .. nothing)
end
