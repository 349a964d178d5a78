-- timer_save_progress: keep what the caller's firing has done so far, for the firing's
-- next attempt (a retry, or a takeover after its runner died): fire.save_progress.
-- KEYS[1] timers (hash)   KEYS[2] progress (hash)
-- ARGV: key, token, progress (JSON text), max_bytes
-- The progress is kept under the key as '<generation>|<text>': only an attempt of the
-- same generation reads it (timer_claim.lua), and it goes when the firing is over.
-- Replies {1} when it is kept, or {0, status} when the caller's token no longer holds a
-- live lease on the firing (the fence: a stale attempt's progress is refused) or the
-- text is longer than max_bytes ('too large'); then nothing changes.
local timers_key, progress_key = KEYS[1], KEYS[2]
local key = ARGV[1]
local token = ARGV[2]
local progress = ARGV[3]
local max_bytes = tonumber(ARGV[4])

local STATUSES = {p = 'pending', f = 'firing', r = 'retry'}
local now = server_now_ms()
local t = decode_timer(redis.call('HGET', timers_key, key))
if t == nil then return {0, 'gone'} end
if t == false then return {0, 'malformed'} end
if t.status ~= 'f' or t.token ~= token then return {0, STATUSES[t.status]} end
if t.until_ms <= now then return {0, 'expired'} end
if #progress > max_bytes then return {0, 'too large'} end
redis.call('HSET', progress_key, key, int(t.fire_gen) .. '|' .. progress)
return {1}
