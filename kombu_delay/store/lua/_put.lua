--[[ put: storing messages in their time bucket.

put(k, now, due, task_id, dest, payload, estimated, keep)
  Stores one message due in the future (schedule.lua and reschedule.lua; put_group in
  _put_group.lua stores several, sharing the per-bucket work).
  ``k`` holds the shared keys and settings: ns, index, ids, counts, totals, width, grace,
  wake (the channel) and wake_tag ('@' and the database's number), and optionally expires
  (the queue's x-expires, ms), kept as the meta field ``e:<dest>``, with siblings (the JSON
  array of the queue's other list keys) and lists (<ns>lists, where they are kept: see
  note_lists), counter (the totals field counting the messages stored) and format (the
  storage format, recorded in totals with a bucket's first message); ``k`` comes from
  in_space (or is built as in_space builds it): in the cold space (its refs start with 'c')
  the bucket has no task-id list, and a wake makes movers look for something to thaw.
  Writes the payload into <ns>z:<start>:<dest> (score due + seq/2048, seq from the bucket's
  meta hash), counts it in the meta hash and in counts, appends the task id to <ns>t:<start>,
  adds the ref "start:offset:seq" to the id index, puts the bucket in the index when it was
  not there (its first message, or the first since it drained), sets expiries, and wakes the
  movers when this message may be the earliest scheduled; drops the copy of a herd staged
  ahead that the message would make wrong (_staged.lua). The format, the expiries and the
  index are written per bucket, not per message, and of the meta hash only the expiry ``x``
  and the ``end`` (an earlier one is raised; with one width and grace, it never is), the
  herd's mark and the wake mark ``w`` are read, in one command.
  Returns 1 when stored, 2 when this exact payload is already stored for this destination
  in this bucket (nothing written but a step of the bucket's seq counter); after a 1, true
  when the wake-up PUBLISH was refused (the message is stored all the same, see
  wake_if_first), else nothing.
  keep: true where a refusal after the message is stored must leave it stored (a reschedule,
  which has taken the old message already), else it is taken back first (taken_back).
  estimated: ``now`` is a publisher's estimate of the Redis clock (schedule.lua): the
  expiries, where they are set, are set by Redis's own, and a message the estimate took for
  one due ahead that is due already gets its keys' expiry extended by its lateness, as the
  thaw does for an overdue one, so they outlive the move that pushes it.
  Bound: a constant number of O(log n) commands.

]]
--- @include clock
--- @include spaces
--- @include staged
-- A count as a command argument: Redis turns a Lua number into text with "%.17g", costly
-- next to the text '1' that almost every call passes.
local function count_arg(n)
  if n == 1 then return '1' end
  return n
end

-- Adds the ref of one message added to the id index (put_group's add_refs, several). Written
-- before the expiries, which need the ids hash to exist.
local function add_ref(k, start, start_s, task_id, due, seq)
  local ref = k.space.tag .. start_s .. string.format(':%d:%d', due - start, seq)
  if redis.call('HSETNX', k.ids, task_id, ref) == 0 then  -- a retry reuses its task id
    redis.call('HSET', k.ids, task_id, redis.call('HGET', k.ids, task_id) .. ' ' .. ref)
  end
end

-- A dead system must not grow Redis forever: the messages expire after the grace, the
-- bucket's meta hash and task-id list a day later (so a mover can still settle the counts),
-- the shared keys (totals too, with its storage format) never before the last meta hash.
-- Publishers with different bucket widths (or graces) may share a start: the meta hash
-- keeps the latest end and expiry any of them asked for (`end`, `x`), and a later one
-- extends the bucket's keys, so its message outlives a narrower one's expiry. Each expiry
-- is set only when it can change something: for a new key, or a later expiry. The shared
-- keys (index, ids, counts, totals) likewise only for a later expiry, a set that was
-- empty (its bucket may have drained, and the index with it), or when this destination's
-- global count was zero (they may have emptied and vanished, taking their expiry with them).
-- b: the bucket and this call's counts (start, start_s, meta, zset, tasks, dest, n_seq, n_added,
-- n_here: the set's count after, n_tasks: the task-id list's length after, dest_new, late: ms
-- added to the grace);
-- known_x, known_end: the meta hash's fields x and end, as the caller read them (ms_of: nil when
-- none, or no time). The end is raised whether or not the expiry is: a wider publisher
-- with a shorter grace leaves x as it was, and its message must still lie before the end
-- (the wake-up judges the earliest message by the first bucket's end, a thaw a cold
-- bucket's width by it).
local function set_expiries(k, now, b, known_x, known_end)
  local end_ms, expire_at = b.start + k.width, b.start + k.width + k.grace + b.late
  local extended = not known_x or expire_at > known_x
  local new_set = b.n_here == b.n_added
  if not known_end or end_ms > known_end then redis.call('HSET', b.meta, 'end', end_ms) end
  if extended then
    redis.call('HSET', b.meta, 'x', expire_at)
    redis.call('PEXPIREAT', b.meta, expire_at + 86400000)
    if b.tasks then redis.call('PEXPIREAT', b.tasks, expire_at + 86400000) end
    redis.call('PEXPIREAT', b.zset, expire_at)
    if b.n_seq > b.n_msgs then  -- other destinations' sets of this bucket, made before this call
      local fields = redis.call('HGETALL', b.meta)
      for i = 1, #fields, 2 do
        local name = fields[i]
        if string.sub(name, 1, 2) == 'q:' and name ~= 'q:' .. b.dest then
          -- Another queue's set, which a user whose key patterns name queues may not touch:
          -- refused, it keeps the expiry its own publishes gave it, and this publish, whose
          -- message is written already, goes on (a failed call would be retried: stored twice).
          redis.pcall('PEXPIREAT', k.space:zset(b.start_s, string.sub(name, 3)), expire_at)
        end
      end
    end
  else
    if new_set then redis.call('PEXPIREAT', b.zset, known_x) end
    if b.tasks and b.n_tasks == b.n_added then redis.call('PEXPIREAT', b.tasks, known_x + 86400000) end
  end
  local meta_expire_at = math.max(expire_at, known_x or 0) + 86400000
  if new_set then
    redis.call('ZADD', k.index, b.start, b.start_s)  -- new, or back from <ns>gc
  end
  if extended or b.dest_new or new_set then
    keep_until(k.index, now, meta_expire_at)
    keep_until(k.ids, now, meta_expire_at)
    keep_until(k.counts, now, meta_expire_at)
    keep_until(k.totals, now, meta_expire_at)
  end
end

-- True when set_expiries would write nothing, so a caller may skip it and the table it takes:
-- the bucket's expiry known_x and end known_end are as late as this publisher's, and this
-- call made neither the set (n_here: its count after the n_added messages), the task-id list
-- (n_tasks: its length after, 0 without one) nor the destination's count (dest_new).
local function expiries_settled(k, start, known_x, known_end, n_here, n_added, n_tasks, dest_new)
  return known_x and start + k.width + k.grace <= known_x and known_end and start + k.width <= known_end
    and n_here ~= n_added and n_tasks ~= n_added and not dest_new
end

-- A bucket whose set for one destination reaches LARGE_RUN messages, or that has taken
-- LARGE_BUCKET publishes for all its destinations together (its seq counter: a herd spread
-- over many queues), is noted in its space's <ns>[c]large (member and score: its start), for
-- the movers' plans: a large bucket must begin its thaw, or its herd's copy, early, and a plan
-- reads the first buckets of the index and then these, so that no number of small buckets
-- before it hides it (thaw_plan.py). Only the message that reaches a size writes (crossed:
-- n_after, a count after the n_added just stored); the key is kept, as the index is, as long
-- as the bucket's meta hash (expire_at, ms). retire and let_go_unreadable (_buckets.lua) take
-- the bucket out again. A hint, as the wake is: a refusal (a key of another type, written by
-- hand) is passed over, and the plans then see the bucket once it is among the first of the
-- index.
local LARGE_RUN, LARGE_BUCKET = 1000, 10000

local function crossed(n_after, n_added, size)
  return n_after >= size and n_after - n_added < size
end

local function note_large(k, now, start, start_s, expire_at)
  local large = k.space:large()
  if type(redis.pcall('ZADD', large, start, start_s)) == 'number' then
    pcall(keep_until, large, now, expire_at)
  end
end

-- A queue declared with x-expires: its other lists (k.siblings, the JSON array of their keys,
-- which its publisher gives), whose expiry a push renews with its own, as kombu's publish
-- renews every list of the queue (renew_lists in _push.lua), are kept in <ns>lists under
-- dest: a property of the queue, not of a bucket (whose meta hash a 1.0.0 mover reads as
-- numbers). Written with the first message of dest's set in a bucket, or one that finds it
-- missing, and kept as long as that bucket's meta hash (expire_at, ms) at least. A hint, as
-- the wake is: a refusal (a key of another type, by hand) is passed over, and the push then
-- renews its own list only.
local function note_lists(k, now, dest, expire_at)
  if type(redis.pcall('HSET', k.lists, dest, k.siblings)) == 'number' then
    pcall(keep_until, k.lists, now, expire_at)
  end
end

-- Wakes the movers only when a message may now be the earliest one of its space. A bucket's
-- wake mark (its meta field w) is the due time of a message stored in it and still ahead, so
-- waited for: a message due no earlier cannot be the earliest, and wakes no one; the path of
-- almost every publish, with no command of its own (put reads the mark with the expiry). A
-- message due before the mark, or with no mark or one already passed (its message is due,
-- moved or about to be), becomes the mark, and wakes the movers where it is in the first
-- bucket or due before the first bucket's end (with publishers of different bucket widths, a
-- later-starting narrow bucket can hold the earliest message). Whatever takes a message out of
-- a bucket (take, purge, thaw; a move, once the mark is due by its clock) deletes the mark, so
-- the next message stored there is judged afresh, whatever the publisher's clock says. In the
-- cold space the wake makes a mover look for something to thaw now: one that looks rarely (a
-- longer delay_thaw_ahead than this publisher's) would otherwise thaw it late. ``mark``: the
-- field w as put read it (ms_of: a number, or nil).
-- The wake is an optimisation, made after every write: a PUBLISH the ACL refuses (a user
-- without the channel) must not fail a call whose message is stored, which a retry would
-- store twice. So it is a pcall; a refusal is counted (totals field wake_refused) and returns
-- true, for the caller to tell; movers then find the message on their next poll.
-- The channel is shared by every database of the server (pub/sub ignores the database): the
-- wake-up's text, the due time, ends with the database's number ('@3'), and a mover lets one
-- of another database be (kombu_delay/mover/wake.py). One of a 1.0.0 publisher has none, and
-- wakes every mover, as it did then.
local function wake_if_first(k, start_s, meta, due, mark, now)
  if mark and mark <= due and mark > now then return end
  local due_s = string.format('%d', due)
  redis.call('HSET', meta, 'w', due_s)
  local head = redis.call('ZRANGE', k.index, 0, 0)[1]
  -- An end that is no number, or the first bucket's meta hash replaced by another type (both
  -- written by hand), is none: the message is stored, and a publish that failed now would be
  -- sent again by kombu's retry, and stored twice.
  local head_end = head and head ~= start_s and redis.pcall('HGET', k.space:meta(head), 'end')
  if type(head_end) ~= 'string' then head_end = nil end
  if head == start_s or (head and due < (ms_of(head_end) or 0)) then
    local reply = redis.pcall('PUBLISH', k.wake, due_s .. (k.wake_tag or ''))
    if type(reply) == 'table' and reply.err then
      count_up(k.totals, 'wake_refused', '1')
      return true
    end
  end
end

-- Counts the n messages just added to a bucket's set for ``dest`` (the meta hash, the
-- destination's count unless k.counted, the lifetime counter k.counter), notes the queue's
-- x-expires, and appends their task ids (one id, or a table of them) to the bucket's task-id
-- list ``tasks`` (nil in the cold space: its refs leave the id index one by one, thaw and
-- take). ``q``: the meta field of dest's count, where the caller has it ('q:' .. dest).
-- Returns the set's count after, whether the destination's count was zero before, and the
-- task-id list's length after (0 without one). ``done`` (put's): which counts it made, noted
-- as they are made.
local function count_added(k, meta, dest, tasks, n, task_ids, q, done)
  local n_arg = count_arg(n)
  local n_here = count_up(meta, q or 'q:' .. dest, n_arg, k.strict)
  if done then done.meta = true end
  if k.expires and k.expires > 0 then redis.call('HSET', meta, 'e:' .. dest, k.expires) end
  local dest_new = not k.counted and count_up(k.counts, dest, n_arg, k.strict) == n
  if done then done.counts = not k.counted end
  if k.counter then count_up(k.totals, k.counter, n_arg, k.strict) end
  if done then done.counter = k.counter end
  if not tasks then return n_here, dest_new, 0 end
  if type(task_ids) == 'table' then return n_here, dest_new, redis.call('RPUSH', tasks, unpack(task_ids)) end
  return n_here, dest_new, redis.call('RPUSH', tasks, task_ids)
end

-- Marks the bucket of a message due at ``due`` as holding one with no ETA of its own (an
-- x-delay): a worker runs it on arrival, so a mover's look-ahead must not move it before its
-- due time (move.lua reads the meta field n). Written after put, on the meta hash put made
-- with its expiry.
local function mark_no_eta(k, due)
  redis.call('HSET', k.space:meta(string.format('%d', due - due % k.width)), 'n', '1')
end

-- The names put writes for a message of ``dest`` due in the bucket starting at ``start`` in
-- k's space: {start_s (the start as text), meta, zset, tasks (nil in the cold space), q (the
-- meta field counting dest's messages), h (that of a herd of dest staged ahead)}. Kept, as
-- ms_of keeps its times, where a script's helpers outlive a call (a function: only the
-- publish, whose k is kept too), at most 256 of them: the publishes into a bucket name the
-- same keys, and making the names anew was a good part of a publish's Redis CPU.
local put_names_memo, put_names_count = false, 0

