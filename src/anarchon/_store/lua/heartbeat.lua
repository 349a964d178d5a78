-- heartbeat: extend the lease of the caller's attempt.
-- KEYS[1] state (hash)   KEYS[2] active (set)   KEYS[3] permits (sorted set; with a
-- fleet limit only)
-- ARGV: slot, token, lease_ms, allow_overlap (0/1), fleet_max (absent or 0: no limit)
-- Replies {1, lease_ms} while the caller's token holds the run, even after the
-- expiry if nobody has taken over yet; otherwise {0, status} and changes nothing
-- (status 'malformed': the run's state does not read; the attempt has lost it).
-- An expired lease is not revived while another run of the job holds a live one
-- (unless the job allows overlapping runs): that run started because this lease
-- had expired, and two live runs would break overlap protection. Nor is it with a fleet
-- limit whose permits other runs hold now ({0, 'fleet'}): the run's permit went with its
-- lease, and more runs than the limit would go on at once.
local state_key, active_key, permits_key = KEYS[1], KEYS[2], KEYS[3]
local slot = ARGV[1]
local token = ARGV[2]
local lease_ms = tonumber(ARGV[3])
local allow_overlap = ARGV[4] == '1'
local fleet_max = tonumber(ARGV[5] or '0')

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
if not take_permit(permits_key, slot, now + lease_ms, now, fleet_max, {}) then
  return {0, 'fleet'}
end
local revived = s.until_ms <= now
s.until_ms = now + lease_ms
redis.call('HSET', state_key, slot, encode_state(s))
-- A revived lease is taken again: its run is the holder (lease_state.lua).
if revived then redis.call('HSET', state_key, HOLDER_FIELD, slot) end
return {1, lease_ms}
