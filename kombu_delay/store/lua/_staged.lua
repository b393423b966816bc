--[[ staged: a herd's list, built ahead of its due time, handed over whole when it is due.

A run is the head of one bucket's sorted set for one destination: its n members due at one
millisecond T, and nothing earlier. stage.lua copies a large run, ahead of T, into a list
<ns>h:<start>:<dest> (the staged list) in the order move.lua would push it, while the run
stays in its sorted set: find, cancel, listing and the counts read only the sorted set, so
the staged list is a copy nothing else sees. When T is due, move.lua renames the staged list
onto the destination and drops the run from its sorted set (UNLINK, freed by Redis in the
background), in one call whatever n is: the herd reaches its list in O(1), not in batches.

The meta hash keeps the run's mark: fields ``h:<dest>`` (T) and ``hn:<dest>`` (n). A copy
is good only while the run is unchanged. A removal (cancel, reschedule, purge, another
mover's batch) leaves fewer than n due by T, which stage.lua and move.lua check before they
use it. An addition due by T would hide such a removal, so whatever adds to a sorted set
(put, put_group) drops the copy first (drop_staged_for). A copy that is not used expires
with its bucket.

staged_mark(meta, dest)
  Returns T, n of the destination's mark, or nil.

drop_staged(s, meta, start_s, dest)
  Deletes the staged list (UNLINK: Redis frees a large one in the background) and the mark.

drop_staged_for(s, meta, start_s, dest, due, t)
  drop_staged when there is a mark (``t``, its T, as staged_mark or the caller read it) and
  ``due`` is not after T: for put and put_group, which have just added a message due then.

run_intact(zset, staged, t, n, have)
  True when the sorted set still holds exactly n members due by T and the staged list, of
  ``have`` members so far, begins with the run's first and ends with its member of rank
  have - 1: nothing of the run was removed, nothing added.

may_hand_over(staged, zset, dest)
  True when this user's ACL allows what staging and a handover do beyond a move (RENAME,
  UNLINK, PERSIST, PEXPIRE, LINDEX, ZRANGESTORE). Redis 7 is asked (acl_check_cmd); Redis 6 cannot be, so each is
  tried on a key that does not exist (the ACL is checked before the command runs, and such a
  call writes nothing): a refusal is an error other than "no such key".
]]
local function staged_mark(meta, dest)
  local mark = redis.call('HMGET', meta, 'h:' .. dest, 'hn:' .. dest)
  local t, n = tonumber(mark[1]), tonumber(mark[2])
  if t and n then return t, n end
end

local function drop_staged(s, meta, start_s, dest)
  redis.call('HDEL', meta, 'h:' .. dest, 'hn:' .. dest)
  redis.call('UNLINK', s:staged(start_s, dest))
end

local function drop_staged_for(s, meta, start_s, dest, due, t)
  if t and due < t + 1 then drop_staged(s, meta, start_s, dest) end
end

local function run_intact(zset, staged, t, n, have)
  if redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', t + 1)) ~= n then return false end
  if have == 0 then return true end
  local first, last = redis.call('ZRANGE', zset, 0, 0)[1], redis.call('ZRANGE', zset, have - 1, have - 1)[1]
  return first == redis.call('LINDEX', staged, -1) and last == redis.call('LINDEX', staged, 0)
end

local function may_hand_over(staged, zset, dest)
  local spare = staged .. ':probe'
  local calls = {{'RENAME', spare, dest}, {'RENAME', spare, zset}, {'UNLINK', spare},
                 {'PERSIST', spare}, {'PEXPIRE', spare, 1}, {'LINDEX', spare, 0},
                 {'ZRANGESTORE', spare, zset, 0, 0}}
  for _, call in ipairs(calls) do
    if redis.acl_check_cmd then
      if not redis.acl_check_cmd(unpack(call)) then return false end
    elseif call[1] ~= 'ZRANGESTORE' then  -- ZRANGESTORE would write: RENAME's refusal stands for it
      local reply = redis.pcall(unpack(call))
      if type(reply) == 'table' and reply.err and not string.find(reply.err, 'no such key', 1, true) then
        return false
      end
    end
  end
  return true
end