local function put_names(k, start, dest)
  local memo = put_names_memo
  local of_k = memo and memo[k]
  local of_start = of_k and of_k[start]
  local names = of_start and of_start[dest]
  if names then return names end
  local start_s = string.format('%d', start)
  names = {start_s = start_s, meta = k.space:meta(start_s), zset = k.space:zset(start_s, dest),
           tasks = k.space:tasks(start_s), q = 'q:' .. dest, h = 'h:' .. dest}
  if memo then
    if put_names_count >= 256 then
      memo, put_names_count = {}, 0
      put_names_memo = memo
    end
    of_k = memo[k] or {}
    memo[k] = of_k
    of_start = of_k[start] or {}
    of_k[start] = of_start
    of_start[dest], put_names_count = names, put_names_count + 1
  end
  return names
end

-- A bucket's seq counter that a store finds new, n_seq being what it added (the bucket's
-- first store, or a counter deleted, or written anew over text HINCRBY refuses, by hand or by
-- thaw.lua's mend_counters): the earliest due time a move noted with the counter's old value
-- (le, ls: known_earliest in _earliest.lua) goes, or the counter counting up again to ls would
-- pass it off as the earliest of what the bucket holds now.
local function counter_new(meta, n_seq, n_added)
  if n_seq == n_added then redis.call('HDEL', meta, 'ls', 'le') end
