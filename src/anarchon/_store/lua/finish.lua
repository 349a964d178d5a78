-- finish: end the caller's attempt and record its result.
-- KEYS[1] state (hash)   KEYS[2] active (set)   KEYS[3] results (sorted set)
-- KEYS[4] permits (sorted set; a job with a fleet limit only): the attempt's fleet permit
-- is given back
-- ARGV: slot, slot_score, token, outcome (ok|failed|cancelled), max_attempts,
--       retry_delay_ms, error, history_size, history_ttl_ms, pause_after (the job's
--       pause_after_failures; absent or 0 for none: its slot that finally fails is
--       counted, and the Nth in a row pauses the job)
-- A run that ends ok or finally failed is counted (lease_state.lua's RUNS_FIELD).
-- Replies {'settled', status, ms, malformed, paused} where status is the run's state afterwards
-- (retry: the next attempt may start in ms; malformed: a results key that could not take
-- the result, lease_state.lua's record_result), or {'lost', status} when the
-- caller's token no longer holds the run: then nothing changes.
local state_key, active_key, results_key, permits_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local slot = ARGV[1]
local slot_score = tonumber(ARGV[2])
local token = ARGV[3]
local outcome = ARGV[4]
local max_attempts = tonumber(ARGV[5])
local retry_delay_ms = tonumber(ARGV[6])
local err = ARGV[7]
local history_size = tonumber(ARGV[8])
local history_ttl_ms = tonumber(ARGV[9])
local pause_after = tonumber(ARGV[10] or '0')

local now = server_now_ms()
local s = decode_state(redis.call('HGET', state_key, slot))
if s == nil then return {'lost', 'gone'} end
if s == false then return {'lost', 'malformed'} end  -- the claim that meets it reports it
if s.token ~= token then return {'lost', s.status} end
-- The pause that a finish of this slot makes names the slot (so that a repeat knows it).
local function pause_text(in_row)
  return PAUSED_BY_FAILURES .. ': its last ' .. in_row .. ' slots finally failed (the last: '
    .. slot .. ')'
end
-- The caller already finished this attempt (a finish repeated after a lost reply): its
-- answer again, "paused" included when that finish paused the job.
if s.status ~= 'running' then
  local paused = 0
  local by = redis.call('HGET', state_key, PAUSED_FIELD)
  if s.status == 'failed' and by and string.sub(by, -(#slot + 2)) == ' ' .. slot .. ')'
      and string.sub(by, 1, #PAUSED_BY_FAILURES) == PAUSED_BY_FAILURES then
    paused = 1
  end
  return {'settled', s.status, math.max(s.until_ms - now, 0), {}, paused}
end

local bad = {}
record_result(results_key, slot, slot_score, s, outcome, now, err, history_size,
  history_ttl_ms, bad)

if outcome == 'ok' then
  s.status, s.until_ms = 'ok', now
elseif s.attempt < max_attempts then
  -- failed or cancelled with attempts left: release the lease; the next attempt
  -- starts after the retry delay (at once after a cancel), on whichever instance
  -- claims first.
  if outcome == 'cancelled' then retry_delay_ms = 0 end
  s.status, s.until_ms = 'retry', now + retry_delay_ms
else
  s.status, s.until_ms = outcome, now
end
redis.call('HSET', state_key, slot, encode_state(s))
drop_permit(permits_key, slot)
if s.status ~= 'retry' then
  -- Settled for good: no attempt will read its progress.
  redis.call('SREM', active_key, slot)
  redis.call('HDEL', state_key, PROGRESS_PREFIX .. slot)
  count_run(state_key, s.status, bad)
end
-- paused: 1 when this finish paused the job (its pause_after_failures reached).
local paused = 0
if s.status == 'ok' then
  redis.call('HSET', state_key, LAST_OK_FIELD, now)
  if pause_after > 0 then redis.call('HDEL', state_key, FAILED_IN_ROW_FIELD) end
elseif s.status == 'failed' and pause_after > 0 then
  local in_row = add_count(state_key, FAILED_IN_ROW_FIELD, bad)
  if in_row >= pause_after and redis.call('HSETNX', state_key, PAUSED_FIELD,
      pause_text(in_row)) == 1 then
    paused = 1
  end
end
return {'settled', s.status, s.until_ms - now, bad, paused}
