--[[ purge: remove the scheduled envelopes bound for some destination lists (one queue's keys).

KEYS[1] index   ZSET  <ns>buckets   member = score = bucket start (epoch ms)
KEYS[2] ids     HASH  <ns>ids       task id -> "start:offset:seq[ start:offset:seq...]"
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] limit    most envelopes plus buckets examined in this call
ARGV[3] start    cursor: bucket start to resume at, epoch ms (0 to begin)
ARGV[4] score    cursor: score to resume at inside that bucket ("-inf" to begin)
ARGV[5] tie      cursor: members kept at exactly that score that were already examined
ARGV[6..] dest   destination list keys to purge (a queue's priority lists)
Returns: {removed, done, start, score, tie}; done 0 means call again with the cursor.
Bound: examines at most ARGV[2] envelopes and ARGV[2] buckets.

A bucket whose meta hash counts none of these destinations is skipped without reading it,
and a bucket is left as soon as the meta says none of them remain in it. The cursor is a
score, never a rank, so moves from the head of a bucket cannot make it skip members.
]]
local index, ids, counts, totals = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ns = ARGV[1]
local limit = tonumber(ARGV[2])
local cursor_start = ARGV[3]
local cursor_score, cursor_tie = ARGV[4], tonumber(ARGV[5])
local wanted, fields = {}, {}
for i = 6, #ARGV do
  wanted[ARGV[i]] = true
  fields[#fields + 1] = 'q:' .. ARGV[i]
end

local removed_total = 0
local budget = limit
local starts = redis.call('ZRANGEBYSCORE', index, cursor_start, '+inf', 'LIMIT', 0, limit)
for _, start_s in ipairs(starts) do
  if budget <= 0 then
    return {removed_total, 0, start_s, '-inf', 0}
  end
  budget = budget - 1
  local bucket = ns .. 'bucket:' .. start_s
  local meta = ns .. 'meta:' .. start_s
  local from, tie = '-inf', 0
  if start_s == cursor_start then from, tie = cursor_score, cursor_tie end
  local left = 0
  if #fields > 0 then
    for _, v in ipairs(redis.call('HMGET', meta, unpack(fields))) do
      if v then left = left + math.max(0, tonumber(v)) end
    end
  end
  -- An expired bucket (meta without members) is the mover's to settle.
  if left > 0 and redis.call('EXISTS', bucket) == 1 then
    while left > 0 do
      if budget <= 0 then
        if removed_total > 0 then redis.call('HINCRBY', totals, 'purged', removed_total) end
        return {removed_total, 0, start_s, from, tie}
      end
      local batch = redis.call('ZRANGEBYSCORE', bucket, from, '+inf', 'WITHSCORES', 'LIMIT', tie, budget)
      if #batch == 0 then break end
      local removed, per_dest, order = {}, {}, {}
      local task_ids, scores = {}, {}
      for i = 1, #batch, 2 do
        local member, score_s = batch[i], batch[i + 1]
        budget = budget - 1
        if score_s ~= from then from, tie = score_s, 0 end
        local _, hdr_end, il, dl = string.find(member, '^(%d+):(%d+):')
        local dest
        if hdr_end then
          il, dl = tonumber(il), tonumber(dl)
          dest = string.sub(member, hdr_end + il + 1, hdr_end + il + dl)
        end
        if dest and wanted[dest] then
          removed[#removed + 1] = member
          if not per_dest[dest] then
            per_dest[dest] = 0
            order[#order + 1] = dest
          end
          per_dest[dest] = per_dest[dest] + 1
          task_ids[#task_ids + 1] = string.sub(member, hdr_end + 1, hdr_end + il)
          scores[#scores + 1] = tonumber(score_s)
        else
          tie = tie + 1
        end
      end
      if #removed > 0 then
        redis.call('ZREM', bucket, unpack(removed))
        drop_refs(ids, task_ids, function(i) return score_ref(start_s, scores[i]) end)
        removed_total = removed_total + #removed
        left = left - #removed
      end
      for _, dest in ipairs(order) do
        local n = per_dest[dest]
        if redis.call('HINCRBY', counts, dest, -n) <= 0 then redis.call('HDEL', counts, dest) end
        redis.call('HINCRBY', meta, 'q:' .. dest, -n)
      end
    end
    if redis.call('EXISTS', bucket) == 0 then
      redis.call('DEL', meta)
      redis.call('ZREM', index, start_s)
    end
  end
end
if removed_total > 0 then redis.call('HINCRBY', totals, 'purged', removed_total) end
if #starts >= limit then
  -- The next call resumes after the last bucket examined here.
  return {removed_total, 0, string.format('%d', tonumber(starts[#starts]) + 1), '-inf', 0}
end
return {removed_total, 1, '0', '-inf', 0}
