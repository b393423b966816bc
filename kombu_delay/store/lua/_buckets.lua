--[[ buckets: counting and retiring a bucket's messages.

uncount(counts, dest, n)
  Takes n off a destination's scheduled count; a count that reaches zero is deleted.

settle_gone(meta, name, counts, dest, n)
  A destination whose sorted set is gone while its meta field ``name`` counts n messages
  (expired after its grace, or deleted by hand): deletes the field (HDEL first: under
  maxmemory Redis refuses a script whose first write may grow memory, and movers must keep
  moving then) and takes n off its count.

drained_counts(meta)
  Returns true when the meta hash counts no message (or is gone), and the bucket's end.

retire(k, start_s, end_ms, now)
  A bucket whose meta counts all reached zero leaves the index for <ns>gc (scored by its end),
  where the mover drops its id-index refs once nothing more can be scheduled into it. Its
  meta hash stays until then: its seq counter keeps the refs of the bucket unique. A cold
  bucket (k.space.cold) is deleted at once: its refs left the id index with its messages.

take(k, start_s, dest, payload, task_id, ref, now)
  Removes one stored message (cancel.lua, reschedule.lua; k from in_space): ZREM first, so a
  message a mover moved a moment ago is left alone (returns false, nothing written); else
  uncounts it, drops its ref from the id index, drops the copy of a herd staged ahead that
  it belonged to (_staged.lua), retires the bucket if that was its last message, returns
  true.
]]
--- @include clock
--- @include refs
--- @include spaces
--- @include staged
local function uncount(counts, dest, n)
  if redis.call('HINCRBY', counts, dest, -n) <= 0 then redis.call('HDEL', counts, dest) end
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
      end_ms = tonumber(fields[i + 1])
    elseif string.sub(name, 1, 2) == 'q:' then
      left = left + math.max(0, tonumber(fields[i + 1]))
    end
  end
  return left == 0, end_ms
end

local function retire(k, start_s, end_ms, now)
  redis.call('ZREM', k.index, start_s)
  if k.space.cold then  -- a cold bucket: no ref of it is left, nothing to clean up
    redis.call('DEL', k.space:meta(start_s))
    return
  end
  local at = end_ms or tonumber(start_s)
  redis.call('ZADD', k.gc, at, start_s)
  keep_until(k.gc, now, math.max(now, at) + 86400000)
end

local function take(k, start_s, dest, payload, task_id, ref, now)
  local zset, meta = k.space:zset(start_s, dest), k.space:meta(start_s)
  -- A member of a herd staged ahead: its copy is wrong from now on, and goes at once.
  local t = not k.space.cold and staged_mark(meta, dest)
  local score = t and redis.call('ZSCORE', zset, payload)
  if redis.call('ZREM', zset, payload) == 0 then return false end
  if score and math.floor(tonumber(score)) == t then drop_staged(k.space, meta, start_s, dest) end
  redis.call('HINCRBY', meta, 'q:' .. dest, -1)
  uncount(k.counts, dest, 1)
  drop_refs(k.ids, {task_id}, function() return ref end)
  local empty, end_ms = drained_counts(meta)
  if empty then retire(k, start_s, end_ms, now) end
  return true
end
