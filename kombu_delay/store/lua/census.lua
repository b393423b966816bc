--[[ census: count what is scheduled, overdue and by due time, without reading any message.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
ARGV[1] ns           key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms       a member is due when floor(score) <= now_ms
ARGV[3] slot_ms      width of one histogram slot, ms; slot 0 starts at now_ms
ARGV[4] slots        number of slots
ARGV[5] max_buckets  most buckets examined by this call (from the cursor ARGV[8]); with dests,
                     by all the calls of one census together
ARGV[6] space        "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
ARGV[7] max_sets     most sorted sets (a bucket's, one per destination it counts) counted in this
                     call: without dests, after the bucket that reaches it; with them, in as many
                     buckets as hold that many of their sets at most (at least one). With many
                     queues a bucket counts many, and a call that counted them all held Redis
                     for seconds; with 16 destinations, a call over 10,000 buckets did too
ARGV[8] after        a cursor, the start of the last bucket counted by the call before ('' to
                     begin); the buckets after it are counted
ARGV[9..] dests      optional: the destinations to count (stats passes those <ns>counts
                     counts, when they are few); a destination left out is not counted.
                     Without them, every destination a meta hash counts is. With them, the
                     counts of all the window's buckets are read by one SORT_RO of the index
                     that GETs their meta fields (Redis 7; a fraction of what a call per
                     bucket costs); where SORT_RO is missing (Redis 6) or refused (by the
                     ACL, or by Redis to a user who may not read every key; a key prefix with
                     a '*' or a NUL byte, which its patterns would misread), one HMGET per
                     bucket. A meta key of another type (written by hand) counts nothing.
                     SORT_RO turns an index small enough for Redis's compact encoding into a
                     skip list (some KB more, at most, kept until it is deleted).
Returns: {truncated (1 if max_buckets cut the census), cursor, overdue, vanished, count_slot_0, ...}
         cursor: '' where the call counted every bucket left in the window, else the ARGV[8]
         of the next call (where ARGV[7] cut it).
         A bucket that started already adds its due members to overdue and the rest to
         slot 0; a later one adds its size to the slot its start falls in (the resolution
         is one bucket width). vanished: messages still counted whose sorted set is gone
         (expired or evicted; a mover's next move or sweep settles them), or of another
         type (written by hand), in no slot.
Bound: ARGV[5] buckets, and those whose sets reach ARGV[7] (without dests, and the one that
       passes it): one SORT_RO, or one HMGET or HGETALL of each meta hash (whose counts give
       the sizes); one EXISTS per 1000 sorted sets (one per set where some are gone); one
       ZCOUNT per destination of a bucket that has started (none where its noted earliest due
       time is ahead, known_earliest in _earliest.lua); members are never read.
]]
--- @include spaces
--- @include earliest
local index = KEYS[1]
local ns = ARGV[1]
local now = tonumber(ARGV[2])
local slot_ms, slots = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_buckets = tonumber(ARGV[5])
local s = space(ns, ARGV[6] or '')
local max_sets, after = tonumber(ARGV[7]), ARGV[8]
local upper = '(' .. string.format('%d', now + 1)
local horizon = '(' .. string.format('%d', now + slot_ms * slots)
local dests, fields = {}, {}
for i = 9, #ARGV do
  dests[#dests + 1] = ARGV[i]
  fields[#fields + 1] = 'q:' .. ARGV[i]
end

local reply = {0, '', 0, 0}
for i = 1, slots do reply[i + 4] = 0 end
local from = after == '' and '-inf' or '(' .. after
local in_window = redis.call('ZCOUNT', index, from, horizon)
-- With dests, a census's calls together examine max_buckets at most: those before this one
-- examined the window's buckets up to the cursor. (Those it left are counted by rank, first.)
local before = 0
if #dests > 0 and after ~= '' then before = redis.call('ZCOUNT', index, '-inf', after) end
if in_window > max_buckets - before then reply[1] = 1 end
local n_buckets = math.max(0, math.min(in_window, max_buckets - before))
if #dests > 0 and n_buckets > math.max(1, math.floor(max_sets / #dests)) then
  n_buckets = math.max(1, math.floor(max_sets / #dests))  -- the rest in the next call
  reply[1] = 0
  reply[2] = 'cut'  -- (the start of this call's last bucket, once it is known)
end

-- The window's buckets with their counts of the fields asked for, as one SORT_RO of the index
-- in its order (by start) returns them: each start followed by its counts. nil where it cannot.
local function counts_sorted()
  -- Redis reads a pattern's '*' up to the first NUL byte: a key prefix with either is left out.
  if #fields == 0 or n_buckets == 0 or not redis.acl_check_cmd or string.find(s.keys, '[%*%z]') then
    return nil
  end
  -- Asked first (redis.acl_check_cmd, Redis 7 as SORT_RO), so that no census adds to the ACL
  -- log or to the errors INFO counts: the command, and whether the user may read a key outside
  -- any namespace ('\0'), as SORT's GET wants a user who may read every key.
  if not redis.acl_check_cmd('SORT_RO', index) or not redis.acl_check_cmd('SORT_RO', '\0') then
    return nil
  end
  local args = {index, 'BY', 'nosort', 'LIMIT', before, n_buckets, 'GET', '#'}
  for _, field in ipairs(fields) do
    args[#args + 1] = 'GET'
    args[#args + 1] = s:meta('*') .. '->' .. field
  end
  local rows = redis.pcall('SORT_RO', unpack(args))
  if type(rows) ~= 'table' or rows.err or #rows ~= n_buckets * (#fields + 1) then return nil end
  return rows
end

-- First the counts, bucket by bucket: each destination's set, its size, its slot, and whether
-- its bucket has started.
-- A started bucket whose noted earliest due time is ahead (known_earliest) holds nothing due:
-- its sets cost no ZCOUNT. One HMGET per started bucket.
local sets, sizes, slot_of, started, quiet = {}, {}, {}, {}, {}
local function nothing_due(start_s)
  if quiet[start_s] == nil then
    local known = known_earliest(s:meta(start_s))
    quiet[start_s] = known ~= nil and known > now
  end
  return quiet[start_s]
end
local function add(start_s, start, dest, text)
  local size = tonumber(text)
  if size and size > 0 then
    local n, slot = #sets + 1, 0
    if start > now then slot = math.min(slots - 1, math.floor((start - now) / slot_ms)) end
    sets[n], sizes[n], slot_of[n] = s:zset(start_s, dest), size, slot
    started[n] = start <= now and not nothing_due(start_s)
  end
end
-- A bucket's counts of the destinations asked for: values[offset + j] for dests[j] (false
-- where it counts none), as SORT_RO and HMGET return them.
local function add_counts(start_s, values, offset)
  local start = tonumber(start_s)
  for j = 1, #dests do
    local text = values[offset + j]
    if text then add(start_s, start, dests[j], text) end
  end
end
local rows = counts_sorted()
if rows then
  for i = 1, #rows, #fields + 1 do add_counts(rows[i], rows, i) end
  if reply[2] == 'cut' then reply[2] = redis.call('ZSCORE', index, rows[#rows - #fields]) end
else
  local starts = redis.call('ZRANGEBYSCORE', index, from, horizon, 'LIMIT', 0, n_buckets)
  if reply[2] == 'cut' then reply[2] = redis.call('ZSCORE', index, starts[#starts]) end
  for n, start_s in ipairs(starts) do
    if #dests == 0 and #sets >= max_sets then  -- the rest in the next call
      if n > 1 then reply[2] = redis.call('ZSCORE', index, starts[n - 1]) end  -- (a member may be no number)
      break
    end
    local meta = s:meta(start_s)
    -- (A meta key of another type, written by hand, counts nothing, as SORT_RO's GET reads it.)
    if #dests > 0 then
      local counts = redis.pcall('HMGET', meta, unpack(fields))
      add_counts(start_s, counts.err and {} or counts, 0)
    else
      local all = redis.pcall('HGETALL', meta)
      if all.err then all = {} end
      local start = tonumber(start_s)
      for k = 1, #all, 2 do
        if string.sub(all[k], 1, 2) == 'q:' then add(start_s, start, string.sub(all[k], 3), all[k + 1]) end
      end
    end
  end
end

-- Then whether the sets are there: one EXISTS for a slice of them, and one for each of its
-- sets only when some of them are gone.
for first = 1, #sets, 1000 do
  local last = math.min(#sets, first + 999)
  local whole = redis.call('EXISTS', unpack(sets, first, last)) == last - first + 1
  for n = first, last do
    local size = sizes[n]
    local there = whole or redis.call('EXISTS', sets[n]) == 1
    local due = there and started[n] and redis.pcall('ZCOUNT', sets[n], '-inf', upper)
    if not there or other_type(due, 'ZCOUNT', sets[n]) then
      -- Gone, or of another type (written by hand: it holds none of them; ls names it).
      reply[4] = reply[4] + size
    else
      if due then
        reply[3] = reply[3] + due
        size = size - due
      end
      reply[slot_of[n] + 5] = reply[slot_of[n] + 5] + math.max(0, size)
    end
  end
end
return reply
