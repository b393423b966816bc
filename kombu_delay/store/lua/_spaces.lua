--[[ spaces: the two spaces a message waits in, ordinary and cold (compressed); keys.py names
their keys, kombu_delay/store/spaces.py says what can happen to a message in each.

split_bucket(text)
  Splits a bucket as the callers name it ("<start>", or "c<start>" in the cold space) into
  its space ('' or 'c') and its start.

in_space(k, sp)
  Returns k for the space sp: unchanged for '', else a copy whose sp is 'c' and whose index
  is <ns>cindex (for put, take and retire).

cold_task_id(member)
  The task id a cold member carries in the clear (kombu_delay/store/cold.py), for its
  id-index ref.
]]
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
