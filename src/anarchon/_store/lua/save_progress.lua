-- save_progress: keep what the caller's attempt has done so far, for the slot's next
-- attempt (a retry, or a takeover after its runner died): run.save_progress.
-- KEYS[1] state (hash)
-- ARGV: slot, token, progress (JSON text), max_bytes
-- Replies {1} when it is kept, or {0, status} when the caller's token no longer holds a
-- live lease on the run (the fence: a stale attempt's progress is refused) or the text
-- is longer than max_bytes ('too large'); then nothing changes.
local state_key = KEYS[1]
local slot = ARGV[1]
local token = ARGV[2]
local progress = ARGV[3]
local max_bytes = tonumber(ARGV[4])

local now = server_now_ms()
local s = decode_state(redis.call('HGET', state_key, slot))
if s == nil then return {0, 'gone'} end
if s == false then return {0, 'malformed'} end
if s.token ~= token or s.status ~= 'running' then return {0, s.status} end
if s.until_ms <= now then return {0, 'expired'} end
if #progress > max_bytes then return {0, 'too large'} end
redis.call('HSET', state_key, PROGRESS_PREFIX .. slot, progress)
return {1}
