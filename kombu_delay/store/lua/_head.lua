--[[ head: the due time of a sorted set's first message, found without reading the message.

head_due(zset, lo, hi)
  zset  ZSET of messages, each scored due + seq/2048 (put in _put.lua)
  lo    ms: no message of it is due before (its bucket's start)
  hi    ms: one is due by then (a time its due count reached, or its bucket's last ms)
  Returns the due time (ms) of its first member, or nil when it has none. Its member may be a
  message of hundreds of MB: ZRANGE 0 0 would bring it into Lua (which hashes every byte) or
  onto the wire, for its score. The due time is found by ZCOUNT instead, halving [lo, hi]:
  about log2(hi - lo) O(log n) calls, 16 for a minute's bucket. A set that does not keep to
  [lo, hi] (scores written by hand) is read by ZRANGE, as before.
]]
local function due_before(zset, ms)
  return redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', ms))
end

local function head_due(zset, lo, hi)
  if lo > hi or due_before(zset, lo) > 0 or due_before(zset, hi + 1) == 0 then
    local head = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
    if #head == 0 then return nil end
    return math.floor(tonumber(head[2]))
  end
  while lo < hi do  -- none is due before lo, one is due by hi
    local mid = lo + math.floor((hi - lo) / 2)
    if due_before(zset, mid + 1) > 0 then hi = mid else lo = mid + 1 end
  end
  return lo
end
