-- timer_heartbeat: extend the lease of the caller's firing.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] permits (sorted set)
-- ARGV: key, token, lease_ms, fleet_max (the bucket's share of max_concurrent_fleet; 0:
--       no limit), group_by, group_max, group_permits (max_concurrent_per_group, as
--       timer_claim.lua takes them); KEYS[3] and the arguments after lease_ms come from
--       a kind with a fleet limit only
-- Replies {1, lease_ms} while the caller's token holds the firing, even after the
-- expiry if nobody has taken over yet (and, with a fleet limit, while a permit is free
-- to it: one whose lease ran out may be another firing's now); otherwise {0, status}
-- and changes nothing.
local timers_key, due_key, permits_key = KEYS[1], KEYS[2], KEYS[3]
local key = ARGV[1]
local token = ARGV[2]
local lease_ms = tonumber(ARGV[3])
local fleet_max = tonumber(ARGV[4] or '0')
local group_by = ARGV[5]
local group_max = tonumber(ARGV[6] or '0')
local group_permits = ARGV[7]

local now = server_now_ms()
local t = decode_timer(redis.call('HGET', timers_key, key))
if t == nil then return {0, 'gone'} end
if t == false then return {0, 'malformed'} end  -- the claim that meets it reports it
if t.status ~= 'f' or t.token ~= token then return {0, t.status} end
-- Its permits (the kind's, its key group's) are kept while one is free to it: checked
-- both before either is taken.
local group_key = group_max > 0 and group_permits .. group_of(key, group_by) or nil
if fleet_max > 0 and free_permits(permits_key, key, now, fleet_max, {}) <= 0 then
  return {0, 'fleet'}
end
if group_key and free_permits(group_key, key, now, group_max, {}) <= 0 then
  return {0, 'fleet'}
end
if fleet_max > 0 then redis.call('ZADD', permits_key, int(now + lease_ms), key) end
if group_key then redis.call('ZADD', group_key, int(now + lease_ms), key) end
t.until_ms = now + lease_ms
store_timer(timers_key, due_key, key, t)
return {1, lease_ms}
