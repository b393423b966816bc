--[[ move: move due messages onto their destination lists, oldest bucket first.

KEYS[1] index   ZSET  <ns>index     member = score = start of a bucket holding messages
KEYS[2] ids     HASH  <ns>ids       task id -> refs (see put in _put.lua)
KEYS[3] counts  HASH  <ns>counts    destination list key -> scheduled count
KEYS[4] totals  HASH  <ns>totals    lifetime counters
KEYS[5] gc      ZSET  <ns>gc        drained buckets whose id-index refs are still to drop
ARGV[1] ns       key namespace, "<global_keyprefix>kombu_delay:"
ARGV[2] limit    most messages moved in this call (task ids cleaned up count as well)
ARGV[3] max_len  hold a destination while its list has this many items or more (0 = never);
                 the messages this call pushes count too, so a list never passes max_len
ARGV[4] after    '' to scan the started buckets from the first, or the bucket start the
                 previous call's scan stopped at (its reply's scan_after), to go on after it
ARGV[5] now_ms   epoch ms to judge "due" by; '' = Redis TIME (the production path; tests
                 drive time through it)
ARGV[6] ahead_ms optional look-ahead, ms: also move what falls due by now + ahead_ms (the
                 message keeps its ETA, the worker starts it then; its lateness reads 0); ''
                 or absent = 0
ARGV[7] whole    optional: '0' to move a staged herd in batches instead of handing it over
                 whole (a caller with a rate cap); absent or '1' = hand it over
ARGV[8] exact_ms optional: next_due_ms need be exact only where it is due within this many ms
                 of now + ahead_ms (the caller's longest sleep): a bucket that starts later
                 is told by its start, and nothing of it is read; absent or '' = exact
ARGV[9] deadline optional: epoch ms by the clock the call judges by (ARGV[5]): a call that
                 runs later than this moves nothing (its reply: nothing moved, more, and
                 scan_after -2: late; see below and kombu_delay/store/clock.py GiveUp); absent
                 or '' = none
Returns: {moved, next_due_ms (-1 if nothing scheduled), now_ms, now_us (0..999 past now_ms),
          held, expired, wrongtype, more (1 if the limit was reached, clean-up is left, the
          scan stopped short, or members were recounted), scan_after (-1, or the start to
          pass as ARGV[4] next; -2: the call came past its deadline, ARGV[9]), recounted (members found in a bucket whose counts read zero:
          added by hand, or counted in a meta hash that is gone, see recount in
          _buckets.lua; and those a move took past its bucket's count), refused (due
          messages left where they are because this user's ACL refuses LPUSH onto their
          destination), vanished (buckets let go that had lost their
          meta hash, with no sorted set found for any destination <ns>counts names: deleted by
          hand, evicted, or expired after no mover ran for their grace plus a day; what they
          held is lost, and nothing is left to count it by, nor, with <ns>counts lost too, to
          find a set by; counted in the totals field vanished_buckets), {the refused destinations,
          at most MAX_NAMED}, {the destinations that are no list, likewise}, {a bucket's keys
          found of another type (written by hand), each followed by the name it was renamed
          to (a meta hash: set_aside in _buckets.lua) or '' (a sorted set, whose messages
          are lost, counted in expired; or a meta hash RENAME was refused for), at most
          MAX_NAMED of them}, lateness...}
         with the lateness (now - due, ms, >= 0) of each moved message in move order,
         run-length coded: a run of n > 1 equal values is -n followed by the value.
         A destination the ACL refuses is left as a full one is (held): nothing of it is
         taken, and the other destinations' messages move. Redis 7+ is asked first
         (room_of in _push.lua); on Redis 6 the LPUSH comes before the removal (move_head),
         and its refusal is told the same way.
Raises: when Redis refuses anything else (the removal's ACL, maxmemory, a read-only
        replica), before anything of that destination is taken.
Bound: moves at most ARGV[2] messages, and about CALL_BYTES of them (a batch is read in
       chunks that stop once CALL_BYTES are read, at least one message, see read_ranks in
       _chunks.lua: ten 10 MB messages must not hold Redis for seconds in one call, nor a
       small one ahead of them take them all), and visits at most ARGV[2] buckets; a held, refused or
       wrong-type destination costs one ZCOUNT per bucket, its messages are not read (on
       Redis 6, where only a push tells that the LPUSH command itself is refused, its head's
       is: see move_head).
       The exception is a herd staged ahead (stage.lua, _staged.lua): its run is handed over
       whole, however large, at the cost of a few commands and of copying at most 20 x ARGV[2]
       messages of its copy and 20 x ARGV[2] already on the list, about CALL_BYTES of them in
       all, and 100 x ARGV[2] of its set after it (see hand_over in _handover.lua), and ends
       the call. ARGV[7] '0' forbids it
       (a rate-capped mover: the herd then moves in batches).
       A bucket whose due messages are all held costs no move budget, so when more such
       buckets than ARGV[2] lie ahead, the scan stops after ARGV[2] of them and the next call
       goes on from there (scan_after): the buckets behind them are never starved.
       A bucket with nothing due costs one HMGET while nothing was stored into it since a call
       last read its queues (its known earliest due time, see known_earliest), else one ZCOUNT
       per queue, and no message is read for its next due time.

A bucket keeps one sorted set per destination, whose members are the payloads themselves, so
a batch goes from one sorted set to one list with no per-message work in Lua: ZRANGE (or
ZRANGEBYSCORE) from the head, LPUSH, ZREMRANGEBYRANK of the same ranks (see move_head for the
order). Messages are pushed and removed inside this one script, so a crash can neither lose
nor duplicate one, and several movers can run it at once: a member another mover already
moved is simply not there.

The id index is not touched here: once a bucket is drained it waits in <ns>gc until its end
(nothing can be scheduled into it after that), and then its task-id list drives the clean-up
of its refs, in this script's leftover budget, so a burst is never slowed by it.
]]
--- @include clock
--- @include refs
--- @include push
--- @include lateness
--- @include spaces
--- @include buckets
--- @include handover
--- @include chunks
--- @include earliest
local index, ids, counts, totals, gc = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local floor, sub = math.floor, string.sub
local ns = ARGV[1]
local limit = tonumber(ARGV[2])
local max_len = tonumber(ARGV[3])

