--[[ put_group: storing several messages of one bucket and destination at once.

put_group(k, now, start, dest, msgs)
  put for several messages of one bucket (``start``, as put computes it from k.width) and
  one destination, sharing its per-bucket work (thaw.lua, whose messages may be overdue).
  msgs[i] = {due, task_id, payload, old_ref}: old_ref, when given, is the message's current
  ref in the id index, replaced by the new one. k.counted: the messages are counted already
  (in counts). Returns the code of each, as put, and true when the wake-up PUBLISH was
  refused (as put: the messages are stored all the same). Bound: one command per message
  (its ZADD), and put's per-bucket ones once, the id index's in two (one HMGET, one HSET) per
  slice of 1000 ids.
]]
--- @include put
--- @include refs
-- Adds each message to the bucket's set for its destination (ZADD NX: an identical payload
-- there already is a duplicate, code 2); returns the codes, the messages added, the earliest
-- of them, and the bucket's seq counter after this call.
local function add_members(meta, zset, msgs)
  local n_seq = count_up(meta, 'seq', count_arg(#msgs))
  counter_new(meta, n_seq, #msgs)
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

-- ``refs`` without those ``gone`` counts (ref -> how many times: a ref repeats where a bucket's
-- seq counter wrapped round at one millisecond), in one pass; false when nothing is left.
local function without_refs(refs, gone)
  local kept = {}
  for ref in string.gmatch(refs, '%S+') do
    if (gone[ref] or 0) > 0 then gone[ref] = gone[ref] - 1 else kept[#kept + 1] = ref end
  end
  return #kept > 0 and table.concat(kept, ' ')
end

-- add_ref for the messages added, in two commands per slice of 1000 ids whatever their number:
-- their ids' refs read in one HMGET, and written back with each new ref (in place of its
-- old_ref, when it has one) in one HSET. Each id's refs are rewritten once per call, however
-- many of its messages the call stores: once per message made a thaw of 10,000 messages under
-- one task id (all its refs in one field) take 15 s of Redis, 200 ms a call.
local function add_refs(k, start, start_s, added)
  local news, olds, order = {}, {}, {}
  for _, m in ipairs(added) do
    local id = m.task_id
    local ref = k.space.tag .. start_s .. string.format(':%d:%d', m.due - start, m.seq)
    if news[id] then
      news[id][#news[id] + 1] = ref
    else
      news[id], order[#order + 1] = {ref}, id
    end
    if m.old_ref then
      olds[id] = olds[id] or {}
      olds[id][#olds[id] + 1] = m.old_ref
    end
  end
  local fields = {}
  for first = 1, #order, 1000 do
    local last = math.min(#order, first + 999)
    local stored = redis.call('HMGET', k.ids, unpack(order, first, last))
    for i = first, last do
      local id, refs = order[i], stored[i - first + 1]
      local old = olds[id]
      if refs and old and #old == 1 then
        refs = without_ref(refs, old[1])
      elseif refs and old then
        local gone = {}
        for _, ref in ipairs(old) do gone[ref] = (gone[ref] or 0) + 1 end
        refs = without_refs(refs, gone)
      end
      local text = table.concat(news[id], ' ')
      fields[#fields + 1] = id
      fields[#fields + 1] = refs and (refs .. ' ' .. text) or text
    end
  end
  call_sliced('HSET', k.ids, fields, 1000)
end

local function put_group(k, now, start, dest, msgs)
  local start_s = string.format('%d', start)
  local b = {start = start, start_s = start_s, dest = dest, n_msgs = #msgs,
             meta = k.space:meta(start_s), zset = k.space:zset(start_s, dest),
             tasks = k.space:tasks(start_s), n_tasks = 0, dest_new = false,
             n_seq = 0, n_added = 0, n_here = 0, late = 0}  -- all here: a table grown later is rehashed
  local codes, added, first
  codes, added, first, b.n_seq = add_members(b.meta, b.zset, msgs)
  local t = first and staged_mark(b.meta, dest)
  if t then  -- a herd staged ahead that one of these messages would make wrong (_staged.lua)
    for _, m in ipairs(added) do
      if m.due == t then
        drop_staged(k.space, b.meta, start_s, dest)
        break
      end
    end
  end
  -- A new meta hash: the namespace's first bucket, or one more. Never over another format: a
  -- mover or an inspection reading it refuses it (heartbeat.lua).
  if k.format and b.n_seq == #msgs then redis.call('HSETNX', k.totals, 'format', k.format) end
  if #added == 0 then return codes end
  local task_ids = {}
  for i, m in ipairs(added) do task_ids[i] = m.task_id end
  b.n_added = #added
  b.n_here, b.dest_new, b.n_tasks = count_added(k, b.meta, dest, b.tasks, #added, task_ids)
  add_refs(k, start, start_s, added)
  local known = redis.call('HMGET', b.meta, 'x', 'w', 'end', 'ls', 'le')
  if known[4] then keep_noted(b.meta, b.n_seq, #msgs, first.due, known[4], known[5]) end
  set_expiries(k, now, b, ms_of(known[1]), ms_of(known[3]))
  if crossed(b.n_here, b.n_added, LARGE_RUN) or crossed(b.n_seq, #msgs, LARGE_BUCKET) then
    local expire_at = math.max(ms_of(known[1]) or 0, start + k.width + k.grace + b.late) + 86400000
    note_large(k, now, start, start_s, expire_at)
  end
  return codes, wake_if_first(k, start_s, b.meta, first.due, ms_of(known[2]), now)
end
