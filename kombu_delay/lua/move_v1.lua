--[[ move_v1: move the due envelopes that kombu-delay 0.1 stored, oldest first.

kombu-delay 0.1 kept one sorted set per bucket, of envelopes "<len(id)>:<len(dest)>:<id><dest>
<payload>". Nothing writes that layout any more; a mover runs this script only while the 0.1
index exists (move.lua reports it), so an upgrade delivers what the old version scheduled.

KEYS[1] index   ZSET  <ns>buckets   member = score = bucket start (epoch ms)
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see schedule.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] dead    LIST  <ns>dead      envelopes that cannot be parsed
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] limit    most envelopes moved (or dead-lettered) in this call
ARGV[3] max_len  hold a destination while its list has this many items or more (0 = never);
                 the envelopes this call pushes count too, so a list never passes max_len
Returns: {moved, next_due_ms (-1 if nothing scheduled), now_ms, now_us (0..999 past now_ms),
          dead, held, expired, wrongtype, more (1 if the limit was reached), 1, lateness...}
         with the lateness (now - due, ms, >= 0) of each moved envelope in move order,
         run-length coded: a run of n > 1 equal values is -n followed by the value. A burst
         due at one instant then costs two integers, not one per message, to send and parse.
Bound: moves at most ARGV[2] envelopes, steps over at most 10 * ARGV[2] that must stay put
       (held or wrong-type destination), and visits at most ARGV[2] buckets. The separate
       step-over allowance lets messages for other queues pass a held herd; a bucket whose
       queues are all blocked is stepped over whole from its meta counts, unread.

Each envelope is removed with ZREM and pushed with LPUSH inside this one script, so a crash
can neither lose nor duplicate it, and several movers can run it at once: a member another
mover already moved is simply not there any more.
]]
local index, ids, counts, totals, dead = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local find, sub, floor = string.find, string.sub, math.floor  -- locals: read once per message
local ns = ARGV[1]
local limit = tonumber(ARGV[2])
local max_len = tonumber(ARGV[3])

local now, now_us = clock()
local upper = '(' .. string.format('%d', now + 1)  -- floor(score) <= now, never earlier

local moved, dead_n, held, expired, wrong = 0, 0, 0, 0, 0
local add_late, finish_lateness = lateness_runs()
local budget = limit
local skip_left = 10 * limit
local room, room_of = room_keeper(max_len)

-- Returns false when the envelope may be pushed now (and takes one unit of room), else
-- 'held' (the list is at max_len) or 'wrongtype' (the key is not a list).
local function blocked_by(dest)
  local left = room_of(dest)
  if left == -1 then
    room[dest] = left
    return 'wrongtype'
  elseif left == 0 then
    room[dest] = left
    return 'held'
  end
  room[dest] = left - 1
  return false
end

