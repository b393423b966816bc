--[[ spaces: the two spaces a message waits in, ordinary ('') and cold ('c', compressed), as
keys.py names their keys; kombu_delay/store/spaces.py says what can happen to a message in each.

space(ns, tag)
  The space ``tag`` ('' or 'c') of namespace ``ns``: {tag, cold (true for 'c'), index (its
  ZSET of bucket starts)} and the keys of one of its buckets, called as methods:
  s:meta(start_s), s:zset(start_s, dest), s:tasks(start_s), s:staged(start_s, dest) (a herd's
  list built ahead, see _staged.lua), and s:large() (its ZSET of the buckets holding a large
  run for a destination, see note_large in _put.lua); ``tasks`` (the task-id list) is
  nil in the cold space, whose refs leave the id index one by one (thaw, take, purge) instead
  of with their drained bucket. Methods, not closures: a space is made in every call of most
  scripts, and a closure per key kind was a good part of a publish's Redis CPU.

split_bucket(text)
  Splits a bucket as the callers name it ("<start>", or "c<start>" in the cold space) into
  its space tag and its start.

in_space(k, tag)
  Returns k for the space ``tag`` (for put, take and retire): a table whose ``space`` is
  space(k.ns, tag) and whose index is that space's, and which reads every other field from k
  (through a metatable: no copy, so k must not change while it is in use).

cold_task_id(member)
  The task id a cold member carries in the clear (kombu_delay/store/cold.py), for its
  id-index ref.

other_type(reply, command, key)
  Whether ``reply``, of the redis.pcall of ``command`` that read a bucket's ``key``, says the
  key is of another type (written by hand: WRONGTYPE), for the caller to pass it over,
  counted. Any other error, an ACL refusal above all, is raised instead, naming the command
  and key (Redis 6 names neither): taken for a damaged key, a refused read wrote off a
  healthy bucket, whose messages stayed in Redis with nothing left to move them.
]]
local function space_meta(s, start_s) return s.keys .. 'm:' .. start_s end
local function space_zset(s, start_s, dest) return s.keys .. 'z:' .. start_s .. ':' .. dest end
local function space_staged(s, start_s, dest) return s.keys .. 'h:' .. start_s .. ':' .. dest end
local function space_large(s) return s.keys .. 'large' end
local function space_tasks(s, start_s)
  if not s.cold then return s.keys .. 't:' .. start_s end
end

local function space(ns, tag)
  -- One constructor: a table grown field by field is rehashed as it grows. ``keys``: what
  -- the space's keys start with.
  return {tag = tag, cold = tag ~= '', keys = ns .. tag, index = ns .. tag .. 'index',
          meta = space_meta, zset = space_zset, tasks = space_tasks, staged = space_staged,
          large = space_large}
end

local function split_bucket(text)
  return string.match(text, '^(c?)(%d+)$')
end

local function in_space(k, tag)
  local s = space(k.ns, tag)
  -- Reads fall through to k: cheaper than copying it field by field.
  return setmetatable({space = s, index = s.index}, {__index = k})
end

local function cold_task_id(member)
  return string.sub(member, 3, 2 + (string.byte(member, 2) or 0))
end

local function other_type(reply, command, key)
  if type(reply) ~= 'table' or not reply.err then return false end
  if string.find(reply.err, 'WRONGTYPE', 1, true) then return true end
  local text = reply.err .. ' (' .. command .. ' ' .. key .. '; nothing was written off)'
  if redis.acl_check_cmd then error({err = text}) end  -- Redis 7+ keeps the error code
  error(text)  -- Redis 6 raises strings only
end
