--[[ bench_floor_publish: the floor of any publish that stores its message by a script, for
`kombu-delay bench` only.

One ZADD and nothing else (no bucket, no id index, no counts, no expiry, no wake-up): what a
script call costs Redis before it keeps any books, so schedule.lua can only cost more.

KEYS[1] zset    ZSET  where the member goes
ARGV[1] score   its score
ARGV[2] member  the message
Returns: 1
Bound: one O(log n) command.
]]
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
return 1
