--[[ head: the due time of a sorted set's first message, found without reading it into Lua.

head_due(zset, lo, hi)
  zset  ZSET of messages, each scored due + seq/2048 (put in _put.lua)
  lo    ms: no message of it is due before (its bucket's start)
  hi    ms: one is due by then (a time its due count reached, or its bucket's last ms)
  Returns the due time (ms) of its first member, or nil when it has none. ZRANGE 0 0 would
  bring the member into Lua, which hashes every byte of a string it makes: 135 ms of Redis
  for a message of 50 MB. The due time is found by ZCOUNT instead, halving [lo, hi]: about
  log2(hi - lo) O(log n) calls, 16 for a minute's bucket. Not free either: a ZCOUNT whose range
  holds the first member compares it with itself to rank it (80 ms in all for 50 MB, under a
  millisecond for messages of a few KB). A set that does not keep to [lo, hi] is searched
  before or after it (about 42 calls); one with scores outside 0 .. MAX_DUE_MS (written by
  hand) is read by ZRANGE, its due time kept within them.
]]
--- @const MAX_DUE_MS
local function due_before(zset, ms)
  return redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', ms))
end

-- The least ms in [lo, hi] by which a member is due: none is due before lo, one by hi.
local function search(zset, lo, hi)
  while lo < hi do
    local mid = lo + math.floor((hi - lo) / 2)
    if due_before(zset, mid + 1) > 0 then hi = mid else lo = mid + 1 end
  end
  return lo
end

local function head_due(zset, lo, hi)
  -- Outside [lo, hi] (a message thawed late goes into a bucket that began after its due time):
  -- looked for before lo, or after hi, the same way.
  if due_before(zset, lo) > 0 then
    lo, hi = 0, lo - 1
  elseif due_before(zset, hi + 1) == 0 then
    lo, hi = hi + 1, MAX_DUE_MS
  else
    return search(zset, lo, hi)
  end
  if lo > hi or due_before(zset, lo) > 0 or due_before(zset, hi + 1) == 0 then
    local head = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
    if #head == 0 then return nil end
    return math.min(math.max(math.floor(tonumber(head[2])), 0), MAX_DUE_MS)
  end
  return search(zset, lo, hi)
end
