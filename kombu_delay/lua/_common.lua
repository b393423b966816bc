--[[ _common: helpers that kombu_delay/scripts.py puts in front of every script (not a script).

drop_refs(ids, task_ids, ref_of)
  ids       HASH  <ns>ids   task id -> space-separated refs "start:offset:seq"
  task_ids  the ids whose entries change (an id may appear more than once)
  ref_of    ref_of(i) returns the ref of task_ids[i]'s envelope that left its bucket (moved,
            purged or replaced)
  Removes each ref, and a field with its last ref. Returns nothing.
  Every stored envelope has its ref, so a field holding a single ref holds the leaving
  envelope's: it is deleted without building the ref. ref_of is called only for the ids
  published more than once (a retry reuses its task id): a move then formats no refs at all.
  Bound: one HMGET, then at most one HDEL and one HSET, whatever the number of ids: a move
  of a thousand envelopes costs three commands here, not two thousand.
  HDEL comes before HSET: under maxmemory Redis refuses a script whose first write may grow
  memory, and movers must keep moving then.

score_ref(start_s, score)
  The id-index ref "start:offset:seq" of the envelope at ``score`` in bucket ``start_s``
  (``score = due + seq/2048``, see keys.py), as schedule.lua wrote it.

keep_until(key, now, at)
  key  a kombu-delay hash shared by all buckets (ids, counts)
  now  the Redis clock, epoch ms;  at  epoch ms
  Makes the key live at least until ``at``: sets the expiry when it has none or an earlier one,
  never shortens it. Bound: one PTTL and at most one PEXPIREAT.
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
    if refs then
      if string.find(refs, ' ', 1, true) then
        after[task_id] = without_ref(refs, ref_of(i))
      else
        after[task_id] = false
      end
    end
  end
  local changed, kept = {}, {}
  for _, task_id in ipairs(order) do
    if after[task_id] ~= before[task_id] then
      changed[#changed + 1] = task_id
      if after[task_id] then
        kept[#kept + 1] = task_id
        kept[#kept + 1] = after[task_id]
      end
    end
  end
  if #changed > 0 then redis.call('HDEL', ids, unpack(changed)) end
  if #kept > 0 then redis.call('HSET', ids, unpack(kept)) end
end

local function score_ref(start_s, score)
  local due = math.floor(score)
  return start_s .. ':' .. string.format('%d', due - tonumber(start_s)) .. ':'
    .. string.format('%d', (score - due) * 2048)
end

local function keep_until(key, now, at)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 or now + ttl < at then
    redis.call('PEXPIREAT', key, at)
  end
end

