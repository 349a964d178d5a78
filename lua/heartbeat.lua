-- heartbeat: extend the lease of the caller's attempt.
-- KEYS[1] state (hash)
-- ARGV: slot, token, lease_ms
-- Replies {1, lease_ms} while the caller's token holds the run, even after the
-- expiry if nobody has taken over yet; otherwise {0, status} and changes nothing.
local state_key = KEYS[1]
local slot = ARGV[1]
local token = ARGV[2]
local lease_ms = tonumber(ARGV[3])

local now = server_now_ms()
local s = decode_state(redis.call('HGET', state_key, slot))
if not s then return {0, 'gone'} end
if s.token ~= token or s.status ~= 'running' then return {0, s.status} end
s.until_ms = now + lease_ms
redis.call('HSET', state_key, slot, encode_state(s))
return {1, lease_ms}
