--[[ refs: the id index <ns>ids (task id -> space-separated refs "start:offset:seq").

drop_refs(ids, task_ids, ref_of)
  ids       HASH  <ns>ids
  task_ids  the ids whose entries change (an id may appear more than once)
  ref_of    ref_of(i) returns the ref of task_ids[i]'s message that left its bucket (moved
            cancelled or replaced)
  Removes each exact ref, and a field with its last ref. Returns nothing. A field may hold
  refs of messages already moved (their bucket is not cleaned up yet), so a ref is always
  compared, never assumed.
  Bound: one HMGET, then HDEL and HSET in slices of 1000, whatever the number of ids.
  HDEL comes before HSET: under maxmemory Redis refuses a script whose first write may grow
  memory, and movers must keep moving then.

drop_start_refs(ids, task_ids, start_s)
  Removes every ref of bucket ``start_s`` from the id-index fields of ``task_ids`` (the
  bucket is drained: all of them are stale), and a field with no ref left. Bound: one HMGET,
  then HDEL and HSET in slices of 1000.

score_ref and without_ref: see _ref_text.lua.
]]
--- @include ref_text
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
