--[[ buckets: counting and retiring a bucket's messages.

uncount(counts, dest, n, keep_lists)
  Takes n off a destination's scheduled count; a count that reaches zero is deleted, and so
  is one HINCRBY refuses (written by hand), rather than fail a script after it wrote. With
  it goes dest's entry in <ns>lists (note_lists in _put.lua: named beside ``counts``, which
  every caller names <ns>counts), unless ``keep_lists``: a move or a reschedule renews the
  lists it names after its take, and deletes the entry itself then, if the count is still
  zero (a cancel, purge or expiry of a queue's last message left it for the life of the hash,
  which every publish of such a queue renews: one entry for every such queue that ever was).

count_of(text)
  A meta field's count as a whole number, or nil where it is not one (written by hand: the
  scripts then count nothing for it, and recount, below, counts the set again). Only the
  text Redis's HINCRBY accepts is a count: no spaces, signs other than a leading '-', leading
  zeros, hexadecimal or exponents, which Lua's tonumber would read.

uncount_meta(meta, name, n)
  Takes n off a bucket's meta count ``name``. A count that would fall below zero, or that is
  not a whole number, is set to zero instead: a bucket whose sets held members its counts
  missed (added by hand, or under a meta hash made anew) must not be left counting less than
  nothing, or the next publish into it would take its set for one already indexed, and
  neither index it nor set its expiry. recount (retire) counts whatever is left.

mend_counters(meta, names)
  Deletes those of the meta fields ``names`` (counters and times: seq, end, x, q:<dest>) that
  hold text HINCRBY or a comparison would fail on (written by hand), before a script writes
  anything it could not take back (thaw.lua): a field deleted starts again from nothing, and
  recount counts the sets again. Returns how many it deleted. Bound: one HMGET, and an HDEL
  only where one is damaged.

settle_gone(meta, name, counts, dest, n)
  A destination whose sorted set is gone while its meta field ``name`` counts n messages
  (expired after its grace, or deleted by hand): deletes the field (HDEL first: under
  maxmemory Redis refuses a script whose first write may grow memory, and movers must keep
  moving then) and takes n off its count.

drained_counts(meta)
  Returns true when the meta hash counts no message (or is gone), the bucket's end, and how
  many messages it counts.

retire(k, start_s, end_ms, now)
  A bucket whose meta counts all reached zero leaves the index for <ns>gc (scored by its end),
  where the mover drops its id-index refs once nothing more can be scheduled into it. Its
  meta hash stays until then: its seq counter keeps the refs of the bucket unique. A cold
  bucket (k.space.cold) is deleted at once: its refs left the id index with its messages.
  First its sorted sets are counted (recount): when they still hold members that its counts
  missed, it stays, counted again, and retire returns how many it found (else 0).

let_go_unreadable(k, start_s)
  A bucket whose meta hash was replaced by a key of another type (by hand): nothing of it can be
  counted or moved. It leaves its space's index, counted (totals field unreadable); what its
  sorted sets hold, for any destination ``counts`` counts, is taken off those counts and
  returned, for the caller to count as expired (lost to delivery). Its keys are left as they
  are: the sorted sets expire after their grace. Bound: one ZCARD per destination counted.

renamed_aside(k, start_s, now)
  Renames a bucket's meta hash (of another type, written by hand) to <ns>aside:<start>:<now>;
  returns the new name, or nil where RENAME is refused (an ACL line without it).

set_aside(k, start_s, now)
  A bucket whose meta hash was replaced by a key of another type (by hand), in the ordinary
  space: that key is renamed out of the way, to <ns>aside:<start>:<now> (kept for whoever
  wrote it; no script reads it), and the bucket counted again from its sorted sets, as one
  whose meta hash is gone (recount), so its messages move on time. Returns the new name and
  how many it counted; where RENAME is refused (an ACL line without it), nil and what
  let_go_unreadable took off the counts (lost to delivery). Bound: recount's.

recount(k, start_s, now)
  Counts the members of a bucket whose counts read zero, in the sorted sets of the
  destinations its meta hash names and of every destination counted in <ns>counts (a meta
  hash evicted, or deleted and made anew by a later publish, names only some, or none).
  Members its counts missed are counted again in its meta hash (made anew where it is gone,
  with an end, an expiry and a seq) and in the totals field ``recounted``, so movers move
  them. <ns>counts is left as it is: where the meta hash was lost, it still counts them; a
  member added by hand, which it never counted, leaves it one short until that member is
  moved (a count that would fall below zero is deleted). Returns how many. Bound: one EXISTS
  per 1000 destinations; one ZCARD per destination, and more, only where members are found.