local starts = redis.call('ZRANGEBYSCORE', index, '-inf', now, 'LIMIT', 0, limit)
for _, start_s in ipairs(starts) do
  if budget <= 0 or skip_left <= 0 then break end
  local bucket = ns .. 'bucket:' .. start_s
  local meta = ns .. 'meta:' .. start_s
  local offset = 0
  -- A held herd must not be read member by member on every poll (10x the limit of 1 KB
  -- members each time keeps Redis busy for nothing): when every destination that has
  -- messages in this bucket is blocked, its meta counts say so, and the bucket is
  -- stepped over whole, without reading it.
  local fields = redis.call('HGETALL', meta)
  local open, stuck, stuck_wrong = false, 0, 0
  local dests_here = {}
  for i = 1, #fields, 2 do
    local name, n = fields[i], tonumber(fields[i + 1])
    if n > 0 and string.sub(name, 1, 2) == 'q:' then
      dests_here[#dests_here + 1] = string.sub(name, 3)
      local left = room_of(dests_here[#dests_here])
      if left > 0 then
        open = true
      elseif left == -1 then
        stuck_wrong = stuck_wrong + n
      else
        stuck = stuck + n
      end
    end
  end
  if stuck + stuck_wrong == 0 then
    open = true  -- no counts to go by: read the bucket
  elseif not open then
    local waiting = redis.call('ZCOUNT', bucket, '-inf', upper)  -- due ones only, O(log n)
    if waiting > 0 then
      if stuck > 0 then held = held + waiting else wrong = wrong + waiting end
    end
  end
  local function all_blocked()
    for _, dest in ipairs(dests_here) do
      if room[dest] == nil or room[dest] > 0 then return false end
    end
    return #dests_here > 0
  end
  local bucket_blocked, stepped_here = false, 0
  while open and not bucket_blocked and budget > 0 and skip_left > 0 do
    -- A herd due at one millisecond is read without its scores: when the first and the last
    -- of the next `budget` members (by rank) are due at the same millisecond, so is every one
    -- between, one number is the lateness of all, and each score would be one more Lua
    -- string to make and parse. Otherwise each member comes with its score (step 2).
    local batch, step, due_all
    local last = offset + budget - 1
    local ends = redis.call('ZRANGE', bucket, offset, offset, 'WITHSCORES')
    local due_first = ends[2] and floor(tonumber(ends[2]))
    if due_first and due_first <= now then
      ends = redis.call('ZRANGE', bucket, last, last, 'WITHSCORES')
      if ends[2] and floor(tonumber(ends[2])) == due_first then
        batch, step, due_all = redis.call('ZRANGE', bucket, offset, last), 1, due_first
      end
    end
    if not batch then
      batch = redis.call('ZRANGEBYSCORE', bucket, '-inf', upper, 'WITHSCORES', 'LIMIT', offset, budget)
      step = 2
    end
    if #batch == 0 then break end
    -- removed[k], task_ids[k] and scores[k] (its rank instead, when read without scores)
    -- describe the k-th envelope taken; pushes[dest] holds per_dest[dest] payloads. Explicit
    -- counts: Lua 5.1 finds #t by a search.
    local removed, task_ids, scores, taken = {}, {}, {}, 0
    local dead_here = {}
    local pushes, order = {}, {}
    local per_dest = {}
    local stepped = 0
    for i = 1, #batch, step do
      local member, score = batch[i], due_all or tonumber(batch[i + 1])
      budget = budget - 1
      local _, hdr_end, il, dl = find(member, '^(%d+):(%d+):')
      il, dl = tonumber(il), tonumber(dl)
      if not hdr_end or dl == 0 or #member <= hdr_end + il + dl then
        dead_here[#dead_here + 1] = member
      else
        local dest = sub(member, hdr_end + il + 1, hdr_end + il + dl)
        local state = blocked_by(dest)
        if state then
          budget = budget + 1  -- stepping over costs the step-over allowance instead
          skip_left = skip_left - 1
          stepped = stepped + 1
          if state == 'held' then held = held + 1 else wrong = wrong + 1 end
          stepped_here = stepped_here + 1
          if skip_left <= 0 then break end
          if all_blocked() then  -- its queues filled up during this call: leave the bucket
            bucket_blocked = true
            break
          end
        else
          taken = taken + 1
          removed[taken] = member
          task_ids[taken] = sub(member, hdr_end + 1, hdr_end + il)
          scores[taken] = due_all and offset + (i - 1) or score  -- its rank, read without scores
          local list = pushes[dest]
          if not list then
            list = {}
            pushes[dest] = list
            per_dest[dest] = 0
            order[#order + 1] = dest
          end
          local k = per_dest[dest] + 1
          per_dest[dest] = k
          list[k] = sub(member, hdr_end + il + dl + 1)
          add_late(now - floor(score), 1)
        end
      end
    end
    -- Before the removals, so a ref can still read its member's score by rank. Its first
    -- write is an HDEL: under maxmemory Redis refuses a script whose first write may grow
    -- memory (see drop_refs in _common.lua), and movers must keep moving then.
    drop_refs(ids, task_ids, function(i)
      local score = scores[i]
      if due_all then score = tonumber(redis.call('ZRANGE', bucket, score, score, 'WITHSCORES')[2]) end
      return score_ref(start_s, score)
    end)
    local read = taken + #dead_here
    if stepped == 0 and read * step == #batch then
      -- Every member read was taken, and they are ranks offset .. offset + read - 1 (the
      -- range starts at -inf): removing by rank spares copying each 1 KB member back out of
      -- Lua and searching the skip list for it.
      redis.call('ZREMRANGEBYRANK', bucket, offset, offset + read - 1)
    else
      if taken > 0 then redis.call('ZREM', bucket, unpack(removed)) end
      if #dead_here > 0 then redis.call('ZREM', bucket, unpack(dead_here)) end
      offset = offset + stepped
    end
    if #dead_here > 0 then
      redis.call('LPUSH', dead, unpack(dead_here))
      dead_n = dead_n + #dead_here
    end
    for _, dest in ipairs(order) do
      redis.call('LPUSH', dest, unpack(pushes[dest]))
      local n = per_dest[dest]
      moved = moved + n
      if redis.call('HINCRBY', counts, dest, -n) <= 0 then redis.call('HDEL', counts, dest) end
      redis.call('HINCRBY', meta, 'q:' .. dest, -n)
    end
  end
  if bucket_blocked then  -- count the due ones it did not read, as the pre-check does
    local unread = redis.call('ZCOUNT', bucket, '-inf', upper) - stepped_here
    if unread > 0 then
      local any_held = false
      for _, dest in ipairs(dests_here) do any_held = any_held or room[dest] == 0 end
      if any_held then held = held + unread else wrong = wrong + unread end
    end
  end
  if redis.call('EXISTS', bucket) == 0 then
    -- Emptied by moves, or gone (expired after its grace, or deleted by hand): in the
    -- second case its remaining counts are still in the meta hash; settle them.
    local fields = redis.call('HGETALL', meta)
    redis.call('DEL', meta)  -- deletes before HINCRBY: see drop_refs (_common.lua) on maxmemory
    redis.call('ZREM', index, start_s)
    for i = 1, #fields, 2 do
      local name, n = fields[i], tonumber(fields[i + 1])
      if string.sub(name, 1, 2) == 'q:' and n > 0 then
        local dest = string.sub(name, 3)
        expired = expired + n
        if redis.call('HINCRBY', counts, dest, -n) <= 0 then redis.call('HDEL', counts, dest) end
      end
    end
  end
  -- A started bucket whose members are all in the future does not end the scan: 0.1
  -- publishers with different bucket widths leave narrower buckets that start after a wider
  -- one yet hold earlier messages. With one width only the last started bucket can be so.
end

if moved > 0 then redis.call('HINCRBY', totals, 'moved', moved) end
if dead_n > 0 then redis.call('HINCRBY', totals, 'dead', dead_n) end
if expired > 0 then redis.call('HINCRBY', totals, 'expired', expired) end

-- The earliest due time still scheduled: the first bucket's head, or with mixed widths an
-- earlier head of a narrower bucket that starts before it (as in move.lua).
local function head_of(start_s)
  local head = redis.call('ZRANGE', ns .. 'bucket:' .. start_s, 0, 0, 'WITHSCORES')
  return head[2] and floor(tonumber(head[2]))
end
local next_due = -1
local first = redis.call('ZRANGE', index, 0, 0)[1]
if first then
  next_due = head_of(first) or tonumber(first)
  for _, start_s in ipairs(redis.call('ZRANGEBYSCORE', index, '(' .. first, next_due, 'LIMIT', 0, 16)) do
    local due = head_of(start_s)
    if due and due < next_due then next_due = due end
  end
end
local more = 0
if budget <= 0 then more = 1 end
local reply = {moved, next_due, now, now_us, dead_n, held, expired, wrong, more, 1}
finish_lateness(reply)
return reply