-- A shared key of another type (written by hand) would fail the call after its pushes, when it
-- counts them: delivered, and missing from the counts and the totals. Refused first instead,
-- naming the key (a TYPE each, per call, not per message).
local refused_keys = wrong_types({{counts, 'hash'}, {totals, 'hash'}, {ids, 'hash'}, {gc, 'zset'}})
if refused_keys then return refused_keys end

local now, now_us = clock(ARGV[5])
-- A call the server reads late (it was paused, say) may run where a failover has promoted a
-- replica meanwhile, on which its mover moves the same messages once it finds it: what this
-- call pushed here, a worker still blocked here would take, and both would run. Past the
-- deadline its mover gave it, it does nothing, and says so.
local deadline = tonumber(ARGV[9] or '')
if deadline and now >= deadline then return {0, now, now, now_us, 0, 0, 0, 1, -2, 0, 0, 0, {}, {}, {}} end
local ahead = tonumber(ARGV[6] or '') or 0
local whole = ARGV[7] ~= '0'
-- What this call moves: due by now + ahead (reach), except in a bucket marked as holding a
-- message with no ETA of its own (an x-delay, mark_no_eta in _put.lua), which a worker runs on
-- arrival: there, due by now. visit sets due_by and upper per bucket.
local reach = now + ahead
local reach_upper = '(' .. string.format('%d', reach + 1)  -- floor(score) <= reach, never earlier
local now_upper = '(' .. string.format('%d', now + 1)
local due_by, upper = reach, reach_upper
local k = in_space({ns = ns, gc = gc}, '')  -- movers push from the ordinary space only
local s = k.space

local moved, held, expired, wrong, recounted, refused, vanished = 0, 0, 0, 0, 0, 0, 0
-- Members a move took past what the bucket's meta hash counted (added by hand, or counted in
-- a meta hash made anew since): recounted as they go, as recount counts those it finds.
local missed = 0
-- The destinations refused, or no list, named in the reply for the mover's warnings: a few
-- are enough.
local MAX_NAMED = 10
local refused_names, wrong_names, named = {}, {}, {}
-- A bucket's keys of another type (written by hand), each with what it was renamed to ('' where
-- it was not): {key, new name, key, new name, ...}, for the mover's errors.
local damaged = {}

