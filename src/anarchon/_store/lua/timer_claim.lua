-- timer_claim: take the caller's share of a kind's due timers, up to a limit.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] meta (hash)
-- KEYS[4] claimed (set): the keys this claim won, kept a lease long, so that a claim
--         sent again after a lost reply (the same token_base) hears of its wins
-- ARGV: limit, lease_ms, runner, token_base (fresh per claim, the same when sent again),
--       max_attempts
-- Replies {wins, next_ms, more, now_ms, spent, malformed}:
--   wins: one {key, gen, due_ms, attempt, fence, token, trigger, schedule, payload,
--         lease_ms} per firing the caller runs now. trigger: due (attempt 1), retry (an
--         attempt that failed), takeover (the runner's lease expired), or lapsed (a
--         recurring timer out of attempts: the caller runs nothing and finishes it as
--         interrupted, with its next due time);
--   next_ms: when the earliest key needs attention next ('' if none);
--   more: 1 when the limit was reached (more may be due now);
--   now_ms: the server's clock, which next_ms is on (the caller's clock may differ);
--   spent: one-shot timers whose runners vanished max_attempts times, forgotten now
--          (the caller says so: nothing else will);
--   malformed: {key, field, problem, excerpt} of each entry that does not read
--          (lease_state.lua): a timer that does not read leaves the due index (its
--          record is left as it is), so that it costs itself alone, not its bucket; a
--          kind's fence beyond 2^53 - 1 stops the kind's wins until it is mended.
local timers_key, due_key, meta_key, claimed_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local limit = tonumber(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local runner = ARGV[3]
local token_base = ARGV[4]
local max_attempts = tonumber(ARGV[5])

local now = server_now_ms()
local wins = {}
local spent = {}
local bad = {}
local mine = token_base .. ':'
-- The kind's last fence, read strictly (nil: beyond 2^53 - 1, nothing wins).
local last = last_fence(meta_key, bad)

local function entry(key, t, trigger, left_ms)
  return {key, int(t.fire_gen), int(t.fire_due_ms), t.attempt, int(t.fence), t.token,
    trigger, t.schedule, t.payload, left_ms}
end

local function win(key, t, attempt, trigger)
  -- Fences follow the server's clock in microseconds (one more than the last within the
  -- same millisecond): they keep growing across a wiped store or a promoted replica.
  local fence = math.max(last + 1, now * 1000)
  last = fence
  redis.call('HSET', meta_key, 'fence', int(fence))
  t.status, t.attempt, t.fence, t.trigger, t.runner = 'f', attempt, fence, trigger, runner
  t.token, t.until_ms = mine .. int(fence), now + lease_ms
  store_timer(timers_key, due_key, key, t)
  redis.call('SADD', claimed_key, key)
  wins[#wins + 1] = entry(key, t, trigger, lease_ms)
end

-- Sent again after a lost reply: the firings it won and still holds are its own.
for _, key in ipairs(redis.call('SMEMBERS', claimed_key)) do
  local t = decode_timer(redis.call('HGET', timers_key, key))
  if t and t.status == 'f' and t.until_ms > now and string.sub(t.token, 1, #mine) == mine then
    wins[#wins + 1] = entry(key, t, t.trigger, t.until_ms - now)
  end
end

local due = {}
if last then
  due = redis.call('ZRANGEBYSCORE', due_key, '-inf', int(now), 'LIMIT', 0, limit)
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
    elseif t.attempt < max_attempts then
      win(key, t, t.attempt + 1, 'takeover')
      t = false
    elseif t.schedule ~= '' then
      win(key, t, t.attempt, 'lapsed')  -- its next due time is the caller's to write
      t = false
    else
      t = nil                        -- a one-shot timer out of attempts: spent
      spent[#spent + 1] = key
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
-- A kind that wins nothing (its fence beyond what it may count) says nothing is due: the
-- caller looks again at its poll, not at once.
if first[2] and last then next_ms = first[2] end
return {wins, next_ms, #due == limit and 1 or 0, int(now), spent, bad}
