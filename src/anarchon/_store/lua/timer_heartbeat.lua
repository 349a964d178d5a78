-- timer_heartbeat: extend the lease of the caller's firing.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)
-- ARGV: key, token, lease_ms
-- Replies {1, lease_ms} while the caller's token holds the firing, even after the
-- expiry if nobody has taken over yet; otherwise {0, status} and changes nothing.
local timers_key, due_key = KEYS[1], KEYS[2]
local key = ARGV[1]
local token = ARGV[2]
local lease_ms = tonumber(ARGV[3])

local now = server_now_ms()
local t = decode_timer(redis.call('HGET', timers_key, key))
if t == nil then return {0, 'gone'} end
if t == false then return {0, 'malformed'} end  -- the claim that meets it reports it
if t.status ~= 'f' or t.token ~= token then return {0, t.status} end
t.until_ms = now + lease_ms
store_timer(timers_key, due_key, key, t)
return {1, lease_ms}
