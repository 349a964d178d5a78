-- timer_claim: take the caller's share of a kind's due timers, up to a limit.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] meta (hash)
-- KEYS[4] claimed (set): the keys this claim won, kept a lease long, so that a claim
--         sent again after a lost reply (the same token_base) hears of its wins
-- KEYS[5] permits (sorted set: lease_state.lua's fleet permits, one per firing in flight)
-- KEYS[6] starts (sorted set: the firings started within the rate limit's period, by
--         token, scored with when)
-- KEYS[7] groups (sorted set: timer_state.lua's index of key groups with waiting timers)
-- KEYS[8] progress (hash: timer_state.lua's progress of the firings in flight)
-- ARGV: limit, lease_ms, runner, token_base (fresh per claim, the same when sent again),
--       max_attempts,
--       fleet_max (the bucket's share of max_concurrent_fleet; 0: no limit),
--       rate_max, rate_period_ms (the bucket's share of rate_limit: at most rate_max
--       firings start in any rate_period_ms; 0: no limit),
--       group_by, group_max (max_concurrent_per_group: at most group_max firings of a key
--       group at once; '' and 0: none), group_permits, group_waiting (the names of a
--       group's keys, before the group's name)
-- Beyond either limit the due timers wait in the due index, in due order: a claim takes
-- no more than the permits free and the starts the window has left.
-- Replies {wins, next_ms, more, now_ms, spent, malformed, limited}:
--   wins: one {key, gen, due_ms, attempt, fence, token, trigger, schedule, payload,
--         lease_ms, progress} per firing the caller runs now (progress: what the
--         firing's last attempt kept, or ''). trigger: due (attempt 1), retry (an
--         attempt that failed), takeover (the runner's lease expired), or lapsed (a
--         recurring timer out of attempts: the caller runs nothing and finishes it as
--         interrupted, with its next due time);
--   next_ms: when the earliest key needs attention next ('' if none); with a limit
--         reached, no sooner than a permit or the window may free;
--   more: 1 when the limit was reached (more may be due now);
--   now_ms: the server's clock, which next_ms is on (the caller's clock may differ);
--   spent: one-shot timers whose runners vanished max_attempts times, forgotten now
--          (the caller says so: nothing else will);
--   malformed: {key, field, problem, excerpt} of each entry that does not read
--          (lease_state.lua): a timer that does not read leaves the due index (its
--          record is left as it is), so that it costs itself alone, not its bucket; a
--          kind's fence beyond 2^53 - 1 stops the kind's wins until it is mended;
--   limited: the limits reached ('concurrent', 'rate', 'group') while due timers wait.
local timers_key, due_key, meta_key, claimed_key, permits_key, starts_key, groups_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local progress_key = KEYS[8]
local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local runner = ARGV[3]
local token_base = ARGV[4]
local max_attempts = tonumber(ARGV[5])
local fleet_max = tonumber(ARGV[6])
local rate_max = tonumber(ARGV[7])
local rate_period_ms = tonumber(ARGV[8])
local group_by = ARGV[9]
local group_max = tonumber(ARGV[10])
local group_permits = ARGV[11]
local group_waiting = ARGV[12]
-- At most so many groups looked at again, and timers moved back, per claim.
local GROUPS_PER_CLAIM = 16
local BACK_PER_GROUP = 64

local now = server_now_ms()
local wins = {}
local spent = {}
local bad = {}
local mine = token_base .. ':'
-- The kind's last fence, read strictly (nil: beyond 2^53 - 1, nothing wins).
local last = last_fence(meta_key, bad)

local function entry(key, t, trigger, left_ms)
  return {key, int(t.fire_gen), int(t.fire_due_ms), t.attempt, int(t.fence), t.token,
    trigger, t.schedule, t.payload, left_ms, firing_progress(progress_key, key, t, bad)}
end

-- A timer whose group holds every permit waits in the group's waiting set.
local parked = 0
local function park(key, group)
  local score = redis.call('ZSCORE', due_key, key)
  redis.call('ZREM', due_key, key)
  redis.call('ZADD', group_waiting .. group, score or int(now), key)
  local first = redis.call('ZRANGE', group_permits .. group, 0, 0, 'WITHSCORES')
  local when = now + GROUP_RECHECK_MS
  if first[2] then when = math.min(tonumber(first[2]), when) end
  recheck_group(groups_key, group, when)
  parked = parked + 1
end

-- Win the key's next attempt, or (its group holding every permit) park it: false.
local function win(key, t, attempt, trigger)
  if group_max > 0 then
    local group = group_of(key, group_by)
    if not take_permit(group_permits .. group, key, now + lease_ms, now, group_max, bad) then
      park(key, group)
      return false
    end
  end
  -- Fences follow the server's clock in microseconds (one more than the last within the
  -- same millisecond): they keep growing across a wiped store or a promoted replica.
  local fence = math.max(last + 1, now * 1000)
  last = fence
  redis.call('HSET', meta_key, 'fence', int(fence))
  t.status, t.attempt, t.fence, t.trigger, t.runner = 'f', attempt, fence, trigger, runner
  t.token, t.until_ms = mine .. int(fence), now + lease_ms
  store_timer(timers_key, due_key, key, t)
  -- A generation's first attempt starts with nothing kept.
  if trigger == 'due' then redis.call('HDEL', progress_key, key) end
  redis.call('SADD', claimed_key, key)
  if fleet_max > 0 then redis.call('ZADD', permits_key, int(t.until_ms), key) end
  if rate_max > 0 then redis.call('ZADD', starts_key, int(now), t.token) end
  wins[#wins + 1] = entry(key, t, trigger, lease_ms)
  return true
end

-- Sent again after a lost reply: the firings it won and still holds are its own.
for _, key in ipairs(redis.call('SMEMBERS', claimed_key)) do
  local t = decode_timer(redis.call('HGET', timers_key, key))
  if t and t.status == 'f' and t.until_ms > now and string.sub(t.token, 1, #mine) == mine then
    wins[#wins + 1] = entry(key, t, t.trigger, t.until_ms - now)
  end
end

-- What the limits leave: the permits free, the starts left in the window; and when
-- either may free (nil: neither limit is reached).
local take = limit
local frees_at = nil
local reached = {}
if fleet_max > 0 then
  local free, soonest = free_permits(permits_key, nil, now, fleet_max, bad)
  if free < take then
    take = math.max(free, 0)
    if free <= 0 then
      frees_at = now + (soonest or 1)
      reached[#reached + 1] = 'concurrent'
    end
  end
end
if rate_max > 0 then
  -- The window is (now - period, now]: a start at its edge has left it.
  redis.call('ZREMRANGEBYSCORE', starts_key, '-inf', int(now - rate_period_ms))
  -- A start after now is none anarchon wrote (it would hold a place for ever): dropped.
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', starts_key, '(' .. int(now), '+inf',
      'LIMIT', 0, 16)) do
    bad[#bad + 1] = {starts_key, excerpt(member), 'a start after the server clock: dropped', ''}
    redis.call('ZREM', starts_key, member)
  end
  local left = rate_max - redis.call('ZCARD', starts_key)
  if left < take then
    take = math.max(left, 0)
    if left <= 0 then
      local oldest = redis.call('ZRANGE', starts_key, 0, 0, 'WITHSCORES')
      local opens = oldest[2] and tonumber(oldest[2]) + rate_period_ms or now
      frees_at = math.max(frees_at or 0, opens)
      reached[#reached + 1] = 'rate'
    end
  end
end

-- Groups whose waiting timers may go on: as many as they have permits free go back to
-- the due index, oldest first (a timer set, or cancelled, meanwhile is read again).
if group_max > 0 then
  local groups = redis.call('ZRANGEBYSCORE', groups_key, '-inf', int(now),
    'LIMIT', 0, GROUPS_PER_CLAIM)
  for _, group in ipairs(groups) do
    local waiting = group_waiting .. group
    local free, soonest = free_permits(group_permits .. group, nil, now, group_max, bad)
    local back = math.min(math.max(free, 0), BACK_PER_GROUP)
    if back > 0 then
      for _, key in ipairs(redis.call('ZRANGE', waiting, 0, back - 1)) do
        redis.call('ZREM', waiting, key)
        local t = decode_timer(redis.call('HGET', timers_key, key))
        if t then redis.call('ZADD', due_key, int(next_attention_ms(t)), key) end
      end
    end
    if redis.call('ZCARD', waiting) == 0 then
      redis.call('ZREM', groups_key, group)
    else
      local when = now + GROUP_RECHECK_MS
      if free > BACK_PER_GROUP then when = now
      elseif soonest then when = math.min(now + soonest, when) end
      redis.call('ZADD', groups_key, int(when), group)
    end
  end
end

local due = {}
if last and take > 0 then
  due = redis.call('ZRANGEBYSCORE', due_key, '-inf', int(now), 'LIMIT', 0, take)
end
for _, key in ipairs(due) do
  local raw = redis.call('HGET', timers_key, key)
  local t, problem = decode_timer(raw)
  if t == false then
    bad[#bad + 1] = {timers_key, excerpt(key), problem .. ': it left the due index',
      excerpt(raw)}
    redis.call('ZREM', due_key, key)
    t = true                         -- skipped below: nothing else to do with it
  end
  if t == true then
    -- a malformed timer, reported above
  elseif t and t.status == 'f' and t.until_ms <= now then
    -- The lease expired: its runner vanished, and that attempt is over.
    if t.gen ~= t.fire_gen then
      t = after_firing(t)            -- set again or cancelled meanwhile: nothing follows
      redis.call('HDEL', progress_key, key)
    elseif t.attempt < max_attempts then
      win(key, t, t.attempt + 1, 'takeover')
      t = false
    elseif t.schedule ~= '' then
      win(key, t, t.attempt, 'lapsed')  -- its next due time is the caller's to write
      t = false
    else
      t = nil                        -- a one-shot timer out of attempts: spent
      spent[#spent + 1] = key
      redis.call('HDEL', progress_key, key)
    end
    if t ~= false then store_timer(timers_key, due_key, key, t) end
  end
  if t == true then
    -- reported above
  elseif not t then
    if t == nil then store_timer(timers_key, due_key, key, nil) end
  elseif t.status == 'r' and t.until_ms <= now then
    if t.gen == t.fire_gen then
      win(key, t, t.attempt + 1, 'retry')
    else
      store_timer(timers_key, due_key, key, after_firing(t))
      redis.call('HDEL', progress_key, key)
    end
  elseif t.status == 'p' and t.due_ms <= now then
    t.fire_gen, t.fire_due_ms = t.gen, t.due_ms
    win(key, t, 1, 'due')
  else
    store_timer(timers_key, due_key, key, t)  -- not due after all: scored again
  end
end
if #wins > 0 then redis.call('PEXPIRE', claimed_key, lease_ms) end

local first = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
local next_ms = ''
local limited = {}
if first[2] and tonumber(first[2]) <= now then limited = reached end
if parked > 0 then limited[#limited + 1] = 'group' end
-- A kind that wins nothing (its fence beyond what it may count) says nothing is due: the
-- caller looks again at its poll, not at once.
if first[2] and last then
  next_ms = first[2]
  if frees_at and tonumber(first[2]) < frees_at then next_ms = int(frees_at) end
end
if group_max > 0 and last then
  -- The soonest a group's waiting timers may go on.
  local group = redis.call('ZRANGE', groups_key, 0, 0, 'WITHSCORES')
  if group[2] and (next_ms == '' or tonumber(group[2]) < tonumber(next_ms)) then
    next_ms = int(tonumber(group[2]))
  end
end
return {wins, next_ms, (take > 0 and #due == take) and 1 or 0, int(now), spent, bad, limited}
