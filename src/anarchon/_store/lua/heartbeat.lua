-- heartbeat: extend the lease of the caller's attempt.
-- KEYS[1] state (hash)   KEYS[2] active (set)
-- ARGV: slot, token, lease_ms, allow_overlap (0/1)
-- Replies {1, lease_ms} while the caller's token holds the run, even after the
-- expiry if nobody has taken over yet; otherwise {0, status} and changes nothing
-- (status 'malformed': the run's state does not read; the attempt has lost it).
-- An expired lease is not revived while another run of the job holds a live one
-- (unless the job allows overlapping runs): that run started because this lease
-- had expired, and two live runs would break overlap protection.
local state_key, active_key = KEYS[1], KEYS[2]
local slot = ARGV[1]
local token = ARGV[2]
local lease_ms = tonumber(ARGV[3])
local allow_overlap = ARGV[4] == '1'

local now = server_now_ms()
local s = decode_state(redis.call('HGET', state_key, slot))
if s == nil then return {0, 'gone'} end
if s == false then return {0, 'malformed'} end  -- the claim that meets it reports it
if s.token ~= token or s.status ~= 'running' then return {0, s.status} end
if s.until_ms <= now and not allow_overlap then
  -- The holder's lease is seen even when the sample of a large set misses it.
  if holder_live_ms(state_key, slot, now) > 0 then return {0, 'overlapped'} end
  for _, other in ipairs((members_to_scan(active_key))) do
    if other ~= slot and is_slot_id(other) then
      local o = decode_state(redis.call('HGET', state_key, other))
      if o and o.status == 'running' and o.until_ms > now then return {0, 'overlapped'} end
    end
  end
end
local revived = s.until_ms <= now
s.until_ms = now + lease_ms
redis.call('HSET', state_key, slot, encode_state(s))
-- A revived lease is taken again: its run is the holder (lease_state.lua).
if revived then redis.call('HSET', state_key, HOLDER_FIELD, slot) end
return {1, lease_ms}