local function name_damaged(key, aside)
  if #damaged < 2 * MAX_NAMED then
    damaged[#damaged + 1] = key
    damaged[#damaged + 1] = aside
  end
end

local function name_once(names, dest)
  if not named[dest] and #names < MAX_NAMED then
    named[dest] = true
    names[#names + 1] = dest
  end
end

-- Counts ``waiting`` due messages of dest that stay where they are: held (a full list), not
-- a list, or refused by the ACL (``left``: room_of's answer).
local function left_waiting(dest, left, waiting)
  if left == NOT_A_LIST then
    wrong = wrong + waiting
    name_once(wrong_names, dest)
  elseif left == REFUSED then
    refused = refused + waiting
    name_once(refused_names, dest)
  else
    held = held + waiting
  end
end
local add_late, finish_lateness = lateness_runs()
local budget = limit
-- Bytes a call moves, about: each batch is read in chunks that stop once they are read
-- (read_ranks), and is never more messages than fit at its head message's size.
local bytes_left = CALL_BYTES
local room, room_of = room_keeper(max_len)

-- Moves the due head of one sorted set, at most `take` messages and about bytes_left of them
-- (read_ranks; ``head``, its first member and score as the visit read them, or nil); returns
-- how many.
local function move_batch(zset, dest, due_first, take, head)
  -- When the next `take` members are all due at the same millisecond, one number is the
  -- lateness of all, and the batch is read without scores and pushed as it came. Otherwise
  -- each member comes with its score.
  local pushes, scores, used
  local same = redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', due_first + 1))
  if same >= take then
    pushes, used = read_ranks('ZRANGE', zset, 0, take, bytes_left, nil, head)
  else
    pushes, used, scores = read_ranks('ZRANGE', zset, 0, take, bytes_left, due_by + 1, head)
  end
  local got = #pushes
  if got > 0 then
    -- Push, then remove: Redis does not undo a script's earlier writes when it refuses a later
    -- command, so a refused LPUSH (an ACL that Redis 6 cannot check beforehand) must come
    -- before anything is taken. The empty ZREMRANGEBYRANK first removes nothing, but Redis
    -- checks the ACL on it, and it is this script's first write: under maxmemory Redis refuses
    -- a script whose first write may grow memory, and movers must keep moving then.
    -- The batch is ranks 0 .. got - 1: removing by rank spares copying each member back out of
    -- Lua and searching the skip list for it.
    checked_call('ZREMRANGEBYRANK', zset, 1, 0)
    if not pushed(dest, pushes) then  -- Redis 6: the ACL refused this destination
      room[dest] = REFUSED
      left_waiting(dest, REFUSED, redis.call('ZCOUNT', zset, '-inf', upper))
      return 0
    end
    bytes_left = bytes_left - used
    if scores then
      for i = 1, got do add_late(math.max(0, now - floor(tonumber(scores[i]))), 1) end
    else
      add_late(math.max(0, now - due_first), got)
    end
    redis.call('ZREMRANGEBYRANK', zset, 0, got - 1)
  end
  return got
end

-- move_batch, except that Redis 6, which cannot be asked whether this user may push onto
-- dest, first pushes the due head alone onto a destination not pushed onto yet in this call:
-- a refusal, told again on every poll while it lasts, then costs the read of one member, not
-- of a batch.
local confirmed = {}
local function move_head(zset, dest, due_first, take, head)
  if redis.acl_check_cmd or confirmed[dest] or take == 1 then
    return move_batch(zset, dest, due_first, take, head)
  end
  local got = move_batch(zset, dest, due_first, 1, head)
  if got == 0 then return 0 end
  confirmed[dest] = true
  return got + move_batch(zset, dest, due_first, take - 1)
end

-- A staged run of dest at the head of its set, due: handed over whole when its copy is good
-- and the destination takes it (no max length); else the copy is dropped and nil returned
-- (batches).
local function handed_over(meta, start_s, zset, dest, due_first, left, t)
  local n = tonumber(redis.call('HGET', meta, 'hn:' .. dest))
  if n and t == due_first and left == math.huge and whole then
    local got = hand_over(s, meta, start_s, zset, dest, t, n, 20 * limit, 100 * limit)
    if got then return got end
  else
    drop_staged(s, meta, start_s, dest)
  end
end

-- Moves what is due in dest's set, at most take: a staged run whole (returns its size and true)
-- or a batch (returns its size), which stops short of a staged run behind it, so that the run
-- goes whole in the next call. ``head``: the set's first member and score, as the visit read them.
local stopped = {}  -- destinations whose move stopped short of a staged run in this call
local function move_due_head(meta, start_s, zset, dest, due_first, left, take, t, head)
  if t and due_first < t then
    -- A run due now goes whole in the next call: the queue's later buckets wait for it, or a
    -- consumer would get their messages before the run's.
    if t <= due_by then stopped[dest] = true end
    local before = redis.call('ZCOUNT', zset, '-inf', '(' .. string.format('%d', t))
    return move_head(zset, dest, due_first, math.min(take, before), head)
  end
  if not t then return move_head(zset, dest, due_first, take, head) end
  local got = handed_over(meta, start_s, zset, dest, due_first, left, t)
  if got then
    add_late(math.max(0, now - due_first), got)
    return got, true
  end
  return move_head(zset, dest, due_first, take)  -- (read again: past a handover that gave up)
end

-- The next due time of a bucket that its visit settled, for earliest_in, which then reads
-- nothing of it again: one passed over by its noted earliest due time (known_earliest), or one
-- whose visit looked at every queue and left due messages waiting (held, refused, not a list):
-- theirs (a mover polls such a bucket every 50 ms, and each call read every queue twice:
-- 10,000 queues and one full list, Redis at 60 to 75 %). Plus the look-ahead in a bucket
-- marked no-ETA.
local visited_due = {}

-- A bucket's earliest due time as its queues are read one by one (visit, earliest_in): the
-- earlier of ``best`` (nil: none found yet) and the due time of the first member of ``zset``,
-- which holds one before best and none due before ``lo`` (head_due, no message read), in a
-- bucket that ends at ``end_ms`` (nil: not known).
local function earlier_head(zset, lo, best, end_ms)
  local due = head_due(zset, lo, best and best - 1 or math.max(lo, (end_ms or MAX_DUE_MS) - 1))
  if due and (not best or due < best) then return due end
  return best
end

-- Notes ``best``, a bucket's earliest due time found by reading every queue, for the next
-- calls (known_earliest in _earliest.lua), with the seq counter ``seq`` as it read it; best
-- effort (a write maxmemory may refuse).
local function note_earliest(meta, seq, best)
  if seq then redis.pcall('HSET', meta, 'ls', seq, 'le', string.format('%d', best)) end
end

-- Moves what is due in one started bucket, within the budget; retires it once drained.
local function visit(start_s)
  local meta = s:meta(start_s)
  local known, no_eta = known_earliest(meta)
  if known and known > reach then  -- nothing due, nothing drained since the last look
    visited_due[start_s] = known + (no_eta and ahead or 0)
    return
  end
  local fields = redis.pcall('HGETALL', meta)
  if other_type(fields, 'HGETALL', meta) then
    -- A meta hash replaced by a key of another type (by hand): set aside, and the bucket
    -- counted again from its sets, moved by the next call; where that is refused, nothing of
    -- it can be counted or moved, and one such bucket must not stop every move.
    local aside, n = set_aside(k, start_s, now)
    if aside then recounted = recounted + n else expired = expired + n end
    name_damaged(meta, aside or '')
    return
  end
  local end_ms, seq, left_total = nil, nil, 0
  local expiry, pushed, marks, wake_mark = {}, {}, {}, nil
  local whole_visit, waiting_first = true, nil
  due_by, upper = reach, reach_upper
  -- The marks first (of staged runs, the wake mark, no ETA), the end and the seq counter: the
  -- fields come in any order.
  for i = 1, #fields, 2 do
    local name = fields[i]
    if sub(name, 1, 2) == 'h:' then
      marks[sub(name, 3)] = mark_of(fields[i + 1])  -- (nil for junk written by hand)
    elseif name == 'w' then
      wake_mark = ms_of(fields[i + 1])
    elseif name == 'n' then
      due_by, upper = now, now_upper
    elseif name == 'end' then
      end_ms = count_of(fields[i + 1])
    elseif name == 'seq' then
      seq = fields[i + 1]
    end
  end
  -- The bucket's next due time, found as its queues are looked at (as earliest_in does, which
  -- then reads nothing of the bucket again): the earliest due time of a message not due yet,
  -- ``best``, and the ZCOUNT bound of what lies before it. A queue with nothing before it has
  -- nothing due either, and costs one ZCOUNT; only one with an earlier message is searched
  -- (head_due, no message read), a few of them with queues in any order. (10,000 queues
  -- in a started bucket: each move call read every queue in two passes, three commands each.)
  local best, best_text = nil, '+inf'
  local function lower_best(zset)  -- zset holds a message before best, none due by due_by
    best = earlier_head(zset, due_by + 1, best, end_ms)
    if best then best_text = '(' .. string.format('%d', best) end
  end
  for i = 1, #fields, 2 do
    local name, n = fields[i], count_of(fields[i + 1])
    if sub(name, 1, 2) == 'e:' then
      expiry[sub(name, 3)] = n
    elseif sub(name, 1, 2) == 'q:' and (n or 0) > 0 and (budget <= 0 or stopped[sub(name, 3)]) then
      whole_visit = false
    elseif sub(name, 1, 2) == 'q:' and (n or 0) > 0 then
      local dest = sub(name, 3)
      local zset = s:zset(start_s, dest)
      -- Nothing due in a set that is there: no message read (its first one, read for its due
      -- time, cost a started bucket of 10,000 queues, or of messages of MBs, 0.1 s a call).
      -- Nothing before best is nothing due; with no best yet, nothing at all is a set gone.
      local before = redis.pcall('ZCOUNT', zset, '-inf', best_text)
      local waiting = before == 0 and best
      if type(before) == 'number' and before > 0 and redis.call('ZCOUNT', zset, '-inf', upper) == 0 then
        waiting = true
        lower_best(zset)
      end
      local head = not waiting and redis.pcall('ZRANGE', zset, 0, 0, 'WITHSCORES')
      if waiting then  -- (nothing due yet: left as it is)
      elseif other_type(head, 'ZRANGE', zset) or not head[2] then
        -- Gone while counted: expired after its grace, or deleted or replaced by hand (a key
        -- of another type, left as it is, and named: one such key must not stop every move).
        if head.err then name_damaged(zset, '') end
        expired = expired + n
        settle_gone(meta, name, counts, dest, n)
        n = 0
      else
        local due_first = floor(tonumber(head[2]))
        if due_first <= due_by then
          local left = room_of(dest)
          if left <= 0 then
            left_waiting(dest, left, redis.call('ZCOUNT', zset, '-inf', upper))
            waiting_first = math.min(waiting_first or due_first, due_first)
          else
            local size = #head[1] + 64  -- with what each message costs beside its bytes
            local fits, want = math.max(1, floor(bytes_left / size)), math.min(budget, left)
            local got, handed = move_due_head(meta, start_s, zset, dest, due_first, left,
                                              math.min(want, fits), marks[dest], head)
            -- One herd per call, and about CALL_BYTES (move_batch counts what it reads): the
            -- next call goes on at once (more).
            local cut = bytes_left <= 0 or (got == fits and fits < want)
            budget = (handed or cut) and 0 or budget - got
            if got > n then missed = missed + got - n end
            if got > 0 then
              pushed[#pushed + 1] = dest
              room[dest] = left - got
              moved = moved + got
              n = n - got
              uncount_meta(meta, name, got)
              uncount(counts, dest, got, true)  -- (its lists entry: after the renewal below)
            end
            local still = 0
            if room[dest] == 0 then  -- the list just filled up: what is still due is held
              still = redis.call('ZCOUNT', zset, '-inf', upper)
              held = held + still
            end
            if still > 0 or room[dest] < 0 then  -- (Redis 6: its push refused, see move_head)
              waiting_first = math.min(waiting_first or due_first, due_first)
            elseif redis.call('ZCOUNT', zset, '-inf', best_text) > 0 then  -- what the move left
              if redis.call('ZCOUNT', zset, '-inf', upper) > 0 then
                -- Still due: cut short (CALL_BYTES) or stopped before a staged run.
                waiting_first = math.min(waiting_first or due_first, due_first)
              else
                lower_best(zset)
              end
            end
          end
        end
      end
    end
    if n and sub(name, 1, 2) == 'q:' and n > 0 then left_total = left_total + n end
  end
  -- A queue declared with x-expires: the push renews its list's expiry, as kombu's would.
  -- Best effort, as kombu's own renewal (a refusal, say an ACL without PEXPIRE, must not
  -- stop the mover: the next publish or read of the queue renews it). Only a positive one: a
  -- publish writes no other, and PEXPIRE of 0 or less (written by hand) deletes the list.
  -- A queue's last scheduled message: its entry in <ns>lists goes (the next publish, first in
  -- its bucket, writes it again), or one for every such queue that ever was would stay; also
  -- where this bucket's meta hash notes no expiry for it (one lost, and counted again since, or
  -- one whose publishers did not know the queue's x-expires: the next publish that does writes
  -- the entry again, see put_counted in _put.lua), looked for only where <ns>lists exists (one
  -- EXISTS a bucket visited).
  local lists, lists_kept = ns .. 'lists', nil
  for _, dest in ipairs(pushed) do
    local ttl = expiry[dest]
    if ttl and ttl > 0 then renew_lists(lists, dest, ttl) end
    if not ttl and lists_kept == nil then lists_kept = redis.call('EXISTS', lists) == 1 end
    if (ttl or lists_kept) and (tonumber(redis.call('HGET', counts, dest)) or 0) <= 0 then
      redis.pcall('HDEL', lists, dest)
    end
  end
  -- The bucket's wake mark, once its message is due (moved, or held): a later publish must not
  -- take it for one still waiting, whatever its own clock says (wake_if_first in _put.lua).
  if wake_mark and wake_mark <= due_by then redis.call('HDEL', meta, 'w') end
  if whole_visit and budget > 0 and waiting_first then
    visited_due[start_s] = waiting_first + (due_by < reach and ahead or 0)
  elseif whole_visit and budget > 0 and best and left_total > 0 then
    -- Every queue looked at, nothing due left: best is the bucket's earliest due time, noted
    -- for the next calls (known_earliest) as earliest_in would note it.
    visited_due[start_s] = best + (due_by < reach and ahead or 0)
    note_earliest(meta, seq, best)
  end
  if left_total == 0 then
    -- Drained (or only counted members that are gone): the bucket leaves the index, unless
    -- its sorted sets hold members its counts missed (then counted again, moved next call).
    local found = retire(k, start_s, end_ms, now)
    recounted = recounted + found
    -- No meta hash and nothing found (recount looks in the sets of every destination
    -- <ns>counts names): the bucket vanished whole (a drained one keeps its meta hash a
    -- day). A member of the index that names no bucket (by hand) is no bucket.
    if #fields == 0 and found == 0 and string.find(start_s, '^%d+$') and #start_s <= 15 then
      vanished = vanished + 1
    end
  end
end

local visits, scan_after = limit, -1
local lower = '-inf'
local after = ARGV[4] or ''
if after ~= '' then lower = '(' .. after end
while budget > 0 and visits > 0 do
  local page = math.min(visits, 256)
  local starts = redis.call('ZRANGEBYSCORE', index, lower, reach, 'LIMIT', 0, page)
  for _, start_s in ipairs(starts) do
    if budget <= 0 then break end
    visit(start_s)
    visits = visits - 1
    lower = '(' .. start_s
    if visits == 0 and budget > 0 then scan_after = tonumber(start_s) end
  end
  if #starts < page then break end
end

-- Clean-up, in the budget the moves left: the refs of drained buckets whose end has passed.
local cleanup_left = 0
if budget > 0 then
  local ended = redis.call('ZRANGEBYSCORE', gc, '-inf', now, 'LIMIT', 0, limit)
  for _, start_s in ipairs(ended) do
    if budget <= 0 then
      cleanup_left = 1
      break
    end
    if redis.call('ZSCORE', index, start_s) then
      redis.call('ZREM', gc, start_s)  -- scheduled into again: it comes back when it drains
    elseif not drained_counts(s:meta(start_s)) then
      -- Scheduled into again, and out of the index all the same: the index was lost (evicted
      -- or deleted) after a publish put it back. Back into the index, not deleted with its
      -- messages (reindex.lua would find it only minutes later).
      redis.call('ZADD', index, tonumber(start_s), start_s)
      redis.call('ZREM', gc, start_s)
      count_up(totals, 'reindexed', 1)
    else
      local tasks = s:tasks(start_s)
      local chunk = redis.pcall('LRANGE', tasks, 0, budget - 1)
      if other_type(chunk, 'LRANGE', tasks) then
        -- Its task-id list replaced by a key of another type (by hand): its refs cannot be
        -- found, and stay in the id index, naming nothing (find and cancel drop such a ref).
        -- The bucket is let go all the same, counted, the key left as it is.
        redis.call('ZREM', gc, start_s)
        redis.call('DEL', s:meta(start_s))
        count_up(totals, 'unreadable', 1)
        budget = budget - 1
      elseif #chunk < budget then
        drop_start_refs(ids, chunk, start_s)
        drop_every_staged(s, s:meta(start_s), start_s)
        redis.call('DEL', tasks, s:meta(start_s))
        redis.call('ZREM', gc, start_s)
        budget = budget - math.max(1, #chunk)
      else
        drop_start_refs(ids, chunk, start_s)
        redis.call('LTRIM', tasks, #chunk, -1)
        budget = 0
        cleanup_left = 1
      end
    end
  end
end

if moved > 0 then count_up(totals, 'moved', moved) end
if expired > 0 then count_up(totals, 'expired', expired) end
if vanished > 0 then count_up(totals, 'vanished_buckets', vanished) end
if missed > 0 then
  count_up(totals, 'recounted', missed)
  recounted = recounted + missed
end

-- The earliest due time still scheduled. With one bucket width the first bucket holds it;
-- publishers with different widths may leave a narrower bucket that starts after a wider
-- one's start yet holds an earlier message, so the buckets starting before the best due
-- time found so far are looked at too (none with one width).
-- In a bucket marked as holding a message with no ETA of its own, that is the due time plus
-- the look-ahead: the time the mover, which calls ahead of the due time it is given, may move
-- it.
-- Past the horizon (ARGV[8]), a bucket's start stands for it: it holds nothing due before.
local horizon = tonumber(ARGV[8] or '') and now + ahead + tonumber(ARGV[8])

-- The earliest due time in a bucket, by its known earliest where nothing was stored into it
-- since (known_earliest in _earliest.lua), else by reading its queues, noted then for the next
-- calls. A queue whose set holds nothing before the earliest found so far costs one ZCOUNT;
-- only one that holds an earlier message is searched (head_due, no message read), a few of
-- them with queues in any order.
local function earliest_in(start_s)
  local start = tonumber(start_s)
  if horizon and (start or -1) >= horizon then return start end
  if visited_due[start_s] then return visited_due[start_s] end
  local meta = s:meta(start_s)
  local known, no_eta = known_earliest(meta)
  -- (One in reach is a bound the visit has just passed, or a held message's: read again.)
  if known and known > reach then return known + (no_eta and ahead or 0) end
  local fields = redis.pcall('HGETALL', meta)
  if other_type(fields, 'HGETALL', meta) or not start then return nil end  -- the visit takes it out
  local best, later, seq, end_ms, below_text = nil, 0, nil, nil, nil
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'n' then
      later = ahead
    elseif name == 'seq' then
      seq = fields[i + 1]
    elseif name == 'end' then
      end_ms = ms_of(fields[i + 1])
    end
  end
  for i = 1, #fields, 2 do
    local name = fields[i]
    if sub(name, 1, 2) == 'q:' and (tonumber(fields[i + 1]) or 0) > 0 then
      local zset = s:zset(start_s, sub(name, 3))
      local earlier = redis.pcall('ZCOUNT', zset, '-inf', below_text or '+inf')
      if type(earlier) == 'number' and earlier > 0 then  -- (a key of another type: the visit settles it)
        best = earlier_head(zset, start, best, end_ms)
        below_text = best and '(' .. string.format('%d', best)
      end
    end
  end
  if best then note_earliest(meta, seq, best) end
  return best and best + later
end

local next_due = -1
local first = redis.call('ZRANGE', index, 0, 0)[1]
if first then
  next_due = earliest_in(first) or tonumber(first)  -- counted but gone: settle it now
  for _, start_s in ipairs(redis.call('ZRANGEBYSCORE', index, '(' .. first, next_due, 'LIMIT', 0, 16)) do
    local due = earliest_in(start_s)
    if due and due < next_due then next_due = due end
  end
end
local more = 0
if budget <= 0 or cleanup_left == 1 or scan_after >= 0 or recounted > 0 then more = 1 end
local reply = {moved, next_due, now, now_us, held, expired, wrong, more, scan_after, recounted, refused,
               vanished, refused_names, wrong_names, damaged}
finish_lateness(reply)
return reply
