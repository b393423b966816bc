--[[ put: storing messages in their time bucket.

put(k, now, due, task_id, dest, payload)
  Stores one message due in the future (schedule.lua and reschedule.lua; see put_group).
  ``k`` holds the shared keys and settings: ns, index, ids, counts, totals, width, grace,
  wake, and optionally expires (the queue's x-expires, ms), kept as the meta field
  ``e:<dest>``; ``k`` comes from in_space: in the cold space (its refs start with 'c') the
  bucket has no task-id list, and a wake makes movers look for something to thaw.
  Writes the payload into <ns>z:<start>:<dest> (score due + seq/2048, seq from the bucket's
  meta hash), counts it in the meta hash and in counts, appends the task id to <ns>t:<start>,
  adds the ref "start:offset:seq" to the id index, puts the bucket in the index when it was
  not there (its first message, or the first since it drained), sets expiries, and wakes the
  movers when this message may be the earliest scheduled.
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
--- @include refs
--- @include spaces
local function put_group(k, now, start, dest, msgs)
  local s = k.space
  local sp = s.tag
  local start_s = string.format('%d', start)
  local meta = s.meta(start_s)
  local zset = s.zset(start_s, dest)
  local n_seq = redis.call('HINCRBY', meta, 'seq', #msgs)
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
  if #added == 0 then return codes end
  local n_here = redis.call('HINCRBY', meta, 'q:' .. dest, #added)
  if k.expires and k.expires > 0 then redis.call('HSET', meta, 'e:' .. dest, k.expires) end
  local dest_new = false
  if not k.counted then
    dest_new = redis.call('HINCRBY', k.counts, dest, #added) == #added
  end
  if k.counter then redis.call('HINCRBY', k.totals, k.counter, #added) end
  -- A cold bucket has no task-id list: its refs leave the id index one by one (thaw, take).
  local tasks, n_tasks = s.tasks(start_s), 0
  if tasks then
    local task_ids = {}
    for i, m in ipairs(added) do task_ids[i] = m.task_id end
    n_tasks = redis.call('RPUSH', tasks, unpack(task_ids))
  end
  -- Written before the expiry below, which needs the ids hash to exist. A message that
  -- already has a ref (m.old_ref: thawed out of the cold space) gets it replaced.
  for _, m in ipairs(added) do
    local ref = sp .. start_s .. ':' .. string.format('%d', m.due - start) .. ':' .. m.seq
    if m.old_ref then
      local refs = redis.call('HGET', k.ids, m.task_id)
      local kept = refs and without_ref(refs, m.old_ref)
      redis.call('HSET', k.ids, m.task_id, kept and (kept .. ' ' .. ref) or ref)
    elseif redis.call('HSETNX', k.ids, m.task_id, ref) == 0 then  -- a retry reuses its task id
      redis.call('HSET', k.ids, m.task_id, redis.call('HGET', k.ids, m.task_id) .. ' ' .. ref)
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
  local end_ms, expire_at = start + k.width, start + k.width + k.grace
  local known = redis.call('HMGET', meta, 'end', 'x')
  local known_x = tonumber(known[2])
  local extended = not known_x or expire_at > known_x
  if extended then
    if not known[1] or end_ms > tonumber(known[1]) then redis.call('HSET', meta, 'end', end_ms) end
    redis.call('HSET', meta, 'x', expire_at)
    redis.call('PEXPIREAT', meta, expire_at + 86400000)
    if tasks then redis.call('PEXPIREAT', tasks, expire_at + 86400000) end
    redis.call('PEXPIREAT', zset, expire_at)
    if n_seq > #msgs then  -- other destinations' sets of this bucket, made before this call
      local fields = redis.call('HGETALL', meta)
      for i = 1, #fields, 2 do
        local name = fields[i]
        if string.sub(name, 1, 2) == 'q:' and name ~= 'q:' .. dest then
          redis.call('PEXPIREAT', s.zset(start_s, string.sub(name, 3)), expire_at)
        end
      end
    end
  else
    if n_here == #added then redis.call('PEXPIREAT', zset, known_x) end
    if tasks and n_tasks == #added then redis.call('PEXPIREAT', tasks, known_x + 86400000) end
  end
  local meta_expire_at = math.max(expire_at, known_x or 0) + 86400000
  if n_here == #added then
    redis.call('ZADD', k.index, start, start_s)  -- new, or back from <ns>gc
  end
  if extended or dest_new or n_here == #added then
    keep_until(k.index, now, meta_expire_at)
    keep_until(k.ids, now, meta_expire_at)
    keep_until(k.counts, now, meta_expire_at)
  end
  -- Wake the movers only when a message may now be the earliest one of its space: first in
  -- its sorted set, and in the first bucket or due before the first bucket's end (with
  -- publishers of different bucket widths, a later-starting narrow bucket can hold the
  -- earliest message). Cheap, and false for almost every publish. In the cold space the
  -- wake makes a mover look for something to thaw now: one that looks rarely (a longer
  -- delay_thaw_ahead than this publisher's) would otherwise thaw it late.
  if redis.call('ZRANK', zset, first.payload) == 0 then
    local head = redis.call('ZRANGE', k.index, 0, 0)[1]
    if head == start_s or (head and first.due < tonumber(redis.call('HGET', s.meta(head), 'end') or 0)) then
      redis.call('PUBLISH', k.wake, string.format('%d', first.due))
    end
  end
  return codes
end

local function put(k, now, due, task_id, dest, payload)
  return put_group(k, now, due - due % k.width, dest, {{due = due, task_id = task_id, payload = payload}})[1]
end
