-- Shared definitions of the lease scripts. anarchon prepends this file to
-- claim.lua, heartbeat.lua and finish.lua when it loads them, so each loaded
-- script is self-contained and runs atomically on the server.

-- Redis 5 and 6 replicate a script as the script itself unless told otherwise,
-- and refuse writes after a non-deterministic command such as TIME. Replicating
-- the effects instead is what Redis 7+ and Valkey always do.
if redis.replicate_commands then pcall(redis.replicate_commands) end

-- Every decision about a lease uses the server's clock, never an instance's.
local function server_now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Whole numbers as decimal text, exact for any millisecond timestamp.
local function int(n)
  return string.format('%.0f', n)
end

-- The hash field that counts wins of the job (the fencing token). Slot ids
-- are digits (scheduled) or start with 'm' (manual), so it never collides.
local FENCE_FIELD = 'fence'

-- The hash field that pauses the job (its value says who paused it, and when):
-- while it is there, a scheduled slot's first claim records the slot as skipped
-- instead of starting it. Runs already started, their retries and manual runs go on.
local PAUSED_FIELD = 'paused'

-- A run's state is one field of the state hash, named for its slot:
--   status|attempt|token|until_ms|fence|trigger|started_ms|runner
-- status running: until_ms is the lease expiry;
-- status retry:   the lease is released, until_ms is when the next attempt may start;
-- settled (ok, failed, interrupted, cancelled): until_ms is when it settled.
local function decode_state(raw)
  if not raw then return nil end
  local status, attempt, token, until_ms, fence, trigger, started_ms, runner = string.match(
    raw, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  return {
    status = status, attempt = tonumber(attempt), token = token,
    until_ms = tonumber(until_ms), fence = tonumber(fence), trigger = trigger,
    started_ms = tonumber(started_ms), runner = runner,
  }
end

local function encode_state(s)
  return table.concat({
    s.status, int(s.attempt), s.token, int(s.until_ms), int(s.fence), s.trigger,
    int(s.started_ms), s.runner,
  }, '|')
end

-- One results member per attempt, scored by the slot's instant:
--   slot|attempt|status|started_ms|finished_ms|fence|trigger|runner|error
-- then the history bounds: the newest history_size members, none older than
-- history_ttl_ms (0 = no age limit).
local function record_result(results_key, slot, slot_score, s, status, now, err,
                             history_size, history_ttl_ms)
  local member = table.concat({
    slot, int(s.attempt), status, int(s.started_ms), int(now), int(s.fence), s.trigger,
    s.runner, err,
  }, '|')
  redis.call('ZADD', results_key, slot_score, member)
  redis.call('ZREMRANGEBYRANK', results_key, 0, -(history_size + 1))
  if history_ttl_ms > 0 then
    redis.call('ZREMRANGEBYSCORE', results_key, '-inf', '(' .. int(now - history_ttl_ms))
  end
end