end

-- A bucket whose earliest due time a move noted (le, with the seq counter then, ls): a store
-- that finds the note true of the counter before it (ls, le: the fields as it read them) keeps
-- it true of the counter after, with the earlier of le and ``first``, its earliest due time, so
-- that publishing into a started bucket does not have the next move call read every queue
-- again (10,000 queues in a bucket of an hour, one publish a second: 113 ms of Redis a second).
-- One that finds it untrue (a store of an earlier version came in between) leaves it.
local function keep_noted(meta, n_seq, n_added, first, ls, le)
  local noted = ms_of(le)
  if not (noted and ls == string.format('%d', n_seq - n_added)) then return end
  if first < noted then
    redis.call('HSET', meta, 'ls', string.format('%d', n_seq), 'le', string.format('%d', first))
  else
    redis.call('HSET', meta, 'ls', string.format('%d', n_seq))
  end
end

-- put_group's steps (_put_group.lua) for one message, without its tables: the path of every
-- publish. Of the per-bucket work, only the read of the expiry is left on it: set_expiries
-- runs only where it can change something (expiries_settled).
-- What put does once the message is in its set: counts it, indexes it, sets the expiries
-- and wakes the movers; ``done`` notes the counts made (count_added), for taken_back.
local function put_counted(k, now, due, task_id, dest, estimated, start, names, n_seq, seq, done)
  local start_s, meta, zset = names.start_s, names.meta, names.zset
  if k.format and n_seq == 1 then redis.call('HSETNX', k.totals, 'format', k.format) end
  local tasks = names.tasks
  local n_here, dest_new, n_tasks = count_added(k, meta, dest, tasks, 1, task_id, names.q, done)
  add_ref(k, start, start_s, task_id, due, seq)
  -- The expiry, the mark of a herd staged ahead (_staged.lua), which this message would make
  -- wrong if it is due at the herd's millisecond, the wake mark (wake_if_first) and the end.
  local known = redis.call('HMGET', meta, 'x', names.h, 'w', 'end', 'ls', 'le')
  local known_x, known_end = ms_of(known[1]), ms_of(known[4])
  if known[5] then keep_noted(meta, n_seq, 1, due, known[5], known[6]) end
  if known[2] then drop_staged_for(k.space, meta, start_s, dest, due, mark_of(known[2])) end
  if not expiries_settled(k, start, known_x, known_end, n_here, 1, n_tasks, dest_new) then
    local late = 0
    if estimated then
      now = clock('')
      late = math.max(0, now - due)
    end
    set_expiries(k, now, {start = start, start_s = start_s, dest = dest, n_msgs = 1, meta = meta,
                          zset = zset, tasks = tasks, n_tasks = n_tasks, dest_new = dest_new,
                          n_seq = n_seq, n_added = 1, n_here = n_here, late = late}, known_x, known_end)
  end
  -- The queue's entry in <ns>lists: with its first message in the bucket, or where it is missing
  -- (a publisher that does not know the queue's x-expires was first here, and its last message's
  -- move may have deleted the entry: the other lists would go unrenewed, and expire).
  local large = n_here == LARGE_RUN or n_seq == LARGE_BUCKET
  -- (HGET: the publisher's ACL line grants it, not HEXISTS; false where the entry is missing)
  local lists = k.siblings and (n_here == 1 or redis.pcall('HGET', k.lists, dest) == false)
  if large or lists then  -- hints, kept a day past the bucket's meta hash
    local expire_at = math.max(known_x or 0, start + k.width + k.grace) + 86400000
    if large then note_large(k, now, start, start_s, expire_at) end
    if lists then note_lists(k, now, dest, expire_at) end
  end
  return 1, wake_if_first(k, start_s, meta, due, ms_of(known[3]), now)
end

-- A command put_counted runs refused (a shared key, ids, counts, totals or the index, of
-- another type, written by hand): Redis keeps what the call wrote before it. So the message
-- is taken back out of its set, with the counts made for it, before the error goes on: a
-- publish that fails has stored nothing, which kombu's retry would otherwise store again,
-- twice, where neither find nor cancel sees it. (What is left, a step of the seq, a task id
-- in the bucket's list or a ref in the id index, names no message: the clean-up drops it.)
local function taken_back(k, names, dest, payload, done)
  redis.pcall('ZREM', names.zset, payload)
  if done.meta then redis.pcall('HINCRBY', names.meta, names.q, -1) end
  if done.counts then
    local left = redis.pcall('HINCRBY', k.counts, dest, -1)
    if left == 0 then redis.pcall('HDEL', k.counts, dest) end
  end
  if done.counter then redis.pcall('HINCRBY', k.totals, done.counter, -1) end
end

-- What a refused call wrote and keeps (a step of the bucket's seq, a task id in its list, a ref
-- in the id index, the totals) expires with the bucket, as far as the ACL lets: where the
-- refusal came before the bucket's expiries were set (its first message, on Redis 6, which
-- cannot be asked beforehand), they had none, and stayed for ever. Only keys of their own
-- type (one of another, written by hand, an operator is told to set aside, and keeps), and by
-- Redis's clock (a publisher's estimate ``now`` may be behind it; taken where TIME is refused).
-- Then raises ``err`` again.
local function refused_after(k, names, start, now, err)
  local at = start + k.width + k.grace + 86400000
  local ok, redis_now = pcall(clock, '')
  if ok then now = redis_now end
  local kinds = {[names.meta] = 'hash', [k.ids] = 'hash', [k.totals] = 'hash'}
  if names.tasks then kinds[names.tasks] = 'list' end
  for key, kind in pairs(kinds) do
    local found = redis.pcall('TYPE', key)
    if type(found) == 'table' and found.ok == kind then pcall(keep_until, key, now, at) end
  end
  if type(err) == 'table' and not redis.acl_check_cmd then error(err.err) end  -- Redis 6: strings
  error(err)
end

local function put(k, now, due, task_id, dest, payload, estimated, keep)
  local start = due - due % k.width
  local names = put_names(k, start, dest)
  local n_seq = count_up(names.meta, 'seq', '1', k.strict)
  counter_new(names.meta, n_seq, 1)
  local seq = (n_seq - 1) % 2048
  local added = redis.pcall('ZADD', names.zset, 'NX', due + seq / 2048, payload)
  if type(added) == 'table' then refused_after(k, names, start, now, added) end
  if added == 0 then return 2 end
  if keep then return put_counted(k, now, due, task_id, dest, estimated, start, names, n_seq, seq, {}) end
  local done = {}
  local ok, stored, refused = pcall(put_counted, k, now, due, task_id, dest, estimated, start, names, n_seq, seq, done)
  if ok then return stored, refused end
  taken_back(k, names, dest, payload, done)
  refused_after(k, names, start, now, stored)
end
