--[[ clock: the one clock of every script.

clock(at)
  Returns the Redis clock as epoch ms and the microseconds past that ms (0..999); with ``at``
  (an ARGV, epoch ms; '' or nil = Redis TIME, the production path), that time instead, with
  0 µs: tests drive time through it rather than wait for it.

keep_until(key, now, at)
  key  any kombu-delay key (ids, counts, gc, or a bucket's own keys)
  now  the clock, epoch ms;  at  epoch ms
  Makes the key live at least until ``at``: sets the expiry when it has none or an earlier one,
  never shortens it. Bound: one PTTL and at most one PEXPIREAT. For a hint (a key whose
  refusal must fail nothing: the large-bucket notes, <ns>lists), call it with pcall.

ms_of(text)
  A time read from a hash field (a bucket's end, expiry, wake mark) as whole epoch ms, or nil
  where there is none: absent, or written by hand as text no script writes, including what
  Lua reads as a number that is no time ('inf', 'nan', '1e20', '1.5'), which a comparison
  would otherwise keep for ever and a PEXPIREAT refuse after a script's first writes.
  Kept by text in a memo where a script's helpers outlive a call (see below).

count_up(key, field, n, strict)
  HINCRBY key field n (n: a number, or text such as '1'); returns the count after. Where the
  field holds text HINCRBY refuses (written by hand), it becomes n: a count made after a
  script's first write must not fail the script, since Redis takes back none of the writes
  before the failure (a message stored, a retry storing it again). Where the ACL refuses it
  (Redis 6, which cannot be asked beforehand), it is left as it is, or with ``strict`` raises
  a NOPERM error naming the command and the key: a publish's counts (put in _put.lua), which
  it takes back, since a message stored uncounted is one no mover delivers.
]]
local function clock(at)
  if at and at ~= '' then return math.floor(tonumber(at)), 0 end
  local t = redis.call('TIME')
  local us = tonumber(t[2])
  return tonumber(t[1]) * 1000 + math.floor(us / 1000), us % 1000
end

local function keep_until(key, now, at)
  local ttl = redis.call('PTTL', key)
  if ttl == -1 or now + ttl < at then
    redis.call('PEXPIREAT', key, at)
  end
end

-- A publish reads the same few times (its bucket's expiry, end and wake mark) as the
-- publishes before it, and tonumber (strtod) is a good part of its cost: where a script's
-- helpers outlive a call (a function, see scripts.py), the times read are kept, by their
-- text, at most 256 of them. A pure cache: a text always gives the same time.
local ms_of_memo, ms_of_count = false, 0

local function ms_of(text)
  if not text then return nil end
  local memo = ms_of_memo
  if memo then
    local known = memo[text]
    if known ~= nil then return known or nil end
  end
  local n = tonumber(text)
  if not (n and n >= 0 and n < 2 ^ 53 and n == math.floor(n)) then n = false end
  if memo then
    if ms_of_count >= 256 then ms_of_memo, ms_of_count = {}, 0 end
    ms_of_memo[text], ms_of_count = n, ms_of_count + 1
  end
  return n or nil
end

local function count_up(key, field, n, strict)
  local after = redis.pcall('HINCRBY', key, field, n)
  if type(after) == 'number' then return after end
  -- Refused by the ACL (NOPERM; Redis 6's words in a script): left as it is, not overwritten.
  if string.sub(after.err, 1, 6) == 'NOPERM' or string.find(after.err, "user executing the script can't", 1, true) then
    if strict then
      local text = "NOPERM this user has no permissions to run the 'hincrby' command on '" .. key
        .. "', or to access that key"
      if redis.acl_check_cmd then error({err = text}) end  -- Redis 7+ keeps the error code
      error(text)  -- Redis 6 raises strings only
    end
    return tonumber(n)
  end
  redis.call('HSET', key, field, n)
  return tonumber(n)
end
