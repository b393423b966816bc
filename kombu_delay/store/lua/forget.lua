--[[ forget: drop the id-index refs that name no bucket, a page of the index at a time.

KEYS[1] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
ARGV[1] ns      key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] cursor  HSCAN cursor of the id index: '0' to begin
ARGV[3] count   HSCAN's COUNT: about how many task ids this page reads
Returns: {cursor, dropped}: the cursor to pass next ('0': the walk is done) and the refs
         dropped.
Bound: one HSCAN of about ARGV[3] fields, one EXISTS per bucket they name, and one HDEL or HSET
       per task id with a ref dropped.

A ref names its bucket's meta hash, through which find.lua reads the bucket's messages, and
that hash outlives the bucket's sorted sets and task-id list by a day: a ref whose meta hash
is gone finds nothing, and never will. Such refs are left by buckets lost (expired after
their grace with no mover running, evicted, deleted by hand) and by compressed buckets, which
keep no task-id list to drop them with; without this walk, each would stay while the index is
in use, which is as long as anything is published. A ref no script writes (by hand) goes too.
]]
--- @include spaces
local ids, ns = KEYS[1], ARGV[1]
local page = redis.call('HSCAN', ids, ARGV[2], 'COUNT', ARGV[3])
local fields = page[2]
local spaces_of = {[''] = space(ns, ''), c = space(ns, 'c')}
local alive, dropped = {}, 0
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
return {page[1], dropped}
