-- request_run: ask the fleet to run a job now (anarchon run-now), with lease_state.lua's
-- definitions prepended. The run is stored as waiting for its first attempt (attempt
-- 0, due now): the claim of any instance that runs the job takes it, whether a hint
-- brought it there or its next slot's first claim found it among the orphans.
-- KEYS[1] state (hash)   KEYS[2] active (set)   KEYS[3] slots (sorted set)
-- ARGV: slot (a manual slot id), slot_score, who asked
local state_key, active_key, slots_key = KEYS[1], KEYS[2], KEYS[3]
local slot, slot_score, who = ARGV[1], ARGV[2], ARGV[3]
local now = server_now_ms()
local requested = {
  status = 'retry', attempt = 0, token = '', until_ms = now, fence = 0,
  trigger = 'manual', started_ms = now, runner = who,
}
redis.call('HSET', state_key, slot, encode_state(requested))
redis.call('SADD', active_key, slot)
redis.call('ZADD', slots_key, slot_score, slot)
return int(now)
