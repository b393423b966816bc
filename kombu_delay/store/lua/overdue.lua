--[[ overdue: per destination, the messages already due but not moved yet, and the oldest's due time.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
ARGV[1] ns           key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms       a member is due when floor(score) <= now_ms
ARGV[3] max_buckets  most started buckets examined
ARGV[4] space        "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
ARGV[5] max_reads    most ZCOUNT calls of this call (one or two a sorted set, a bucket's for each
                     destination it counts, and a search for its oldest), after the bucket that
                     reaches it: with many queues, and many buckets started during a mover
                     outage, one call for them all held Redis for seconds (absent: no limit)
ARGV[6] after        a cursor, the start of the last bucket looked at by the call before ('' or
                     absent to begin); the buckets after it are looked at
Returns: {truncated (1 if max_buckets cut the count), cursor, dest, overdue, oldest_due_ms, dest,
         ...} one triple per destination with at least one due member (see head_due on reading
         them); cursor: '' where the call looked at every started bucket left, else the
         ARGV[6] of the next call.
Bound: ARGV[3] buckets (only those started by now_ms: with a mover keeping up, one or two),
       and those whose reads reach ARGV[5] (and the one that passes it), each one HGETALL of its
       meta hash, then per destination one ZCOUNT and, where one is due, one more; where that
       one may be its oldest, the due time of its first member by about log2(now - start)
       ZCOUNT calls (head_due in _earliest.lua: the member itself, a message, is not read into
       Lua, but where its score was written by hand outside the span of due times). A bucket
       whose known earliest due time is ahead (known_earliest) costs one HMGET instead.
A bucket's meta hash or sorted set replaced by a key of another type (by hand) is passed over,
as stats passes it over (census.lua): a set holds nothing of it then, and a bucket's meta hash
names none of its sets until a mover sets it aside (move.lua) and counts the bucket again.
]]
--- @include spaces
--- @include earliest
local index = KEYS[1]
local ns = ARGV[1]
local now = tonumber(ARGV[2])
local max_buckets = tonumber(ARGV[3])
local s = space(ns, ARGV[4] or '')
local max_reads, after = tonumber(ARGV[5] or '') or math.huge, ARGV[6] or ''

local from = after == '' and '-inf' or '(' .. after
local starts = redis.call('ZRANGEBYSCORE', index, from, string.format('%d', now), 'LIMIT', 0, max_buckets + 1)
local truncated, cursor = 0, ''
if #starts > max_buckets then truncated = 1 end
local count, oldest, order = {}, {}, {}
for i = 1, math.min(#starts, max_buckets) do
  if zcount_reads >= max_reads then  -- the rest in the next call
    cursor = redis.call('ZSCORE', index, starts[i - 1])  -- (a member may be no number)
    break
  end
  local known = known_earliest(s:meta(starts[i]))
  local fields = known and known > now and {} or redis.pcall('HGETALL', s:meta(starts[i]))
  if fields.err then fields = {} end
  for j = 1, #fields, 2 do
    if string.sub(fields[j], 1, 2) == 'q:' and (tonumber(fields[j + 1]) or 0) > 0 then
      local dest = string.sub(fields[j], 3)
      local zset = s:zset(starts[i], dest)
      local ok, due = pcall(due_before, zset, now + 1)
      if ok and due > 0 then
        if not count[dest] then
          count[dest] = 0
          order[#order + 1] = dest
        end
        count[dest] = count[dest] + due
        -- Its head is searched for only where it may be older than the oldest found: a later
        -- bucket holds one where publishers of different widths made buckets that overlap.
        if not oldest[dest] or due_before(zset, oldest[dest]) > 0 then
          local first = head_due(zset, tonumber(starts[i]) or now, now)
          if not oldest[dest] or first < oldest[dest] then oldest[dest] = first end
        end
      end
    end
  end
end
local reply = {truncated, cursor}
for _, dest in ipairs(order) do
  reply[#reply + 1] = dest
  reply[#reply + 1] = count[dest]
  reply[#reply + 1] = string.format('%d', oldest[dest])
end
return reply
