--[[ purge: remove every stored message bound for some destination lists (a queue's lists).

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[3] totals  HASH  <ns>totals    lifetime counters
KEYS[4] gc      ZSET  <ns>gc        drained buckets whose id-index refs are still to drop
KEYS[5] ids     HASH  <ns>ids       task id -> refs (written only for the cold space)
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] limit    most messages plus buckets handled in this call
ARGV[3] start    cursor: bucket start to resume at, epoch ms (0 to begin)
ARGV[4] space    "" for the ordinary buckets, "c" for the cold ones (KEYS[1] is then <ns>cindex)
ARGV[5] now_ms   epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[6..] dest   destination list keys to purge
Returns: {removed, done, start}; done 0 means call again with the returned cursor.
         A key of another type (written by hand) is an error reply naming it: the shared keys'
         before any write; a bucket's before its first, with what the call removed until then
         counted in totals (what a purge removed stays removed).
Bound: removes at most ARGV[2] messages and visits at most ARGV[2] buckets.

A bucket keeps one sorted set per destination, so a purge removes those sets from the head
by rank and never reads a message; buckets whose meta hash counts none of these lists cost
one HMGET. A herd's copy staged ahead (_staged.lua) goes with its run. The refs of purged messages are dropped with their bucket's (see move.lua); a cold
bucket has no task-id list, so there they are read off the members (cold_task_id) first.
]]
--- @include clock
--- @include refs
--- @include spaces
--- @include buckets
--- @include staged
--- @include mover_acl
local index, counts, totals = KEYS[1], KEYS[2], KEYS[3]
local ns = ARGV[1]
local limit = tonumber(ARGV[2])
local cursor = ARGV[3]
local dests, fields = {}, {}
for i = 6, #ARGV do
  dests[#dests + 1] = ARGV[i]
  fields[#fields + 1] = 'q:' .. ARGV[i]
end
local now = clock(ARGV[5])
local k = in_space({ns = ns, gc = KEYS[4]}, ARGV[4])
local s = k.space

local removed, lost = 0, 0
local budget = limit
local function counted_up()
  if removed > 0 then count_up(totals, 'purged', removed) end
  if lost > 0 then count_up(totals, 'expired', lost) end
end
local function finish(done, start_s)
  counted_up()
  return {removed, done, start_s}
end

-- A key of another type (written by hand) fails a command after the writes before it, which
-- Redis keeps: the shared keys are checked before any write, a bucket's are read (pcall) before
-- its first, and what this call removed until then is counted before the error (wrong_types,
-- _buckets.lua).
local refused = wrong_types({{index, 'zset'}, {counts, 'hash'}, {totals, 'hash'}, {KEYS[4], 'zset'},
                             {KEYS[5], 'hash'}})
if refused then return refused end
-- And a command the ACL refuses: Redis keeps a script's writes before it, and a purge refused
-- ZREMRANGEBYRANK after it dropped the messages' id-index refs left them scheduled, but out
-- of reach of find and cancel. Redis 7 is asked first (nothing read or written); Redis 6
-- cannot be, and there the refs go only after their messages.
refused = redis.acl_check_cmd and mover_refused(ns, false, false, true)
if refused then return refusal_reply(refused, 'purge', 'nothing was purged by this call') end
local function refused_at(key, wanted)
  counted_up()
  local told = string.format('the purge stopped there, after removing %d here (counted)', removed)
  return wrong_types({{key, wanted}}, told)
    or redis.error_reply('ERR ' .. key .. ' could not be read as a ' .. wanted)
end

local starts = redis.call('ZRANGEBYSCORE', index, cursor, '+inf', 'LIMIT', 0, limit)
for _, start_s in ipairs(starts) do
  if budget <= 0 then return finish(0, start_s) end
  budget = budget - 1
  local meta = s:meta(start_s)
  local counted = redis.pcall('HMGET', meta, unpack(fields))
  if counted.err then return refused_at(meta, 'hash') end
  local touched = false
  for i, dest in ipairs(dests) do
    -- What its set holds, where that is more than its count (members its counts missed: a
    -- meta hash lost, or a member added by hand): a purged message must never run.
    local size = redis.pcall('ZCARD', s:zset(start_s, dest))
    if type(size) ~= 'number' then return refused_at(s:zset(start_s, dest), 'zset') end
    local n = math.max(count_of(counted[i]) or 0, size)
    if n > 0 and not s.cold and staged_mark(meta, dest) then drop_staged(s, meta, start_s, dest) end
    while n > 0 do
      if budget <= 0 then return finish(0, start_s) end
      local zset = s:zset(start_s, dest)
      -- A cold bucket has no task-id list: the refs go with the members, once they are gone.
      local doomed = s.cold and redis.call('ZRANGE', zset, 0, budget - 1, 'WITHSCORES')
      local gone = redis.call('ZREMRANGEBYRANK', zset, 0, budget - 1)
      if doomed then
        local task_ids, refs = {}, {}
        for j = 1, #doomed, 2 do
          task_ids[#task_ids + 1] = cold_task_id(doomed[j])
          refs[#refs + 1] = s.tag .. score_ref(start_s, tonumber(doomed[j + 1]))
        end
        drop_refs(KEYS[5], task_ids, function(j) return refs[j] end)
      end
      if gone == 0 then  -- counted but not stored (expired): settle the count
        lost = lost + n
        gone = n
      else
        removed = removed + gone
        budget = budget - gone
      end
      touched = true
      uncount_meta(meta, fields[i], gone)
      uncount(counts, dest, gone)
      n = n - gone
    end
  end
  if touched then
    redis.call('HDEL', meta, 'w')  -- the wake mark's message may be gone (_put.lua)
    local empty, end_ms = drained_counts(meta)
    if empty then retire(k, start_s, end_ms, now) end
  end
end
if #starts == limit then
  return finish(0, string.format('%d', tonumber(starts[#starts]) + 1))
end
return finish(1, '0')
