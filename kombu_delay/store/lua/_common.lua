--[[ _common: helpers that kombu_delay/scripts.py puts in front of every script (not a script).

drop_refs(ids, task_ids, ref_of)
  ids       HASH  <ns>ids   task id -> space-separated refs "start:offset:seq"
  task_ids  the ids whose entries change (an id may appear more than once)
  ref_of    ref_of(i) returns the ref of task_ids[i]'s message that left its bucket (moved
            cancelled or replaced)
  Removes each exact ref, and a field with its last ref. Returns nothing. A field may hold
  refs of messages already moved (their bucket is not cleaned up yet) and of either layout,
  so a ref is always compared, never assumed.
  Bound: one HMGET, then HDEL and HSET in slices of 1000, whatever the number of ids.
  HDEL comes before HSET: under maxmemory Redis refuses a script whose first write may grow
  memory, and movers must keep moving then.

score_ref(start_s, score)
  The id-index ref "start:offset:seq" of the message at ``score`` in bucket ``start_s``
  (``score = due + seq/2048``, see keys.py), as schedule.lua wrote it.

clock(at)
  Returns the Redis clock as epoch ms and the microseconds past that ms (0..999); with ``at``
  (an ARGV, epoch ms; '' or nil = Redis TIME), that time instead, with 0 µs: tests drive time
  through it rather than wait for it.

keep_until(key, now, at)
  key  any kombu-delay key (ids, counts, gc, or a bucket's own keys)
  now  the Redis clock, epoch ms;  at  epoch ms
  Makes the key live at least until ``at``: sets the expiry when it has none or an earlier one,
  never shortens it. Bound: one PTTL and at most one PEXPIREAT.

put(k, now, due, task_id, dest, payload)
  Stores one message due in the future (schedule.lua and reschedule.lua; see put_group). ``k`` holds the
  shared keys and settings: ns, index, ids, counts, totals, width, grace, wake, and
  optionally expires (the queue's x-expires, ms), kept as the meta field ``e:<dest>``, and
  sp: 'c' for the cold space (keys.py: its keys and refs start with 'c', its bucket has no
  task-id list, and movers are woken only for a message in its first bucket, so they look
  for something to thaw), absent for the ordinary one.
  Writes the payload into <ns>z:<start>:<dest> (score due + seq/2048, seq from the bucket's
  meta hash), counts it in the meta hash and in counts, appends the task id to <ns>t:<start>,
  adds the ref "start:offset:seq" to the id index, puts the bucket in the index when it was
  not there (its first message, or the first since it drained), sets expiries, and wakes the
  movers when this message may be the earliest scheduled.
  Returns 1 when stored, 2 when this exact payload is already stored for this destination
  in this bucket (nothing written but a step of the bucket's seq counter). Bound: a constant number of O(log n) commands.

put_group(k, now, start, dest, msgs)
  put for several messages of one bucket (``start``, as put computes it from k.width) and
  one destination, sharing its per-bucket work (thaw.lua, whose messages may be overdue). msgs[i] = {due, task_id, payload,
  old_ref}: old_ref, when given, is the message's current ref in the id index, replaced by
  the new one. k.counted: the messages are counted already (in counts). Returns the code of
  each, as put. Bound: four commands per message, and put's per-bucket ones once.

retire(k, start_s, end_ms, now)
  A bucket whose meta counts all reached zero leaves the index for <ns>gc (scored by its end),
  where the mover drops its id-index refs once nothing more can be scheduled into it. Its
  meta hash stays until then: its seq counter keeps the refs of the bucket unique. A cold
  bucket (k.sp) is deleted at once: its refs left the id index with its messages.

drained_counts(meta)
  Returns true when the meta hash counts no message (or is gone), and the bucket's end.

take(k, start_s, dest, payload, task_id, ref, now)
  Removes one stored message (cancel.lua, reschedule.lua; k.sp as for put): ZREM first, so a message a mover
  moved a moment ago is left alone (returns false, nothing written); else uncounts it, drops
  its ref from the id index, retires the bucket if that was its last message, returns true.

cold_task_id(member)
  The task id a cold member carries in the clear (kombu_delay/cold.py), for its id-index ref.

split_bucket(text)
  Splits a bucket as the callers name it ("<start>", or "c<start>" in the cold space) into
  its space ('' or 'c') and its start.

in_space(k, sp)
  Returns k for the space sp: unchanged for '', else a copy whose sp is 'c' and whose index
  is <ns>cindex (for put, take and retire).

settle_gone(meta, name, counts, dest, n)
  A destination whose sorted set is gone while its meta field ``name`` counts n messages
  (expired after its grace, or deleted by hand): deletes the field (HDEL first: under
  maxmemory Redis refuses a script whose first write may grow memory, and movers must keep
  moving then) and takes n off its count.

uncount(counts, dest, n)
  Takes n off a destination's scheduled count; a count that reaches zero is deleted.

assert_may_push(dest)
  On Redis 7 and later, raises a NOPERM error when this user's ACL refuses LPUSH onto dest,
  naming it, before anything is read for dest. Redis 6 cannot tell beforehand; there the
  refusal comes from the push itself, which move.lua and reschedule.lua make before they
  take anything (a script's writes are not undone when it fails).

checked_call(command, key, ...)
  redis.call, except that a refusal (an ACL, maxmemory, a read-only replica) is raised naming
  the command and key, which Redis 6's ACL refusal does not, and saying that nothing was
  taken for that key. For the writes a script makes before it takes anything.

room_keeper(max_len)
  Returns room, room_of for one move call: room[dest] is how many more pushes the list
  ``dest`` takes in this call (math.huge without max_len, -1 when the key is not a list);
  room_of(dest) returns it, asking Redis (TYPE, and LLEN under max_len) the first time,
  after assert_may_push(dest).

lateness_runs()
  Returns add(late, n), which records n moves ``late`` ms after their due time, and
  finish(reply), which appends them to reply run-length coded: a run of n > 1 equal values
  is -n followed by the value, so a burst due at one instant costs two integers.

drop_start_refs(ids, task_ids, start_s)
  Removes every ref of bucket ``start_s`` from the id-index fields of ``task_ids`` (the
  bucket is drained: all of them are stale), and a field with no ref left. Bound: one HMGET,
  then HDEL and HSET in slices of 1000.
]]
local function without_ref(refs, ref)
  if refs == ref then return false end
  local padded = ' ' .. refs .. ' '
  local s, e = string.find(padded, ' ' .. ref .. ' ', 1, true)
  if not s then return refs end
  local rest = string.sub(padded, 1, s) .. string.sub(padded, e + 1)
  rest = string.gsub(string.gsub(rest, '^ +', ''), ' +$', '')
  if rest == '' then return false end
  return rest
end

-- Runs `command key` with the values of list in slices of at most `size` (even), in order:
-- unpack cannot pass more than about 8,000 values to one call.
local function call_sliced(command, key, list, size)
  for first = 1, #list, size do
    redis.call(command, key, unpack(list, first, math.min(#list, first + size - 1)))
  end
end

-- Deletes the fields `changed`, then writes back those whose new value after[id] is a string
-- (HDEL first: see drop_refs).
local function rewrite_refs(ids, changed, after)
  if #changed == 0 then return end
  local kept = {}
  for _, task_id in ipairs(changed) do
    if after[task_id] then
      kept[#kept + 1] = task_id
      kept[#kept + 1] = after[task_id]
    end
  end
  call_sliced('HDEL', ids, changed, 1000)
  call_sliced('HSET', ids, kept, 1000)
end

local function drop_refs(ids, task_ids, ref_of)
  if #task_ids == 0 then return end
  local stored = redis.call('HMGET', ids, unpack(task_ids))
  local before, after, order = {}, {}, {}
  for i, task_id in ipairs(task_ids) do
    if before[task_id] == nil then
      before[task_id] = stored[i]
      after[task_id] = stored[i]
      order[#order + 1] = task_id
    end
    local refs = after[task_id]
    if refs then after[task_id] = without_ref(refs, ref_of(i)) end
  end
  local changed = {}
  for _, task_id in ipairs(order) do
    if after[task_id] ~= before[task_id] then changed[#changed + 1] = task_id end
  end
  rewrite_refs(ids, changed, after)
end

local function score_ref(start_s, score)
  local due = math.floor(score)
  return start_s .. ':' .. string.format('%d', due - tonumber(start_s)) .. ':'
    .. string.format('%d', (score - due) * 2048)
end

local function clock(at)
  if at and at ~= '' then return math.floor(tonumber(at)), 0 end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(t[2]) % 1000
end

local function keep_until(key, now, at)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 or now + ttl < at then
    redis.call('PEXPIREAT', key, at)
  end
end


local function refs_without_start(refs, prefix)
  local kept = {}
  for ref in string.gmatch(refs, '%S+') do
    if string.sub(ref, 1, #prefix) ~= prefix then kept[#kept + 1] = ref end
  end
  if #kept == 0 then return false end
  return table.concat(kept, ' ')
end

local function drop_start_refs(ids, task_ids, start_s)
  if #task_ids == 0 then return end
  local prefix = start_s .. ':'
  local stored = redis.call('HMGET', ids, unpack(task_ids))
  local after, changed = {}, {}
  for i, task_id in ipairs(task_ids) do
    local refs = stored[i]
    if refs and after[task_id] == nil then
      local left
      if string.find(refs, ' ', 1, true) then left = refs_without_start(refs, prefix)
      elseif string.sub(refs, 1, #prefix) == prefix then left = false
      else left = refs end
      after[task_id] = left
      if left ~= refs then changed[#changed + 1] = task_id end
    end
  end
  rewrite_refs(ids, changed, after)
end

local function assert_may_push(dest)
  if redis.acl_check_cmd and not redis.acl_check_cmd('LPUSH', dest, 'x') then
    error({err = 'NOPERM this user may not LPUSH onto ' .. dest .. '; nothing was taken for it'})
  end
end

local function checked_call(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then
    local text = reply.err .. ' (' .. command .. ' ' .. key .. '; nothing was taken for it)'
    if redis.acl_check_cmd then error({err = text}) end  -- Redis 7+ keeps the error code
    error(text)  -- Redis 6 raises strings only
  end
  return reply
end

local function room_keeper(max_len)
  local room = {}
  local function room_of(dest)
    local left = room[dest]
    if left == nil then
      assert_may_push(dest)
      local kind = redis.call('TYPE', dest)['ok']
      if kind ~= 'list' and kind ~= 'none' then
        left = -1
      elseif max_len > 0 then
        left = math.max(0, max_len - redis.call('LLEN', dest))
      else
        left = math.huge
      end
      room[dest] = left
    end
    return left
  end
  return room, room_of
end

local function lateness_runs()
  local runs = {}
  local run_value, run_count = nil, 0
  local function end_run()
    if run_count == 1 then
      runs[#runs + 1] = run_value
    elseif run_count > 1 then
      runs[#runs + 1] = -run_count
      runs[#runs + 1] = run_value
    end
  end
  local function add(late, n)
    if late == run_value then run_count = run_count + n else
      end_run()
      run_value, run_count = late, n
    end
  end
  local function finish(reply)
    end_run()
    run_value, run_count = nil, 0
    for i = 1, #runs do reply[#reply + 1] = runs[i] end
  end
  return add, finish
end

local function drained_counts(meta)
  local fields = redis.call('HGETALL', meta)
  local end_ms, left = nil, 0
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'end' then
      end_ms = tonumber(fields[i + 1])
    elseif string.sub(name, 1, 2) == 'q:' then
      left = left + math.max(0, tonumber(fields[i + 1]))
    end
  end
  return left == 0, end_ms
end

local function retire(k, start_s, end_ms, now)
  redis.call('ZREM', k.index, start_s)
  if (k.sp or '') ~= '' then  -- a cold bucket: no ref of it is left, nothing to clean up
    redis.call('DEL', k.ns .. k.sp .. 'm:' .. start_s)
    return
  end
  local at = end_ms or tonumber(start_s)
  redis.call('ZADD', k.gc, at, start_s)
  keep_until(k.gc, now, math.max(now, at) + 86400000)
end

local function put_group(k, now, start, dest, msgs)
  local sp = k.sp or ''
  local start_s = string.format('%d', start)
  local meta = k.ns .. sp .. 'm:' .. start_s
  local zset = k.ns .. sp .. 'z:' .. start_s .. ':' .. dest
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
  local tasks, n_tasks = nil, 0
  if sp == '' then
    tasks = k.ns .. 't:' .. start_s
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
          redis.call('PEXPIREAT', k.ns .. sp .. 'z:' .. start_s .. ':' .. string.sub(name, 3), expire_at)
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
    if head == start_s or (head and first.due < tonumber(redis.call('HGET', k.ns .. sp .. 'm:' .. head, 'end') or 0)) then
      redis.call('PUBLISH', k.wake, string.format('%d', first.due))
    end
  end
  return codes
end

local function put(k, now, due, task_id, dest, payload)
  return put_group(k, now, due - due % k.width, dest, {{due = due, task_id = task_id, payload = payload}})[1]
end

local function cold_task_id(member)
  return string.sub(member, 3, 2 + (string.byte(member, 2) or 0))
end

local function split_bucket(text)
  return string.match(text, '^(c?)(%d+)$')
end

local function in_space(k, sp)
  if sp == '' then return k end
  local copy = {}
  for name, value in pairs(k) do copy[name] = value end
  copy.sp, copy.index = 'c', k.ns .. 'cindex'
  return copy
end

local function uncount(counts, dest, n)
  if redis.call('HINCRBY', counts, dest, -n) <= 0 then redis.call('HDEL', counts, dest) end
end

local function settle_gone(meta, name, counts, dest, n)
  redis.call('HDEL', meta, name)
  uncount(counts, dest, n)
end

local function take(k, start_s, dest, payload, task_id, ref, now)
  local sp = k.sp or ''
  if redis.call('ZREM', k.ns .. sp .. 'z:' .. start_s .. ':' .. dest, payload) == 0 then return false end
  local meta = k.ns .. sp .. 'm:' .. start_s
  redis.call('HINCRBY', meta, 'q:' .. dest, -1)
  uncount(k.counts, dest, 1)
  drop_refs(k.ids, {task_id}, function() return ref end)
  local empty, end_ms = drained_counts(meta)
  if empty then retire(k, start_s, end_ms, now) end
  return true
end
