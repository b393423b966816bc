--[[ staged: a herd's list, built ahead of its due time, handed over whole when it is due.

A run is the n members of one bucket's sorted set for one destination due at one millisecond
T; in the set, only messages due before T come before it. stage.lua copies a large run, ahead
of T, into a list <ns>h:<start>:<dest> (the staged list) in the order move.lua would push it,
while the run stays in its sorted set: find, cancel, listing and the counts read only the
sorted set, so the staged list is a copy nothing else sees. When T is due (and what was due
before it has gone), move.lua renames the staged list onto the destination and drops the run
from its sorted set (UNLINK, freed by Redis in the background), in one call whatever n is:
the herd reaches its list in O(1), not in batches.

The meta hash keeps the run's mark: fields ``h:<dest>`` (T) and ``hn:<dest>`` (n). A copy
is good only while the run is unchanged. A removal (cancel, reschedule, purge, another
mover's batch) leaves fewer than n due at T, which stage.lua and move.lua check, with the
copy's ends, before they use it. An addition due at T could hide a removal, so whatever adds
to a sorted set (put, put_group) drops the copy first (drop_staged_for). Messages due before
or after T change nothing in the run. A copy that is not used goes with its bucket: dropped by
its clean-up (move.lua), or expired.

staged_mark(meta, dest)
  Returns T, n of the destination's mark, or nil (also for a mark that is no whole number in
  range, written by hand: read as one, 'inf' or 1e400 held the queue's moves for good).

mark_of(text)
  A mark's field read as a whole number from 0 to 2^53, or nil.

drop_staged(s, meta, start_s, dest)
  Deletes the mark and the staged list (UNLINK: Redis frees a large one in the background;
  DEL for a user the ACL refuses UNLINK, such as a publisher's, which put and put_group call
  this for: a publish that made its writes must not fail, or its retry would store the
  message twice).

drop_every_staged(s, meta, start_s)
  drop_staged for every mark of the bucket: its clean-up, once drained (move.lua), when a
  run was moved in batches by a mover that leaves the copy (a rate-capped one, or one of a
  release that stages nothing), which would otherwise outlive its herd by the bucket's grace.

drop_staged_for(s, meta, start_s, dest, due, t)
  drop_staged when there is a mark (``t``, its T, as staged_mark or the caller read it) and
  ``due`` is T: for put and put_group, which have just added a message due then.

run_of(zset, t)
  Returns e, n: how many members of the set are due before T, and how many at T.

run_intact(zset, staged, t, n, have)
  Returns e (see run_of) when the set still holds exactly n members due at T and the staged
  list, of ``have`` members so far, ends with the run's first member (on the right) and its
  member of rank have - 1 (on the left): nothing of the run was removed, nothing added.
  Returns nil otherwise.

may_hand_over(s, zset, dest, staging)
  True when this user's ACL allows what staging and a handover do beyond a move (RENAME,
  UNLINK, PERSIST, PEXPIRE, LINDEX, ZRANGESTORE, LPUSH); false when it refuses one of them; 'dest'
  when it allows them but not onto dest (a queue outside its key pattern: that queue's run
  waits, as its move does, and the other queues' herds are still handed over). Redis 7 is
  asked (acl_check_cmd, LPUSH onto dest too); Redis 6 cannot be, so each is tried on
  <ns>h-probe, a key nothing creates (the ACL is checked before the command runs, and such a
  call writes nothing): a refusal is an error other than "no such key"; with ``staging``
  (stage.lua, before it writes anything), LPUSH is tried on it too, and the key deleted.
]]
local function mark_of(text)
  local n = tonumber(text)
  if n and n >= 0 and n < 2 ^ 53 and n == math.floor(n) then return n end
end

local function staged_mark(meta, dest)
  local mark = redis.call('HMGET', meta, 'h:' .. dest, 'hn:' .. dest)
  local t, n = mark_of(mark[1]), mark_of(mark[2])
  if t and n then return t, n end
end

local function drop_staged(s, meta, start_s, dest)
  redis.call('HDEL', meta, 'h:' .. dest, 'hn:' .. dest)
  local staged = s:staged(start_s, dest)
  local gone = redis.pcall('UNLINK', staged)
  if type(gone) == 'table' and gone.err then redis.call('DEL', staged) end
end

local function drop_every_staged(s, meta, start_s)
  local fields = redis.call('HGETALL', meta)
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 2) == 'h:' then drop_staged(s, meta, start_s, string.sub(fields[i], 3)) end
  end
end

local function drop_staged_for(s, meta, start_s, dest, due, t)
  if t and due == t then drop_staged(s, meta, start_s, dest) end
end

local function run_of(zset, t)
  local t_s, next_s = string.format('%d', t), string.format('%d', t + 1)
  return redis.call('ZCOUNT', zset, '-inf', '(' .. t_s), redis.call('ZCOUNT', zset, t_s, '(' .. next_s)
end

local function run_intact(zset, staged, t, n, have)
  local e, now_n = run_of(zset, t)
  if now_n ~= n then return nil end
  if have == 0 then return e end
  local first = redis.call('ZRANGE', zset, e, e)[1]
  local last = redis.call('ZRANGE', zset, e + have - 1, e + have - 1)[1]
  if first == redis.call('LINDEX', staged, -1) and last == redis.call('LINDEX', staged, 0) then return e end
end

local function may_hand_over(s, zset, dest, staging)
  local spare = s.keys .. 'h-probe'
  -- The destination's last, so that a refusal of the commands themselves is told first.
  local calls = {{'RENAME', spare, zset}, {'UNLINK', spare}, {'PERSIST', spare}, {'PEXPIRE', spare, 1},
                 {'LINDEX', spare, 0}, {'ZRANGESTORE', spare, zset, 0, 0}, {'RENAME', spare, dest}}
  for i, call in ipairs(calls) do
    local refused
    if redis.acl_check_cmd then
      refused = not redis.acl_check_cmd(unpack(call))
    elseif call[1] ~= 'ZRANGESTORE' then  -- ZRANGESTORE would write: RENAME's refusal stands for it
      local reply = redis.pcall(unpack(call))
      refused = type(reply) == 'table' and reply.err and not string.find(reply.err, 'no such key', 1, true)
    end
    if refused then return i == #calls and 'dest' end
  end
  if redis.acl_check_cmd then
    if not redis.acl_check_cmd('LPUSH', spare, 'x') then return false end
    if not redis.acl_check_cmd('LPUSH', dest, 'x') then return 'dest' end
  elseif staging then
    -- Redis 6 cannot be asked about LPUSH, which staging needs onto its own list: tried on
    -- the probe key, and the key deleted at once (a script runs alone: nothing else sees it).
    -- Not in a move's handover: a write there could be a move's first, which Redis refuses
    -- under maxmemory; the staging it hands over pushed already.
    local pushed = redis.pcall('LPUSH', spare, 'x')
    if type(pushed) == 'table' and pushed.err then return false end
    redis.call('DEL', spare)
  end
  return true
end
