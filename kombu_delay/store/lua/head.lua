--[[ head: the due time of the first message of one bucket's sorted set, without the message.

KEYS[1] zset  ZSET  a bucket's sorted set for one destination (<ns>z:<start>:<dest>, or the cold one)
ARGV[1] lo    ms: the bucket's start
ARGV[2] hi    ms: the bucket's last ms (its end, less 1)
Returns: the due time as text (epoch ms; a score written by hand, as ZRANGE gives it: the
         caller keeps it in range, keys.due_of), or nil when the set is empty.
Bound: about log2(ARGV[2] - ARGV[1]) ZCOUNT calls (head_due in _head.lua).
]]
--- @include head
local due = head_due(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
if due == nil then return nil end
return string.format('%.17g', due)
