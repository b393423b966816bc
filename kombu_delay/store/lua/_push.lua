--[[ push: writing onto kombu's lists, refused before anything is taken.

assert_may_push(dest)
  On Redis 7 and later, raises a NOPERM error when this user's ACL refuses LPUSH onto dest,
  naming it, before anything is read for dest. Redis 6 cannot tell beforehand; there the
  refusal comes from the push itself, which move.lua and reschedule.lua make before they
  take anything (a script's writes are not undone when it fails).

checked_call(command, key, ...)
  redis.call, except that a refusal (an ACL, maxmemory, a read-only replica) is raised naming
  the command and key, which Redis 6's ACL refusal does not, and saying that nothing was
  taken for that key. For the writes a script makes before it takes anything.

room_keeper(max_len)
  Returns room, room_of for one move call: room[dest] is how many more pushes the list
  ``dest`` takes in this call (math.huge without max_len, -1 when the key is not a list);
  room_of(dest) returns it, asking Redis (TYPE, and LLEN under max_len) the first time,
  after assert_may_push(dest).
]]
local function assert_may_push(dest)
  if redis.acl_check_cmd and not redis.acl_check_cmd('LPUSH', dest, 'x') then
    error({err = 'NOPERM this user may not LPUSH onto ' .. dest .. '; nothing was taken for it'})
  end
end

local function checked_call(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then
    local text = reply.err .. ' (' .. command .. ' ' .. key .. '; nothing was taken for it)'
    if redis.acl_check_cmd then error({err = text}) end  -- Redis 7+ keeps the error code
    error(text)  -- Redis 6 raises strings only
  end
  return reply
end

local function room_keeper(max_len)
  local room = {}
  local function room_of(dest)
    local left = room[dest]
    if left == nil then
      assert_may_push(dest)
      local kind = redis.call('TYPE', dest)['ok']
      if kind ~= 'list' and kind ~= 'none' then
        left = -1
      elseif max_len > 0 then
        left = math.max(0, max_len - redis.call('LLEN', dest))
      else
        left = math.huge
      end
      room[dest] = left
    end
    return left
  end
  return room, room_of
end
