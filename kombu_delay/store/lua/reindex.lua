--[[ reindex: put back into their index the buckets that count messages but left it, and put
right the ones whose score in it is not their start.

ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] now_ms  epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[3..] buckets, as found by a SCAN of the meta hashes: "<start>" (ordinary) or "c<start>"
        (cold)
Returns: {buckets put back, the messages they count}.
Bound: per bucket put_back's (_buckets.lua): one ZSCORE, and for one not in its index (or at
       another score) a TYPE, an HGETALL, and an HGET and a ZADD where it counts messages.

Movers, sweeps and thaws reach a bucket only through its space's index (<ns>index,
<ns>cindex). An index evicted (under an allkeys-* maxmemory-policy) or deleted by hand would
strand every bucket it named, and a publish into such a bucket does not index it again (it
indexes a set it makes, not one it adds to). A bucket whose meta hash still counts messages
and is in no index is put back here; one whose counts are all zero has drained (or left its
messages to the sweep's accounting) and is left alone, as is a meta hash gone with its sets.
A bucket in its index at a score other than its start (changed by hand) is reached by nothing
until the clock reads that score (never, for one set in 2100, or a move would find it only
then): it is put back at its start, whether or not it counts messages, and counted the same.
]]
--- @include clock
--- @include spaces
--- @include buckets
local ns = ARGV[1]
-- Under maxmemory too: an index member per bucket, so that its messages move, and free memory.
past_maxmemory(ns .. 'totals')
local now = clock(ARGV[2])
local put_back_n, counted = 0, 0
for i = 3, #ARGV do
  local tag, start_s = split_bucket(ARGV[i])
  if start_s then
    local b, n = put_back(space(ns, tag), start_s, now)
    put_back_n, counted = put_back_n + b, counted + n
  end
end
if put_back_n > 0 then count_up(ns .. 'totals', 'reindexed', put_back_n) end
return {put_back_n, counted}
