--[[ count: add to a lifetime counter, and keep the totals hash for a while at least.

KEYS[1] totals  HASH  <ns>totals    lifetime counters
ARGV[1] field   the counter (a fallback taken at publish: bad_eta, fanout_at_once)
ARGV[2] n       how much to add
ARGV[3] keep    ms: the hash lives at least this long from now; a later expiry stays
Returns: the count after.
Bound: one HINCRBY, one TIME, one PTTL and at most one PEXPIREAT.

A counter may make the hash, in a namespace nothing else uses: without an expiry it would
stay for good (keep_until, as the other scripts keep their shared keys).
]]
--- @include clock
local now = clock('')
local after = count_up(KEYS[1], ARGV[1], ARGV[2])
keep_until(KEYS[1], now, now + tonumber(ARGV[3]))
return after
