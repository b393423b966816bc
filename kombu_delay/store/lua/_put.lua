--[[ put: storing messages in their time bucket.

put(k, now, due, task_id, dest, payload)
  Stores one message due in the future (schedule.lua and reschedule.lua; see put_group).
  ``k`` holds the shared keys and settings: ns, index, ids, counts, totals, width, grace,
  wake, and optionally expires (the queue's x-expires, ms), kept as the meta field
  ``e:<dest>``, counter (the totals field counting the messages stored) and format (the
  storage format, recorded in totals with a bucket's first message); ``k`` comes from
  in_space (or is built as in_space builds it): in the cold space (its refs start with 'c')
  the bucket has no task-id list, and a wake makes movers look for something to thaw.
  Writes the payload into <ns>z:<start>:<dest> (score due + seq/2048, seq from the bucket's
  meta hash), counts it in the meta hash and in counts, appends the task id to <ns>t:<start>,
  adds the ref "start:offset:seq" to the id index, puts the bucket in the index when it was
  not there (its first message, or the first since it drained), sets expiries, and wakes the
  movers when this message may be the earliest scheduled. The format, the expiries and the
  index are written per bucket, not per message, and of the meta hash only the expiry ``x``
  is read (an earlier one is extended; with one width and grace, it never is).
  Returns 1 when stored, 2 when this exact payload is already stored for this destination
  in this bucket (nothing written but a step of the bucket's seq counter).
  Bound: a constant number of O(log n) commands.

put_group(k, now, start, dest, msgs)
  put for several messages of one bucket (``start``, as put computes it from k.width) and
  one destination, sharing its per-bucket work (thaw.lua, whose messages may be overdue).
  msgs[i] = {due, task_id, payload, old_ref}: old_ref, when given, is the message's current
  ref in the id index, replaced by the new one. k.counted: the messages are counted already
  (in counts). Returns the code of each, as put. Bound: four commands per message, and put's
  per-bucket ones once.
]]
--- @include clock
--- @include ref_text
--- @include spaces
-- A count as a command argument: Redis turns a Lua number into text with "%.17g", costly
-- next to the text '1' that almost every call passes.
local function count_arg(n)
  if n == 1 then return '1' end
  return n
end

-- Adds each message to the bucket's set for its destination (ZADD NX: an identical payload
-- there already is a duplicate, code 2); returns the codes, the messages added, the earliest
-- of them, and the bucket's seq counter after this call.
local function add_members(meta, zset, msgs)
  local n_seq = redis.call('HINCRBY', meta, 'seq', count_arg(#msgs))
  local codes, added, first = {}, {}, nil
  for i, m in ipairs(msgs) do
    m.seq = (n_seq - #msgs + i - 1) % 2048
    if redis.call('ZADD', zset, 'NX', m.due + m.seq / 2048, m.payload) == 0 then
      codes[i] = 2
    else
      codes[i] = 1
      added[#added + 1] = m
      if not first or m.due < first.due then first = m end
    end
  end
  return codes, added, first, n_seq
end

-- Adds the ref of each message added to the id index. Written before the expiries, which need
-- the ids hash to exist. A message that already has a ref (m.old_ref: thawed out of the cold
-- space) gets it replaced.
local function add_refs(k, start, start_s, added)
  for _, m in ipairs(added) do
    local ref = k.space.tag .. start_s .. string.format(':%d:%d', m.due - start, m.seq)
    if m.old_ref then
      local refs = redis.call('HGET', k.ids, m.task_id)
      local kept = refs and without_ref(refs, m.old_ref)
      redis.call('HSET', k.ids, m.task_id, kept and (kept .. ' ' .. ref) or ref)
    elseif redis.call('HSETNX', k.ids, m.task_id, ref) == 0 then  -- a retry reuses its task id
      redis.call('HSET', k.ids, m.task_id, redis.call('HGET', k.ids, m.task_id) .. ' ' .. ref)
    end
  end
end

-- A dead system must not grow Redis forever: the messages expire after the grace, the
-- bucket's meta hash and task-id list a day later (so a mover can still settle the counts),
-- the shared hashes never before the last meta hash. Publishers with different bucket
-- widths (or graces) may share a start: the meta hash keeps the latest end and expiry any
-- of them asked for (`end`, `x`), and a later one extends the bucket's keys, so its
-- message outlives a narrower one's expiry. Each expiry is set only when it can change
-- something: for a new key, or a later expiry. The shared keys (index, ids, counts)
-- likewise only for a later expiry, a set that was empty (its bucket may have drained,
-- and the index with it), or when this destination's global count was zero (they may
-- have emptied and vanished, taking their expiry with them).
-- b: the bucket and this call's counts (start, start_s, meta, zset, tasks, dest, n_seq, n_added,
-- n_here: the set's count after, n_tasks: the task-id list's length after, dest_new).
local function set_expiries(k, now, b)
  local end_ms, expire_at = b.start + k.width, b.start + k.width + k.grace
  local known_x = tonumber(redis.call('HGET', b.meta, 'x'))
  local extended = not known_x or expire_at > known_x
  local new_set = b.n_here == b.n_added
  if extended then
    local known_end = redis.call('HGET', b.meta, 'end')
    if not known_end or end_ms > tonumber(known_end) then redis.call('HSET', b.meta, 'end', end_ms) end
    redis.call('HSET', b.meta, 'x', expire_at)
    redis.call('PEXPIREAT', b.meta, expire_at + 86400000)
    if b.tasks then redis.call('PEXPIREAT', b.tasks, expire_at + 86400000) end
    redis.call('PEXPIREAT', b.zset, expire_at)
    if b.n_seq > b.n_msgs then  -- other destinations' sets of this bucket, made before this call
      local fields = redis.call('HGETALL', b.meta)
      for i = 1, #fields, 2 do
        local name = fields[i]
        if string.sub(name, 1, 2) == 'q:' and name ~= 'q:' .. b.dest then
          redis.call('PEXPIREAT', k.space.zset(b.start_s, string.sub(name, 3)), expire_at)
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
  end
end

-- Wakes the movers only when a message may now be the earliest one of its space: first in
-- its sorted set, and in the first bucket or due before the first bucket's end (with
-- publishers of different bucket widths, a later-starting narrow bucket can hold the
-- earliest message). Cheap, and false for almost every publish. In the cold space the
-- wake makes a mover look for something to thaw now: one that looks rarely (a longer
-- delay_thaw_ahead than this publisher's) would otherwise thaw it late.
local function wake_if_first(k, start_s, zset, first)
  if redis.call('ZRANK', zset, first.payload) ~= 0 then return end
  local head = redis.call('ZRANGE', k.index, 0, 0)[1]
  if head == start_s or (head and first.due < tonumber(redis.call('HGET', k.space.meta(head), 'end') or 0)) then
    redis.call('PUBLISH', k.wake, string.format('%d', first.due))
  end
end

local function put_group(k, now, start, dest, msgs)
  local start_s = string.format('%d', start)
  local b = {start = start, start_s = start_s, dest = dest, n_msgs = #msgs,
             meta = k.space.meta(start_s), zset = k.space.zset(start_s, dest),
             tasks = k.space.tasks(start_s), n_tasks = 0, dest_new = false,
             n_seq = 0, n_added = 0, n_here = 0}  -- all here: a table grown later is rehashed
  local codes, added, first
  codes, added, first, b.n_seq = add_members(b.meta, b.zset, msgs)
  -- A new meta hash: the namespace's first bucket, or one more. Never over another format: a
  -- mover or an inspection reading it refuses it (heartbeat.lua).
  if k.format and b.n_seq == #msgs then redis.call('HSETNX', k.totals, 'format', k.format) end
  if #added == 0 then return codes end
  b.n_added = #added
  local n_arg = count_arg(#added)
  b.n_here = redis.call('HINCRBY', b.meta, 'q:' .. dest, n_arg)
  if k.expires and k.expires > 0 then redis.call('HSET', b.meta, 'e:' .. dest, k.expires) end
  if not k.counted then
    b.dest_new = redis.call('HINCRBY', k.counts, dest, n_arg) == #added
  end
  if k.counter then redis.call('HINCRBY', k.totals, k.counter, n_arg) end
  -- A cold bucket has no task-id list: its refs leave the id index one by one (thaw, take).
  -- One task id goes as it is: a table to unpack costs more than the push.
  if b.tasks and #added == 1 then
    b.n_tasks = redis.call('RPUSH', b.tasks, added[1].task_id)
  elseif b.tasks then
    local task_ids = {}
    for i, m in ipairs(added) do task_ids[i] = m.task_id end
    b.n_tasks = redis.call('RPUSH', b.tasks, unpack(task_ids))
  end
  add_refs(k, start, start_s, added)
  set_expiries(k, now, b)
  wake_if_first(k, start_s, b.zset, first)
  return codes
end

local function put(k, now, due, task_id, dest, payload)
  return put_group(k, now, due - due % k.width, dest, {{due = due, task_id = task_id, payload = payload}})[1]
end
