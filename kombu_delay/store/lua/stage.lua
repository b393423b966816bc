--[[ stage: copy a herd, ahead of its due time, into the list move.lua hands over whole.

KEYS[1] index   ZSET  <ns>index     the ordinary buckets' index (read only)
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] start   the bucket's start (ordinary space)
ARGV[3] dest    the destination list key: the bucket's sorted set for it holds the run
ARGV[4] limit   most members copied in this call
ARGV[5] min_run a head run of fewer members is not staged (its batches are on time anyway)
Raises: OOM under maxmemory, before anything is written.
Returns: {code, staged, n, t}
         code 0: the run's n members due at t are all in the staged list (staged = n);
              1: staged of n copied so far, call again;
             -1: no run to stage (the head run has fewer than min_run members, or the set is
                 gone; n and t describe the head run when there is one, else 0);
             -2: this user's ACL refuses what a handover needs (see may_hand_over): nothing
                 is staged, and move.lua moves the run in batches as ever.
Bound: one ZRANGE of at most ARGV[4] members and one LPUSH of them, plus a constant number
       of O(log n) commands.

See _staged.lua for what a run, its mark and its staged list are. The staged list is built
with LPUSH of the run's ranks in order, so it reads as move.lua's LPUSH of the same batch
would leave the destination: rank 0 on the right, where a consumer's BRPOP takes it first.
Several movers may stage the same run: each call goes on where the list's length says the
last stopped, in one atomic call. The list expires with the sorted set it copies.
]]
--- @include spaces
--- @include staged
local ns, start_s, dest = ARGV[1], ARGV[2], ARGV[3]
local limit, min_run = tonumber(ARGV[4]), tonumber(ARGV[5])
-- The first write may grow memory, so that under maxmemory Redis refuses the whole call: a
-- copy doubles its herd, and moves, which free memory, must go on. (ZADD XX of a member that
-- is not there writes nothing.)
redis.call('ZADD', KEYS[1], 'XX', 0, '')
if not redis.call('ZSCORE', KEYS[1], start_s) then return {-1, 0, 0, 0} end
local s = space(ns, '')
local meta, zset, staged = s:meta(start_s), s:zset(start_s, dest), s:staged(start_s, dest)

local t, n = staged_mark(meta, dest)
local have = 0
if t then
  have = redis.call('LLEN', staged)
  if have > n or not run_intact(zset, staged, t, n, have) then
    drop_staged(s, meta, start_s, dest)
    t = nil
  end
end
if not t then
  local head = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
  if not head[2] then return {-1, 0, 0, 0} end
  t = math.floor(tonumber(head[2]))
  n = redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', t + 1))
  if n < min_run then return {-1, 0, n, t} end
  if not may_hand_over(staged, zset, dest) then return {-2, 0, n, t} end
  redis.call('UNLINK', staged)
  redis.call('HSET', meta, 'h:' .. dest, t, 'hn:' .. dest, n)
  have = 0
end

if have < n then
  local batch = redis.call('ZRANGE', zset, have, math.min(n, have + limit) - 1)
  for first = 1, #batch, 1000 do
    redis.call('LPUSH', staged, unpack(batch, first, math.min(#batch, first + 999)))
  end
  have = have + #batch
  local ttl = redis.call('PTTL', zset)
  if ttl > 0 then redis.call('PEXPIRE', staged, ttl) end
end
if have >= n then return {0, have, n, t} end
return {1, have, n, t}
