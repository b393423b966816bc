--[[ stage: copy a herd, ahead of its due time, into the list move.lua hands over whole.

KEYS[1] index   ZSET  <ns>index     the ordinary buckets' index (read only)
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] start   the bucket's start (ordinary space)
ARGV[3] dest    the destination list key: the bucket's sorted set for it holds the run
ARGV[4] limit   most members copied in this call; 0 to only look: nothing is written, and
                the reply describes the run the next call would copy
ARGV[5] min_run a run of fewer members is not staged (its batches are on time anyway)
Raises: OOM under maxmemory, before anything is written.
Returns: {code, staged, n, t}
         code 0: the run's n members due at t are all in the staged list (staged = n);
              1: staged of n copied so far (with limit 0: staged so far, or 0), call again;
             -1: no run to stage: the set holds no run of min_run members at one
                 millisecond, or is gone (n and t describe its first run, or are 0), or
                 this user's ACL refuses dest (its run waits, as its move does);
             -2: this user's ACL refuses what a handover needs (see may_hand_over): nothing
                 is staged, and move.lua moves the run in batches as ever.
Bound: at most ARGV[4] members copied, and about CALL_BYTES of them (read_ranks in
       _chunks.lua reads them, in chunks that stop once that much is read), plus, to find a run, at
       most 256 reads of one member and one ZCOUNT each, and a constant number of others.

See _staged.lua for what a run, its mark and its staged list are. The run staged is the set's
first run of at least min_run members: a run that long holds a member whose rank is a multiple
of min_run, so reading those ranks, in order, finds it. The staged list is built with LPUSH of
the run's ranks in order, so it reads as move.lua's LPUSH of the same batch would leave the
destination: the run's first member on the right, where a consumer's BRPOP takes it first.
Several movers may stage the same run: each call goes on where the list's length says the
last stopped, in one atomic call. The list expires with the sorted set it copies, and at most
an hour after its due time.
]]
--- @include clock
--- @include spaces
--- @include staged
--- @include chunks
local KEEP_PAST_DUE_MS = 3600000
local ns, start_s, dest = ARGV[1], ARGV[2], ARGV[3]
local limit, min_run = tonumber(ARGV[4]), math.max(1, tonumber(ARGV[5]))
-- The first write may grow memory, so that under maxmemory Redis refuses the whole call: a
-- copy doubles its herd, and moves, which free memory, must go on. (ZADD XX of a member that
-- is not there writes nothing.)
if limit > 0 then redis.call('ZADD', KEYS[1], 'XX', 0, '') end
if not redis.call('ZSCORE', KEYS[1], start_s) then return {-1, 0, 0, 0} end
local s = space(ns, '')
local meta, zset, staged = s:meta(start_s), s:zset(start_s, dest), s:staged(start_s, dest)
-- A bucket whose meta hash counts nothing for dest (drained, or the hash lost) gets no mark.
if (tonumber(redis.call('HGET', meta, 'q:' .. dest)) or 0) <= 0 then return {-1, 0, 0, 0} end

-- The set's first run of min_run members or more: found, its t, n and e (the members
-- before it); else false and the set's first run's t and n (0 and 0 when it is empty).
local function first_run()
  local first_t, first_n = 0, 0
  local total = redis.call('ZCARD', zset)
  for rank = 0, math.min(total - 1, 255 * min_run), min_run do
    local head = redis.call('ZRANGE', zset, rank, rank, 'WITHSCORES')
    local t = math.floor(tonumber(head[2]))
    local e, n = run_of(zset, t)
    if rank == 0 then first_t, first_n = t, n end
    if n >= min_run then return true, t, n, e end
  end
  return false, first_t, first_n, 0
end

local t, n = staged_mark(meta, dest)
local have, e = 0, nil
if t then
  have = redis.call('LLEN', staged)
  e = have <= n and run_intact(zset, staged, t, n, have)
  if not e then
    if limit == 0 then have, t = 0, nil  -- only looking: describe the run a copy would begin
    else
      drop_staged(s, meta, start_s, dest)
      have, t = 0, nil
    end
  end
end
if not t then
  local found
  found, t, n, e = first_run()
  if not found then return {-1, 0, n, t} end
  if limit == 0 then return {1, 0, n, t} end
  local may = may_hand_over(s, zset, dest, true)
  if may == 'dest' then return {-1, 0, n, t} end
  if not may then return {-2, 0, n, t} end
  redis.call('HSET', meta, 'h:' .. dest, t, 'hn:' .. dest, n)
  redis.call('UNLINK', staged)
end

if have < n and limit > 0 then
  local batch = read_ranks('ZRANGE', zset, e + have, math.min(n - have, limit), CALL_BYTES)
  for first = 1, #batch, 1000 do
    redis.call('LPUSH', staged, unpack(batch, first, math.min(#batch, first + 999)))
  end
  have = have + #batch
  -- It expires with its set, and at most KEEP_PAST_DUE_MS after its due time, when it is of no
  -- more use: a move hands a copy over at T, or finds it gone and moves the run in batches. (A
  -- bucket's clean-up drops its copies, but a mover of 1.0.0, during an upgrade, does not.)
  local now = clock('')
  local keep = math.max(t, now) + KEEP_PAST_DUE_MS - now
  local ttl = redis.call('PTTL', zset)
  if ttl > 0 and ttl < keep then keep = ttl end
  redis.call('PEXPIRE', staged, keep)
end
if have >= n then return {0, have, n, t} end
return {1, have, n, t}
