--[[ spaces: the two spaces a message waits in, ordinary ('') and cold ('c', compressed), as
keys.py names their keys; kombu_delay/store/spaces.py says what can happen to a message in each.

space(ns, tag)
  The space ``tag`` ('' or 'c') of namespace ``ns``: {tag, cold (true for 'c'), index (its
  ZSET of bucket starts), meta(start_s), zset(start_s, dest), tasks(start_s)}: the keys of
  one of its buckets; ``tasks`` (the task-id list) is nil in the cold space, whose refs leave
  the id index one by one (thaw, take, purge) instead of with their drained bucket.

split_bucket(text)
  Splits a bucket as the callers name it ("<start>", or "c<start>" in the cold space) into
  its space tag and its start.

in_space(k, tag)
  Returns k for the space ``tag`` (for put, take and retire): a table whose ``space`` is
  space(k.ns, tag) and whose index is that space's, and which reads every other field from k
  (through a metatable: no copy, so k must not change while it is in use).

cold_task_id(member)
  The task id a cold member carries in the clear (kombu_delay/store/cold.py), for its
  id-index ref.
]]
local function space(ns, tag)
  -- One constructor: a table grown field by field is rehashed as it grows.
  return {
    tag = tag, cold = tag ~= '', index = ns .. tag .. 'index',
    meta = function(start_s) return ns .. tag .. 'm:' .. start_s end,
    zset = function(start_s, dest) return ns .. tag .. 'z:' .. start_s .. ':' .. dest end,
    tasks = function(start_s)
      if tag == '' then return ns .. 't:' .. start_s end
    end,
  }
end

local function split_bucket(text)
  return string.match(text, '^(c?)(%d+)$')
end

local function in_space(k, tag)
  local s = space(k.ns, tag)
  -- Reads fall through to k: cheaper than copying it field by field.
  return setmetatable({space = s, index = s.index}, {__index = k})
end

local function cold_task_id(member)
  return string.sub(member, 3, 2 + (string.byte(member, 2) or 0))
end
