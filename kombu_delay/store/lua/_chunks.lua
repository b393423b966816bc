--[[ chunks: reading many members or list items within a byte budget.

read_ranks(command, key, first, count, bytes, below, head)
  The items of ``key`` from rank (or index) ``first``, at most ``count`` of them, by
  ``command`` ('ZRANGE' for a sorted set, 'LRANGE' for a list); with ``below`` (a number, a
  sorted set's only), each member's score too, and only the members scored below it: the read
  ends at the first that is not. Returns the items, the bytes read (each item's length plus
  64, what it costs beside its bytes) and the scores (nil without ``below``). ``head``: the
  item at ``first`` as the caller read it already ({member, score}, its score below
  ``below``), taken as it is and not read again (a message of 50 MB, read twice, cost a move
  call about a second).
  A call that read ``count`` items at once could read a whole batch of large ones (a small
  first message ahead of 3 MB ones took 305 MB into one move), so the items are read in
  chunks: one item, then each chunk as many as were read before it, at most CHUNK, and no
  more than the bytes left hold at the size of the largest item read so far. No item is kept
  once ``bytes`` are reached (the first always is), so what a caller pushes or copies goes
  past ``bytes`` by at most one item; what is read goes past it by at most one chunk, CHUNK
  items larger than every one before them (the price of reading in chunks: a read of one
  item at a time would cost each message a command).
  Bound: about log2(CHUNK) + count / CHUNK reads, of about ``bytes`` in all.
]]
--- @const CALL_BYTES
local CHUNK = 16
local function read_ranks(command, key, first, count, bytes, below, head)
  local items, scores = {}, below and {} or nil
  local n, used, largest = 0, 0, 0
  if head then
    n, used, largest, items[1] = 1, #head[1] + 64, #head[1] + 64, head[1]
    if below then scores[1] = head[2] end
  end
  local step = below and 2 or 1
  while n < count and (n == 0 or used < bytes) do
    local chunk = math.min(count - n, math.max(1, n), CHUNK)
    if largest > 0 then chunk = math.min(chunk, math.max(1, math.floor((bytes - used) / largest))) end
    local from = first + n
    local got
    if below then
      got = redis.call(command, key, from, from + chunk - 1, 'WITHSCORES')
    else
      got = redis.call(command, key, from, from + chunk - 1)
    end
    for i = 1, #got, step do
      if (below and tonumber(got[i + 1]) >= below) or (n > 0 and used >= bytes) then
        return items, used, scores
      end
      n = n + 1
      items[n] = got[i]
      if below then scores[n] = got[i + 1] end
      local size = #got[i] + 64
      used = used + size
      if size > largest then largest = size end
    end
    if #got < chunk * step then break end
  end
  return items, used, scores
end
