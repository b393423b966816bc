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

pushed(dest, values)
  LPUSH dest values, as checked_call, except that an ACL refusal of this destination returns
  false instead of raising (nothing is pushed): Redis 6, which cannot be asked beforehand,
  refuses the push itself, and one destination the mover's user may not write must not stop
  the moves of every other. Returns true when pushed.

renew_lists(lists, dest, ttl)
  A queue declared with x-expires: renews the expiry of ``dest`` and of the queue's other
  lists (the JSON array of their keys that its publisher kept in the hash ``lists``,
  <ns>lists, under dest: see note_lists in _put.lua) to ``ttl`` ms, as kombu's own publish
  renews every list of the queue. Best effort, as kombu's renewal: a refusal (an ACL without
  PEXPIRE), a hash of another type or a value that is no such array (written by hand) must
  not stop a push, which cannot be undone; the next publish or read of the queue renews them.

keep_lists(lists, dest, now, at)
  Keeps the hash ``lists`` until ``at`` (ms) at least, where it holds dest's entry: for a
  message rescheduled into a bucket that outlives it.

room_keeper(max_len)
  Returns room, room_of for one move call: room[dest] is how many more pushes the list
  ``dest`` takes in this call (math.huge without max_len, NOT_A_LIST when the key is not a
  list, REFUSED when this user's ACL refuses LPUSH onto it: asked of Redis 7 and later, told
  by a push on Redis 6); room_of(dest) returns it, asking Redis (the ACL, TYPE, and LLEN
  under max_len) the first time.
]]
local NOT_A_LIST, REFUSED = -1, -2

local function assert_may_push(dest)
  if redis.acl_check_cmd and not redis.acl_check_cmd('LPUSH', dest, 'x') then
    error({err = 'NOPERM this user may not LPUSH onto ' .. dest .. '; nothing was taken for it'})
  end
end

local function raise_refusal(err, command, key)
  local text = err .. ' (' .. command .. ' ' .. key .. '; nothing was taken for it)'
  if redis.acl_check_cmd then error({err = text}) end  -- Redis 7+ keeps the error code
  error(text)  -- Redis 6 raises strings only
end

local function checked_call(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then raise_refusal(reply.err, command, key) end
  return reply
end

-- An ACL refusal, as Redis 7 (NOPERM) and Redis 6 word it inside a script.
local function acl_refusal(text)
  return string.find(text, 'NOPERM', 1, true) or string.find(text, "The user executing the script can't", 1, true)
end

-- Redis 6's refusal of a key (not of a command) inside a script: a key this user may not
-- access at all, so not LPUSH onto either (Redis 6 has no read-only or write-only keys).
local function key_refusal_6(text)
  return string.find(text, "The user executing the script can't access", 1, true)
end

local function pushed(dest, values)
  local reply = redis.pcall('LPUSH', dest, unpack(values))
  if type(reply) == 'table' and reply.err then
    if acl_refusal(reply.err) then return false end
    raise_refusal(reply.err, 'LPUSH', dest)
  end
  return true
end

local function keep_lists(lists, dest, now, at)
  -- (HGET: the ACL line grants it, not HEXISTS, whose refusal read as no entry)
  if type(redis.pcall('HGET', lists, dest)) == 'string' then pcall(keep_until, lists, now, at) end
end

local function renew_lists(lists, dest, ttl)
  redis.pcall('PEXPIRE', dest, ttl)
  local siblings = redis.pcall('HGET', lists, dest)
  if type(siblings) ~= 'string' then return end
  local ok, names = pcall(cjson.decode, siblings)
  if not ok or type(names) ~= 'table' then return end
  for _, key in ipairs(names) do
    if type(key) == 'string' then redis.pcall('PEXPIRE', key, ttl) end
  end
end

local function room_keeper(max_len)
  local room = {}
  local function room_of(dest)
    local left = room[dest]
    if left == nil then
      local kind
      if not (redis.acl_check_cmd and not redis.acl_check_cmd('LPUSH', dest, 'x')) then
        -- Redis 6 cannot be asked; there a user refused the key is refused its TYPE too. Any
        -- other refusal of TYPE (the command itself, or a write-only key on Redis 7) is one
        -- that no fix of the queue's key mends: raised, as every other refusal.
        kind = redis.pcall('TYPE', dest)
        if kind.err and not (not redis.acl_check_cmd and key_refusal_6(kind.err)) then
          raise_refusal(kind.err, 'TYPE', dest)
        end
        kind = kind.ok
      end
      if not kind then
        left = REFUSED
      elseif kind ~= 'list' and kind ~= 'none' then
        left = NOT_A_LIST
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
