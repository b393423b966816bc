--[[ handover: a due run's staged list onto its destination, whole (move.lua).

hand_over(s, meta, start_s, zset, dest, t, n, spare, spare_rest)
  The run of n members due at t, at the head of ``zset`` now (what was due before it has
  gone), was staged by stage.lua (see _staged.lua). Renames the staged list onto ``dest`` and
  drops the run from ``zset``, in O(1) for the run whatever n is; returns n. Returns nil,
  having dropped the copy and written nothing else, when it cannot: the run changed, the ACL
  refuses a command it needs, or what it would do per message is too much for one call (the
  part of the copy still missing or what waits on ``dest`` already beyond ``spare``, the
  members of ``zset`` after the run beyond ``spare_rest``, each copied one by one; or the
  first two more than about CALL_BYTES, read by read_ranks in _chunks.lua before anything is
  written). The caller then moves the run in batches, as without a copy. The caller has checked ``dest``: a
  list or no key, no max length, and LPUSH allowed.

What waits on ``dest`` already goes to the right of the herd, where consumers take first, as
it would with batches pushed on its left. ``dest`` keeps its own expiry (x-expires), not the
copy's. The sorted set is deleted with UNLINK, which frees its members in the background; the
members after the run, if any, are kept in a new set that takes its name and expiry.
Every command after the rename, which commits, is one the ACL was asked about (Redis 7) or
tried with (Redis 6) in this call, and none of them may grow memory: a herd is never both on
its list and still scheduled.
]]
--- @include staged
--- @include chunks
local function push_sliced(command, key, values)
  for first = 1, #values, 1000 do
    redis.call(command, key, unpack(values, first, math.min(#values, first + 999)))
  end
end

local function failed(reply)
  return type(reply) == 'table' and reply.err ~= nil
end

local function hand_over(s, meta, start_s, zset, dest, t, n, spare, spare_rest)
  local staged = s:staged(start_s, dest)
  local have, waiting = redis.call('LLEN', staged), redis.call('LLEN', dest)
  local rest = redis.call('ZCARD', zset) - n
  -- Every command after the rename is allowed (asked, or tried, here): a refusal there would
  -- leave the herd both on its list and still scheduled.
  if have > n or n - have > spare or waiting > spare or rest > spare_rest
      or run_intact(zset, staged, t, n, have) ~= 0 or may_hand_over(s, zset, dest) ~= true then
    drop_staged(s, meta, start_s, dest)
    return nil
  end
  -- What is copied one by one, read first, within CALL_BYTES: the end of the copy (the last
  -- stage call may not have come before the due time) and what waits on dest.
  local missing, used = {}, 0
  if have < n then missing, used = read_ranks('ZRANGE', zset, have, n - have, CALL_BYTES) end
  local ahead_of = {}
  if waiting > 0 and #missing == n - have then
    ahead_of = read_ranks('LRANGE', dest, 0, waiting, CALL_BYTES - used)
  end
  if #missing < n - have or #ahead_of < waiting then
    drop_staged(s, meta, start_s, dest)
    return nil
  end
  -- The first write, if nothing came before it in this call, must not be one that may grow
  -- memory: under maxmemory Redis would refuse the call, and movers must keep moving then.
  redis.call('ZREMRANGEBYRANK', zset, 1, 0)
  if have < n then push_sliced('LPUSH', staged, missing) end
  local kept
  if rest > 0 then
    kept = s.keys .. 'h-rest'  -- made and renamed in this call: no other key has this name
    if failed(redis.pcall('ZRANGESTORE', kept, zset, n, -1)) then
      redis.call('UNLINK', kept)
      drop_staged(s, meta, start_s, dest)
      return nil
    end
  end
  if waiting > 0 then push_sliced('RPUSH', staged, ahead_of) end
  local ttl = redis.call('PTTL', dest)
  if failed(redis.pcall('RENAME', staged, dest)) then
    if kept then redis.call('UNLINK', kept) end
    drop_staged(s, meta, start_s, dest)
    return nil
  end
  if ttl > 0 then redis.call('PEXPIRE', dest, ttl) else redis.call('PERSIST', dest) end
  local zttl = redis.call('PTTL', zset)
  redis.call('UNLINK', zset)
  if kept then
    redis.call('RENAME', kept, zset)
    if zttl > 0 then redis.call('PEXPIRE', zset, zttl) end
  end
  redis.call('HDEL', meta, 'h:' .. dest, 'hn:' .. dest)
  return n
end