put_back(s, start_s, now)
  Puts the bucket ``start_s`` of space ``s`` back into its index where it counts messages and
  is not there (its index evicted, or deleted by hand), or is there at a score other than its
  start (changed by hand): reindex.lua's work for one bucket, which the walk of the id index
  does too (forget.lua) for the buckets its refs name, so that a user who may not SCAN has
  them put back as well. A meta hash of another type (by hand) is left alone. Returns 1 and
  the messages it counts where it put it back, else 0, 0. Bound: one ZSCORE, and for one not
  in its index a TYPE, an HGETALL, and an HGET and a ZADD where it counts messages.

take(k, start_s, dest, payload, task_id, ref, now, mark)
  Removes one stored message (cancel.lua, reschedule.lua; k from in_space): ZREM first, so a
  message a mover moved a moment ago is left alone (returns false, nothing written); else
  uncounts it (k.keep_lists: see uncount), drops its ref from the id index, drops the copy of
  a herd staged ahead that it belonged to (_staged.lua) and the bucket's wake mark
  (wake_if_first in _put.lua), retires the bucket if that was its last message, notes it as
  taken (``mark``, see note_taken), returns true.

note_taken(ns, mark)
  Notes a message an edit took in <ns>taken, by ``mark`` (its caller's digest of the message's
  destination and bytes, keys.py taken_mark; '' or nil: none), for TAKEN_KEEP_MS by Redis's
  clock: kombu's retry of a publish whose reply was lost, made after the edit, finds it there
  and stores nothing more (it would bring back what was cancelled, or deliver a rescheduled
  message twice; kombu_delay/resend.py). A hint: a refusal (a key of another type, by hand) is
  passed over. Bound: a ZADD, a ZREMRANGEBYSCORE of the notes past their time, a PEXPIREAT.

past_maxmemory(hash)
  A write that changes nothing (HDEL of the field '' of ``hash``, a hash or no key; an error
  is ignored), made first by a script whose writes are bookkeeping that must not wait for
  memory (thaw_scan, sweep, a thaw of what is due): Redis refuses a script a command that may
  grow memory over maxmemory only as its first write, so every write after this one goes on.

wrong_types(expected[, changed])
  expected  a list of {key, type} (type as TYPE names it: 'hash', 'zset', 'list')
  changed   what the error says was changed (default: nothing)
  An error reply naming the first key that holds another type (set by hand), or the ACL's
  refusal of TYPE (naming TYPE), else nil. For the scripts that take a message out (cancel,
  reschedule, purge, move) to return before their first write: Redis keeps a script's writes
  before a command that fails, so a failure after the take would report an error for a
  message cancelled, lose one rescheduled, or leave one moved uncounted.
  Bound: one TYPE per key.
]]
--- @include clock
--- @include refs
--- @include spaces
--- @include staged
--- @const TAKEN_KEEP_MS
local function uncount(counts, dest, n, keep_lists)
  local left = redis.pcall('HINCRBY', counts, dest, -n)
  if type(left) ~= 'number' or left <= 0 then
    redis.call('HDEL', counts, dest)
    if not keep_lists and string.sub(counts, -6) == 'counts' then  -- a hint: a refusal passes
      redis.pcall('HDEL', string.sub(counts, 1, -7) .. 'lists', dest)
    end
  end
end

-- A meta field's count: its whole number, or nil where it is not one (written by hand).
local function count_of(text)
  if type(text) ~= 'string' or not (text == '0' or string.find(text, '^%-?[1-9]%d*$')) then return nil end
  local n = tonumber(text)
  if math.abs(n) < 2 ^ 53 then return n end
end

local function uncount_meta(meta, name, n)
  local left = redis.pcall('HINCRBY', meta, name, -n)
  if type(left) ~= 'number' or left < 0 then redis.call('HSET', meta, name, '0') end
end

