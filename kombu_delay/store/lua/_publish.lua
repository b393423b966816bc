--[[ publish: what schedule.lua gives put for a publisher's settings.

publish_k(ns, cold, width, grace, expires, db)
  The ``k`` that put (_put.lua) reads, as in_space would make it, for namespace ``ns``, the
  cold space or the ordinary one, and a publisher's bucket width, grace and queue x-expires
  (ARGV text, as given; expires '0' = none), and the number of its database, which its
  wake-up names (wake_if_first in _put.lua). Its counts are strict (count_up in _clock.lua):
  one the ACL refuses fails the publish, which put takes back. It is the same for every
  publish with the same settings, and put only reads it: where a script's helpers outlive a call (a Redis 7
  function: scripts.py turns the memo below on) it is made once per settings, and a publish
  builds no key name; as a script, on each call, with nothing kept. At most 64 are kept: a
  caller whose settings kept changing would only make them anew.
]]
--- @include spaces
--- @const FORMAT
local publish_k_memo, publish_k_count = false, 0

local function publish_k(ns, cold, width, grace, expires, db)
  local id
  if publish_k_memo then
    id = ns .. ' ' .. width .. ' ' .. grace .. ' ' .. expires .. ' ' .. db .. (cold and ' c' or '')
    local k = publish_k_memo[id]
    if k then return k end
  end
  -- In one constructor: a table grown field by field is rehashed as it grows.
  local sp = space(ns, cold and 'c' or '')
  local k = {ns = ns, space = sp, index = sp.index, ids = ns .. 'ids', counts = ns .. 'counts',
             totals = ns .. 'totals', width = tonumber(width), grace = tonumber(grace),
             wake = ns .. 'wake', wake_tag = '@' .. db, counter = 'scheduled',
             expires = expires ~= '0' and tonumber(expires), lists = ns .. 'lists',
             format = FORMAT, strict = true}
  if publish_k_memo then
    if publish_k_count >= 64 then publish_k_memo, publish_k_count = {}, 0 end
    publish_k_memo[id], publish_k_count = k, publish_k_count + 1
  end
  return k
end
