-- request_run: ask the fleet to run a job now (anarchon run-now), with lease_state.lua's
-- definitions prepended. The run is stored as waiting for its first attempt (attempt
-- 0, due now): the claim of any instance that runs the job takes it, whether a hint
-- brought it there or its next slot's first claim found it among the orphans.
-- A request already waiting for its first attempt is the one request: asking again
-- (a double click, a script in a loop, a storm) adds nothing, so the job's active set
-- holds at most one request, however often the fleet is asked.
-- KEYS[1] state (hash)   KEYS[2] active (set)   KEYS[3] slots (sorted set)
-- ARGV: slot (a manual slot id), slot_score, who asked
-- Replies {slot, 1} for a new request, {slot, 0} for the one already waiting.
local state_key, active_key, slots_key = KEYS[1], KEYS[2], KEYS[3]
local slot, slot_score, who = ARGV[1], ARGV[2], ARGV[3]

-- The state hash's field naming the request that waits for its first attempt (slot ids
-- are digits or start with 'm', so it never collides).
local REQUEST_FIELD = 'requested'

local waiting = redis.call('HGET', state_key, REQUEST_FIELD)
if waiting and is_slot_id(waiting) then
  local w = decode_state(redis.call('HGET', state_key, waiting))
  if w and w.status == 'retry' and w.attempt == 0 then
    redis.call('SADD', active_key, waiting)  -- in the set of unsettled runs, whatever befell it
    return {waiting, 0}
  end
end

local now = server_now_ms()
local requested = {
  status = 'retry', attempt = 0, token = '', until_ms = now, fence = 0,
  trigger = 'manual', started_ms = now, runner = who,
}
redis.call('HSET', state_key, slot, encode_state(requested))
redis.call('HSET', state_key, REQUEST_FIELD, slot)
redis.call('SADD', active_key, slot)
redis.call('ZADD', slots_key, slot_score, slot)
return {slot, 1}
