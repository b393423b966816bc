--[[ thaw_scan: list the cold messages due soon, for a mover to restore them (thaw.lua).

KEYS[1] cindex  ZSET  <ns>cindex    member = score = start of a cold bucket holding messages
KEYS[2] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[3] totals  HASH  <ns>totals    lifetime counters
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] ahead   ms: the cold messages due no later than now + ahead are listed
ARGV[3] limit   most messages listed (and most cold buckets visited)
ARGV[4] now_ms  epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[5] past    "1": write past maxmemory (the scan for a thaw past it, see thaw.lua)
Returns: {now_ms, next_ms, more, expired, recounted, damaged, start, score, dest, member, start, ...}
         recounted: members found in a bucket whose counts read zero (added by hand, or
         counted in a meta hash that is gone), counted again (recount in _buckets.lua)
         next_ms: no cold message left unlisted is due before it (-1: none is stored), so
         the mover need not look again before next_ms - ahead. more: 1 when the limit cut
         the list. expired: counted messages whose cold set was gone (expired after its
         grace, or deleted by hand), whose counts this call settled, as move.lua does.
         damaged: a cold bucket's meta hash or sorted set found of another type (written by
         hand; its messages counted in expired), each followed by '' (as move.lua's, where
         it is the name a key was renamed to: this call renames none)
Bound: at most ARGV[3] buckets, each one HGETALL and, per destination, reads of at most the
       messages still wanted (read_ranks in _chunks.lua) and one of a single member; members
       of about CALL_BYTES in all (read in chunks that stop once that much is read, at least
       one member), so that large messages do not hold Redis for seconds in one call.

Listing takes nothing: a member two movers both list is thawed by the first (thaw.lua's
ZREM), and a mover that dies between the two calls leaves it where it was.
]]
--- @include clock
--- @include spaces
--- @include buckets
--- @include chunks
local cindex, counts, totals = KEYS[1], KEYS[2], KEYS[3]
-- What this scan writes (the counts it settles, a bucket it retires) is small, and a thaw of
-- what is due, past maxmemory (thaw.lua), must not stop on it. Only then: on Redis 6 a script's
-- write, even one that changes nothing, sends replicas and the AOF an empty MULTI/EXEC.
if ARGV[5] == '1' then past_maxmemory(totals) end
local ns = ARGV[1]
local limit = tonumber(ARGV[3])
local now = clock(ARGV[4])
local horizon = now + tonumber(ARGV[2])
local horizon_s = string.format('%d', horizon)
local k = in_space({ns = ns}, 'c')
local cs = k.space

local listed, expired, recounted, damaged = {}, 0, 0, {}
local wanted = limit
local bytes_left = CALL_BYTES
local next_ms, more = -1, 0
local function later(due)
  if next_ms < 0 or due < next_ms then next_ms = due end
end

local starts = redis.call('ZRANGEBYSCORE', cindex, '-inf', horizon_s, 'LIMIT', 0, limit)
for _, start_s in ipairs(starts) do
  if wanted <= 0 then
    more = 1
    break
  end
  local meta = cs:meta(start_s)
  local fields = redis.pcall('HGETALL', meta)
  local unreadable = other_type(fields, 'HGETALL', meta)
  if unreadable then  -- of another type, by hand: let go, so no other bucket's thaw waits on it
    expired = expired + let_go_unreadable(k, start_s)
    damaged[#damaged + 1] = meta
    damaged[#damaged + 1] = ''
    fields = {}
  end
  local left, end_ms = 0, nil
  for i = 1, #fields, 2 do
    if fields[i] == 'end' then end_ms = count_of(fields[i + 1]) end
  end
  for i = 1, #fields, 2 do
    local name, n = fields[i], count_of(fields[i + 1])
    if string.sub(name, 1, 2) == 'q:' and (n or 0) > 0 then
      local dest = string.sub(name, 3)
      local zset = cs:zset(start_s, dest)
      local card = redis.pcall('ZCARD', zset)  -- 0: no key; an error: a key of another type
      if other_type(card, 'ZCARD', zset) then card = false end
      if card == 0 then
        -- Gone while counted: settle the count, as move.lua does. Their refs stay in the
        -- id index (a cold bucket keeps no task-id list) and name nothing.
        expired = expired + n
        settle_gone(meta, name, counts, dest, n)
      elseif wanted > 0 then
        left = left + n
        -- Those due by the horizon, within the bytes left (read_ranks): the rest in the next call.
        local members, used, scores = {}, 0, {}
        if card == false then  -- of another type, by hand: read as gone, as move.lua
          left = left - n              -- reads one
          expired = expired + n
          settle_gone(meta, name, counts, dest, n)
          damaged[#damaged + 1] = zset
          damaged[#damaged + 1] = ''
        else
          members, used, scores = read_ranks('ZRANGE', zset, 0, wanted, bytes_left, horizon + 1)
        end
        for j = 1, #members do
          listed[#listed + 1] = start_s
          listed[#listed + 1] = scores[j]
          listed[#listed + 1] = dest
          listed[#listed + 1] = members[j]
        end
        wanted = wanted - #members
        bytes_left = bytes_left - used
        if bytes_left <= 0 or wanted <= 0 then wanted, more = 0, 1 end  -- cut by bytes or the limit
        local rest = redis.pcall('ZRANGEBYSCORE', zset, '(' .. horizon_s, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        if other_type(rest, 'ZRANGEBYSCORE', zset) then rest = {} end
        local score = tonumber(rest[2])
        if score and (score == math.huge or (end_ms and score >= end_ms)) then
          -- Scored past its bucket's end (no publish does that: a score written by hand, up
          -- to +inf): listed now, so that the thaw stores it by its due time, or dead-letters
          -- one that has none, rather than leave its bucket held, and renewed, for ever.
          listed[#listed + 1] = start_s
          listed[#listed + 1] = rest[2]
          listed[#listed + 1] = dest
          listed[#listed + 1] = rest[1]
          wanted, more = wanted - 1, 1
        elseif score then
          later(math.floor(score))
        end
      else
        left = left + n
        more = 1
      end
    end
  end
  -- Drained, or only counted messages that are gone, or its meta hash gone (expired a day
  -- after its grace, or deleted): the bucket leaves the index, as move.lua retires one.
  if left == 0 and not unreadable then recounted = recounted + retire(k, start_s, end_ms, now) end
end
if more == 0 and #starts == limit then more = 1 end
local first = tonumber(redis.call('ZRANGEBYSCORE', cindex, '(' .. horizon_s, '+inf', 'LIMIT', 0, 1)[1])
if first then later(first) end  -- (a member that is no start, written by hand, is none)
if expired > 0 then count_up(totals, 'expired', expired) end
if recounted > 0 then more = 1 end
local reply = {now, next_ms, more, expired, recounted, damaged}
for i = 1, #listed do reply[#reply + 1] = listed[i] end
return reply
