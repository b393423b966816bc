--[[ cancel: remove one stored message of a task id, found by the caller through the id index.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] gc      ZSET  <ns>gc        drained buckets whose id-index refs are still to drop
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] task_id  id-index key
ARGV[3] start    the message's bucket start, epoch ms ("c<start>" for a cold bucket)
ARGV[4] dest     its destination list key
ARGV[5] ref      its id-index ref "start:offset:seq"
ARGV[6] payload  the member, exactly as stored
ARGV[7] now_ms   epoch ms to judge by; '' = Redis TIME (tests drive time through it)
ARGV[8] mark     optional: what the message is noted by once taken (note_taken in _buckets.lua)
Returns: 1 removed, 0 already gone (moved or cancelled meanwhile; nothing written)
Bound: a constant number of O(log n) commands.

The caller reads the message first (Store.find checks the task id inside the payload, which
Lua never decodes), so ZREM of that exact member is the claim: a message is never both
delivered and cancelled.
]]
--- @include clock
--- @include spaces
--- @include buckets
local now = clock(ARGV[7])
local k = {ns = ARGV[1], index = KEYS[1], ids = KEYS[2], counts = KEYS[3], gc = KEYS[5]}
local sp, start_s = split_bucket(ARGV[3])
local there = in_space(k, sp)
local refused = wrong_types({{there.index, 'zset'}, {KEYS[2], 'hash'}, {KEYS[3], 'hash'}, {KEYS[4], 'hash'},
                             {KEYS[5], 'zset'}, {there.space:meta(start_s), 'hash'}})
if refused then return refused end
if not take(there, start_s, ARGV[4], ARGV[6], ARGV[2], ARGV[5], now, ARGV[8]) then return 0 end
count_up(KEYS[4], 'cancelled', 1)
return 1
