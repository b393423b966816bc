--[[ earliest: a sorted set's first due time, and a bucket's, without reading a message.

due_before(zset, ms)
  The members of ``zset`` due before ``ms`` (floor(score) < ms): one ZCOUNT, counted in
  zcount_reads.

head_due(zset, lo, hi)
  The due time (ms) of the first member of ``zset``, none of which is due before ``lo`` and one
  of which is due by ``hi``; nil when it has none. ZRANGE 0 0 would bring the member into Lua,
  which hashes every byte of a string it makes: 135 ms of Redis for a message of 50 MB. The
  due time is found by ZCOUNT instead, halving [lo, hi]: about log2(hi - lo) O(log n) calls.
  Not free either: a ZCOUNT whose range holds the first member compares it with itself to
  rank it (80 ms in all for 50 MB, under a millisecond for messages of a few KB). A set that
  does not keep to [lo, hi] (a message thawed late goes into a bucket that began after its
  due time) is searched before or after it (about 42 calls); one with scores outside
  0 .. MAX_DUE_MS (written by hand) is read by ZRANGE, its due time kept within them.

known_earliest(meta)
  A bucket's earliest due time as a move call noted it in the bucket's meta hash (move.lua's
  earliest_in): le, the earliest due time of the messages the bucket held when a call read
  every queue of it, and ls, its seq counter then. Every message stored into a bucket steps
  that counter (put in _put.lua, put_group), whatever its publisher's version, and one taken
  out (moved, cancelled, purged, thawed) can only make the earliest later: so while the
  counter reads ls, nothing in the bucket is due before le, and a caller reads these fields,
  not one ZCOUNT and one HGETALL field per queue (10,000 queues in a started bucket of an
  hour held Redis for 71 ms a move call with nothing due). A drained bucket's meta hash goes
  with its fields. A note the bucket's other fields contradict is none: an le at or past the
  bucket's end (every message is due before it), or a wake mark w before le (the due time of
  a message stored, which a move that takes it deletes: one due before le, as a publisher of
  1.0.0, which keeps no note, stores where the counter was deleted by hand and counted up to
  ls again; a mark a mover of 1.0.0 left, the visit that reads the bucket then deletes).
  Returns le and the no-ETA mark n ('1' or false), or nil where they are not known (a meta
  hash of another type, written by hand, included).
]]
--- @include clock
--- @const MAX_DUE_MS
local zcount_reads = 0

local function due_before(zset, ms)
  zcount_reads = zcount_reads + 1
  return redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', ms))
end

-- The least ms in [lo, hi] by which a member is due: none is due before lo, one by hi.
local function search_due(zset, lo, hi)
  while lo < hi do
    local mid = lo + math.floor((hi - lo) / 2)
    if due_before(zset, mid + 1) > 0 then hi = mid else lo = mid + 1 end
  end
  return lo
end

local function head_due(zset, lo, hi)
  if due_before(zset, lo) > 0 then
    lo, hi = 0, lo - 1
  elseif due_before(zset, hi + 1) == 0 then
    lo, hi = hi + 1, MAX_DUE_MS
  else
    return search_due(zset, lo, hi)
  end
  if lo > hi or due_before(zset, lo) > 0 or due_before(zset, hi + 1) == 0 then
    local head = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
    if #head == 0 then return nil end
    return math.min(math.max(math.floor(tonumber(head[2])), 0), MAX_DUE_MS)
  end
  return search_due(zset, lo, hi)
end

local function known_earliest(meta)
  local f = redis.pcall('HMGET', meta, 'seq', 'ls', 'le', 'n', 'end', 'w')
  if f.err or not f[1] or f[1] ~= f[2] then return nil end
  local le, end_ms, mark = ms_of(f[3]), ms_of(f[5]), ms_of(f[6])
  if not le or (end_ms and le >= end_ms) or (mark and mark < le) then return nil end
  return le, f[4]
end
