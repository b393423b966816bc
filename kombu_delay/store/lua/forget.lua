--[[ forget: drop the id-index refs that name no bucket, a page of the index at a time.

KEYS[1] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
KEYS[2] walk    HASH  <ns>walk      the walk in hand: at (epoch ms its first page was read),
                by (the mover walking), done (epoch ms its last page was read); it expires
                ARGV[4] after ``at``, when the next walk is due
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] cursor  HSCAN cursor of the id index: '0' to begin
ARGV[3] count   HSCAN's COUNT: about how many task ids this page reads
ARGV[4] every   ms between walks: a first page asked for while <ns>walk is there reads
                nothing, so however many movers run, one walk is begun in that time
ARGV[5] mover   the mover walking (kept in <ns>walk, for an operator to read)
ARGV[6] now_ms  epoch ms to judge by; '' = Redis TIME (tests drive time through it)
Returns: {cursor, dropped, skipped, put back, counted}: the cursor to pass next ('0': the
         walk is done), the refs dropped, and, when this was a first page and another walk had
         begun less than ARGV[4] ago (nothing read), the ms its claim lasts yet (at least 1),
         else 0; then the buckets the refs name that were put back into their index, and the
         messages those count (see below). A claim that has no expiry is taken over, and
         so is one of a walk not done whose mover has no heartbeat fresher than
         FRESH_HEARTBEAT_MS in <ns>movers (killed, or stopped, part way), or that is the
         caller's own (a first page of its own walk: begun again).
Bound: one HSCAN of about ARGV[3] fields (and, on a first page, an HMGET and a ZSCORE), one EXISTS and one ZSCORE per bucket they name
       (put_back in _buckets.lua, which does more only for a bucket missing from its index),
       and one HDEL or HSET per task id with a ref dropped.

A ref names its bucket's meta hash, through which find.lua reads the bucket's messages, and
that hash outlives the bucket's sorted sets and task-id list by a day: a ref whose meta hash
is gone finds nothing, and never will. Such refs are left by buckets lost (expired after
their grace with no mover running, evicted, deleted by hand) and by compressed buckets, which
keep no task-id list to drop them with; without this walk, each would stay while the index is
in use, which is as long as anything is published. A ref no script writes (by hand) goes too.
A bucket whose meta hash is there is put back into its index where it left it (put_back in
_buckets.lua), as reindex.lua does for the meta hashes a SCAN finds: so that a user who may
not SCAN has the buckets of an index evicted or deleted by hand put back too, within a walk.
]]
--- @include spaces
--- @include clock
--- @include buckets
--- @const FRESH_HEARTBEAT_MS
local ids, walk, ns = KEYS[1], KEYS[2], ARGV[1]

-- Whether the walk in hand was left part way by its mover (killed, or stopped): no heartbeat
-- of it fresher than FRESH_HEARTBEAT_MS. Its claim would stop every walk for the rest of its
-- hour. A walk done keeps its claim, whoever made it, until the next walk is due.
local function abandoned()
  local claimed = redis.call('HMGET', walk, 'by', 'done')
  if claimed[2] or not claimed[1] then return false end
  -- Its own, begun again: its cursor was of another Redis process (restarted with its data).
  if claimed[1] == ARGV[5] then return true end
  local beat = tonumber(redis.call('ZSCORE', ns .. 'movers', claimed[1]))
  return not beat or beat < clock(ARGV[6]) - FRESH_HEARTBEAT_MS
end

-- 'none' or 'hash', unless written by hand: then every mover walks, as if none had begun.
local walk_type = redis.call('TYPE', walk)['ok']
-- A claim with no expiry (its PEXPIREAT refused by an ACL, or written by hand) would stop
-- every walk for good: it is taken over, as if there were none.
local claim = walk_type == 'none'
if ARGV[2] == '0' and walk_type == 'hash' then
  local left = redis.call('PTTL', walk)
  if left >= 0 and not abandoned() then return {'0', 0, math.max(left, 1)} end  -- 0: under a ms left
  claim = true
end
-- Read before any write: a refusal (an ACL without HSCAN) leaves the next walk to a mover
-- that may.
local page = redis.call('HSCAN', ids, ARGV[2], 'COUNT', ARGV[3])
-- Bookkeeping that frees memory: not refused under maxmemory (past_maxmemory in _buckets.lua).
past_maxmemory(ids)
if ARGV[2] == '0' and claim then
  local now = clock(ARGV[6])
  redis.call('HSET', walk, 'at', now, 'by', ARGV[5])
  redis.call('PEXPIREAT', walk, now + tonumber(ARGV[4]))
end
local fields = page[2]
local spaces_of = {[''] = space(ns, ''), c = space(ns, 'c')}
local alive, dropped, put_back_n, counted, now = {}, 0, 0, 0, nil
for i = 1, #fields, 2 do
  local kept = {}
  local gone = 0
  for ref in string.gmatch(fields[i + 1], '%S+') do
    local tag, start_s = string.match(ref, '^(c?)(%d+):%d+:%d+$')
    local live = false
    if start_s then
      local meta = spaces_of[tag]:meta(start_s)
      live = alive[meta]
      if live == nil then
        live = redis.call('EXISTS', meta) == 1
        alive[meta] = live
        if live then
          now = now or clock(ARGV[6])
          local b, n = put_back(spaces_of[tag], start_s, now)
          put_back_n, counted = put_back_n + b, counted + n
        end
      end
    end
    if live then kept[#kept + 1] = ref else gone = gone + 1 end
  end
  if gone > 0 then
    dropped = dropped + gone
    if #kept == 0 then
      redis.call('HDEL', ids, fields[i])
    else
      redis.call('HSET', ids, fields[i], table.concat(kept, ' '))
    end
  end
end
-- Kept only while it lasts: a walk longer than ARGV[4] finds its key gone, and leaves none.
if page[1] == '0' and redis.call('TYPE', walk)['ok'] == 'hash' then
  local now = clock(ARGV[6])
  redis.call('HSET', walk, 'done', now)
end
if put_back_n > 0 then count_up(ns .. 'totals', 'reindexed', put_back_n) end
return {page[1], dropped, 0, put_back_n, counted}
