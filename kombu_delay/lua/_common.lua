--[[ _common: helpers that kombu_delay/scripts.py puts in front of every script (not a script).

drop_ref(ids, task_id, ref)
  ids      HASH  <ns>ids   task id -> space-separated refs "start:offset:seq"
  task_id  the id whose entry changes
  ref      the ref of the envelope that left its bucket (moved, purged or replaced)
  Removes that ref, and the field with its last ref. Returns nothing.
  Bound: one HGET and at most one HDEL and one HSET.
  HDEL comes before HSET: under maxmemory Redis refuses a script whose first write may grow
  memory, and movers must keep moving then.

keep_until(key, now, at)
  key  a kombu-delay hash shared by all buckets (ids, counts)
  now  the Redis clock, epoch ms;  at  epoch ms
  Makes the key live at least until ``at``: sets the expiry when it has none or an earlier one,
  never shortens it. Bound: one PTTL and at most one PEXPIREAT.
]]
local function drop_ref(ids, task_id, ref)
  local refs = redis.call('HGET', ids, task_id)
  if not refs then return end
  if refs == ref then
    redis.call('HDEL', ids, task_id)
    return
  end
  local padded = ' ' .. refs .. ' '
  local s, e = string.find(padded, ' ' .. ref .. ' ', 1, true)
  if s then
    local rest = string.sub(padded, 1, s) .. string.sub(padded, e + 1)
    rest = string.gsub(string.gsub(rest, '^ +', ''), ' +$', '')
    redis.call('HDEL', ids, task_id)
    if rest ~= '' then redis.call('HSET', ids, task_id, rest) end
  end
end

local function keep_until(key, now, at)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 or now + ttl < at then
    redis.call('PEXPIREAT', key, at)
  end
end

