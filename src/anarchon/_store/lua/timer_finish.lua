-- timer_finish: end the caller's firing, and write what follows it.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] meta (hash)
-- KEYS[4] progress (hash): the firing's progress goes once the firing is over
-- KEYS[5] permits (sorted set): the firing's fleet permit is given back
-- KEYS[6] groups (sorted set): its key group's permit too, and the group's waiting
--         timers are looked at again by the next claim
-- (KEYS[5] and KEYS[6], and the group arguments, come from a kind with a fleet limit
-- only: the common finish sends no more than it needs.)
-- ARGV: key, token, outcome (ok | failed | cancelled: given back, not counted as an
--       attempt | interrupted: a lapsed recurrence),
--       max_attempts, retry_delay_ms,
--       next_at_ms, next_delay_ms: the next generation (a rearm, or a recurring timer's
--       next due time), at an instant or after a delay on the server's clock; both ''
--       for none,
--       group_by, group_max, group_permits (max_concurrent_per_group, as timer_claim.lua
--       takes them)
-- Replies {'settled', status, ms}: status r (a retry may start in ms), p (the key's
-- next generation is pending, due in ms), or done (nothing is left of the timer);
-- {'lost', status} when the caller's token no longer holds the firing: nothing changes.
local timers_key, due_key, meta_key, progress_key, permits_key, groups_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local key = ARGV[1]
local token = ARGV[2]
local outcome = ARGV[3]
local max_attempts = tonumber(ARGV[4])
local retry_delay_ms = tonumber(ARGV[5])
local next_at_ms = ARGV[6]
local next_delay_ms = ARGV[7]
local group_by = ARGV[8]
local group_max = tonumber(ARGV[9] or '0')
local group_permits = ARGV[10]

local now = server_now_ms()
local t = decode_timer(redis.call('HGET', timers_key, key))
if t == nil then return {'lost', 'gone'} end
if t == false then return {'lost', 'malformed'} end  -- the claim that meets it reports it
if t.token ~= token then return {'lost', t.status} end
-- The caller finished this attempt already (a finish sent again after a lost reply).
if t.status ~= 'f' then return {'settled', t.status, math.max(t.until_ms - now, 0)} end
drop_permit(permits_key, key)
if group_max > 0 then
  local group = group_of(key, group_by)
  redis.call('ZREM', group_permits .. group, key)
  if redis.call('ZSCORE', groups_key, group) then
    redis.call('ZADD', groups_key, int(now), group)
  end
end

local current = t.gen == t.fire_gen
if current and outcome == 'cancelled' then
  -- Given back (its instance stopped, or lost touch with the server): it did not fail,
  -- so it is not counted. Whichever instance claims first fires it again, at once, as
  -- the same attempt.
  t.status, t.until_ms, t.attempt = 'r', now, t.attempt - 1
  store_timer(timers_key, due_key, key, t)
  return {'settled', 'r', 0}
end
if current and outcome == 'failed' and t.attempt < max_attempts then
  -- Attempts are left: the lease is released; the next attempt starts after the retry
  -- delay, on whichever instance claims first.
  t.status, t.until_ms = 'r', now + retry_delay_ms
  store_timer(timers_key, due_key, key, t)
  return {'settled', 'r', retry_delay_ms}
end

-- This firing is over.
redis.call('HDEL', progress_key, key)
if not current then
  t = after_firing(t)                -- set again, or cancelled, while it fired
elseif next_at_ms ~= '' or next_delay_ms ~= '' then
  local due_ms
  if next_at_ms ~= '' then due_ms = tonumber(next_at_ms) else due_ms = now + tonumber(next_delay_ms) end
  t = pending_timer(next_gen(meta_key), due_ms, t.schedule, t.payload)
else
  t = nil                            -- a one-shot timer that fired: spent
end
store_timer(timers_key, due_key, key, t)
if not t then return {'settled', 'done', 0} end
return {'settled', 'p', math.max(t.due_ms - now, 0)}