local function mend_counters(meta, names)
  local values, damaged = redis.call('HMGET', meta, unpack(names)), {}
  for i, name in ipairs(names) do
    if values[i] and not count_of(values[i]) then damaged[#damaged + 1] = name end
  end
  if #damaged > 0 then redis.call('HDEL', meta, unpack(damaged)) end
  return #damaged
end

local function settle_gone(meta, name, counts, dest, n)
  redis.call('HDEL', meta, name)
  uncount(counts, dest, n)
end

local function drained_counts(meta)
  local fields = redis.call('HGETALL', meta)
  local end_ms, left = nil, 0
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'end' then
      end_ms = ms_of(fields[i + 1])
    elseif string.sub(name, 1, 2) == 'q:' then
      left = left + math.max(0, count_of(fields[i + 1]) or 0)
    end
  end
  return left == 0, end_ms, left
end

local DAY_MS = 86400000

local function put_back(s, start_s, now)
  local score = redis.call('ZSCORE', s.index, start_s)
  local misplaced = score ~= false and tonumber(score) ~= tonumber(start_s)
  if score ~= false and not misplaced then return 0, 0 end
  local meta = s:meta(start_s)
  if redis.call('TYPE', meta)['ok'] ~= 'hash' then return 0, 0 end
  local empty, _, n = drained_counts(meta)
  if empty and not misplaced then return 0, 0 end
  -- The index outlives the bucket's meta hash, as a publish keeps it (set_expiries).
  local x = count_of(redis.call('HGET', meta, 'x') or '')
  redis.call('ZADD', s.index, tonumber(start_s), start_s)
  keep_until(s.index, now, math.max(now, x or 0) + 8 * DAY_MS)
  return 1, n
end

-- The dests whose sorted set of this bucket may hold members: those its meta hash names and
-- every counted one (a meta hash evicted, or deleted and made anew by a later publish, names
-- only some of them, or none), each once.
local function bucket_dests(meta, counts)
  local dests, seen = {}, {}
  for _, name in ipairs(redis.call('HKEYS', meta)) do
    if string.sub(name, 1, 2) == 'q:' then
      local dest = string.sub(name, 3)
      seen[dest] = true
      dests[#dests + 1] = dest
    end
  end
  for _, dest in ipairs(redis.call('HKEYS', counts)) do
    if not seen[dest] then dests[#dests + 1] = dest end
  end
  return dests
end

-- How many of ``keys`` exist: one EXISTS per slice of 1000 (unpack's limit).
local function existing(keys)
  local n = 0
  for first = 1, #keys, 1000 do
    n = n + redis.call('EXISTS', unpack(keys, first, math.min(#keys, first + 999)))
  end
  return n
end

local function recount(k, start_s, now)
  local s, counts = k.space, k.ns .. 'counts'
  local meta = s:meta(start_s)
  local dests = bucket_dests(meta, counts)
  local zsets = {}
  for i, dest in ipairs(dests) do zsets[i] = s:zset(start_s, dest) end
  if existing(zsets) == 0 then return 0 end  -- the path of every drained bucket: one call
  local start = tonumber(start_s)
  local found, last, fields = 0, start, {}
  for i, dest in ipairs(dests) do
    local n = redis.pcall('ZCARD', zsets[i])  -- (a key of another type: none)
    if not other_type(n, 'ZCARD', zsets[i]) and n > 0 then
      found = found + n
      fields[#fields + 1] = 'q:' .. dest
      fields[#fields + 1] = n
      local tail = tonumber(redis.call('ZRANGE', zsets[i], -1, -1, 'WITHSCORES')[2]) or start
      if tail ~= tail or tail == math.huge or tail == -math.huge then tail = start end  -- by hand
      if tail > last then last = tail end
    end
  end
  if found == 0 then return 0 end
  -- A meta hash made anew: its end is at least its last member's due time, its expiry a
  -- grace of seven days from now, its seq past the members' count.
  local x = math.max(now, start) + 7 * DAY_MS
  redis.call('HSETNX', meta, 'end', math.max(start + 60000, math.floor(last) + 1))
  redis.call('HSETNX', meta, 'x', x)
  redis.call('HSETNX', meta, 'seq', found)
  redis.call('HDEL', meta, 'ls', 'le')  -- members found: read again (known_earliest in _earliest.lua)
  redis.call('HSET', meta, unpack(fields))
  keep_until(meta, now, (ms_of(redis.call('HGET', meta, 'x')) or x) + DAY_MS)
  count_up(k.ns .. 'totals', 'recounted', found)
  if redis.call('ZSCORE', s.index, start_s) == false then redis.call('ZADD', s.index, start, start_s) end
  return found
end

local function let_go_unreadable(k, start_s)
  local counts, lost = k.ns .. 'counts', 0
  redis.call('ZREM', k.index, start_s)
  redis.pcall('ZREM', k.space:large(), start_s)  -- a hint (note_large in _put.lua)
  for _, dest in ipairs(redis.call('HKEYS', counts)) do
    local zset = k.space:zset(start_s, dest)
    local n = redis.pcall('ZCARD', zset)
    if not other_type(n, 'ZCARD', zset) and n > 0 then
      uncount(counts, dest, n)
      lost = lost + n
    end
  end
  count_up(k.ns .. 'totals', 'unreadable', 1)
  return lost
end

local function renamed_aside(k, start_s, now)
  local aside = k.ns .. 'aside:' .. start_s .. ':' .. string.format('%d', now)
  local renamed = redis.pcall('RENAME', k.space:meta(start_s), aside)
  if type(renamed) == 'table' and renamed.err then return nil end
  return aside
end

local function set_aside(k, start_s, now)
  local aside = renamed_aside(k, start_s, now)
  if not aside then return nil, let_go_unreadable(k, start_s) end
  return aside, recount(k, start_s, now)
end

local function retire(k, start_s, end_ms, now)
  local found = recount(k, start_s, now)
  if found > 0 then return found end
  redis.call('ZREM', k.index, start_s)
  redis.pcall('ZREM', k.space:large(), start_s)  -- a hint (note_large in _put.lua)
  if k.space.cold then  -- a cold bucket: no ref of it is left, nothing to clean up
    redis.call('DEL', k.space:meta(start_s))
    return 0
  end
  -- A member that names no bucket (by hand: 'abc', 'inf', '1.5', or digits past any due
  -- time, which no expiry takes): nothing to clean up.
  if not string.find(start_s, '^%d+$') or #start_s > 15 then return 0 end
  local at = end_ms or tonumber(start_s)
  redis.call('ZADD', k.gc, at, start_s)
  keep_until(k.gc, now, math.max(now, at) + 86400000)
  return 0
end

local function note_taken(ns, mark)
  if not mark or mark == '' then return end
  local key, at = ns .. 'taken', clock('')
  if type(redis.pcall('ZADD', key, at, mark)) == 'number' then
    redis.pcall('ZREMRANGEBYSCORE', key, '-inf', '(' .. string.format('%d', at - TAKEN_KEEP_MS))
    redis.pcall('PEXPIREAT', key, at + TAKEN_KEEP_MS)
  end
end

local function take(k, start_s, dest, payload, task_id, ref, now, mark)
  local zset, meta = k.space:zset(start_s, dest), k.space:meta(start_s)
  -- A member of a herd staged ahead: its copy is wrong from now on, and goes at once.
  local t = not k.space.cold and staged_mark(meta, dest)
  local score = t and redis.call('ZSCORE', zset, payload)
  if redis.call('ZREM', zset, payload) == 0 then return false end
  if score and math.floor(tonumber(score)) == t then drop_staged(k.space, meta, start_s, dest) end
  redis.call('HDEL', meta, 'w')  -- it may have been the wake mark (wake_if_first in _put.lua)
  uncount_meta(meta, 'q:' .. dest, 1)
  uncount(k.counts, dest, 1, k.keep_lists)
  drop_refs(k.ids, {task_id}, function() return ref end)
  local empty, end_ms = drained_counts(meta)
  if empty then retire(k, start_s, end_ms, now) end
  note_taken(k.ns, mark)
  return true
end

local function past_maxmemory(hash)
  redis.pcall('HDEL', hash, '')
end

local function wrong_types(expected, changed)
  for _, want in ipairs(expected) do
    local reply = redis.pcall('TYPE', want[1])
    if reply.err then  -- an ACL that refuses TYPE: named, as a refusal, not a key's fault
      local told = changed or 'nothing was changed'
      return redis.error_reply(reply.err .. ' (TYPE ' .. want[1] .. '; ' .. told .. ')')
    end
    local found = reply['ok']
    if found ~= 'none' and found ~= want[2] then
      return redis.error_reply('WRONGTYPE ' .. want[1] .. ' holds a ' .. found .. ', not a ' .. want[2]
        .. ' (written by hand?): ' .. (changed or 'nothing was changed'))
    end
  end
end
