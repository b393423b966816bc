--[[ find: read the stored messages an id-index entry names, in one round trip.

KEYS[1] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] task_id  id-index key
Returns: {start, score, dest, member, start, score, dest, member, ...} for every member found
         at the score of one of the id's refs, in any destination of that bucket; start is
         "c<start>" for a cold bucket (keys.py), whose member is compressed. The caller
         keeps those whose payload carries task_id (Lua never decodes a payload): a ref of a
         moved message lingers until its bucket's clean-up, and another message due at the
         same millisecond may sit at its score once 2048 more publishes went into the bucket
         (seq is the bucket's publish counter modulo 2048).
Bound: one HGETALL per ref, and one ZRANGEBYSCORE of a single score per destination its meta
       hash counts; where those hold nothing at the ref's score, one more per destination it
       names with no count (zero, or junk written by hand: a mover counts such a set again
       once the bucket looks drained, and delivers it; it was "not scheduled" meanwhile). A
       bucket whose meta hash is gone (evicted, deleted by hand; a mover counts it again and
       delivers what it holds), or holds another type (written by hand: a cancel then names
       it), is looked for in every destination <ns>counts names; a set of another type holds
       no message, and is passed over (the listing names it).
]]
--- @include spaces
local ns, task_id = ARGV[1], ARGV[2]
local refs = redis.call('HGET', KEYS[1], task_id)
local found = {}
if not refs then return found end
for ref in string.gmatch(refs, '%S+') do
  local sp, start_s, offset, seq = string.match(ref, '^(c?)(%d+):(%d+):(%d+)$')
  if start_s then
    local s = space(ns, sp)
    local score = string.format('%.17g', tonumber(start_s) + tonumber(offset) + tonumber(seq) / 2048)
    local fields = redis.pcall('HGETALL', s:meta(start_s))
    if fields.err then fields = {} end
    if #fields == 0 then  -- (a drained bucket's meta hash stays a day: this is a lost one)
      for _, dest in ipairs(redis.call('HKEYS', ns .. 'counts')) do
        fields[#fields + 1], fields[#fields + 2] = 'q:' .. dest, ''
      end
    end
    local before = #found
    for counted = 1, 0, -1 do  -- the counted destinations, then, where they hold none, the rest
      if counted == 0 and #found > before then break end
      for i = 1, #fields, 2 do
        local name = fields[i]
        if string.sub(name, 1, 2) == 'q:' and ((tonumber(fields[i + 1]) or 0) > 0) == (counted == 1) then
          local dest = string.sub(name, 3)
          local members = redis.pcall('ZRANGEBYSCORE', s:zset(start_s, dest), score, score, 'WITHSCORES')
          if members.err then members = {} end
          for j = 1, #members, 2 do
            found[#found + 1] = sp .. start_s
            found[#found + 1] = members[j + 1]
            found[#found + 1] = dest
            found[#found + 1] = members[j]
          end
        end
      end
    end
  end
end
return found
