-- claim's first look: its commonest answers, given before the rest of the lease
-- scripts' definitions are made (scripts.py puts this text into claim's copy of
-- lease_state.lua, just after decode_state). With several instances every slot is
-- claimed by each of them, and all but the winner hear one of these: the slot's run
-- holds another caller's live lease, or it has ended. Each answer is the one the whole
-- script (claim.lua) gives for the same state, with nothing malformed met; any other
-- state, or a probe, goes on to it.
if ARGV[15] ~= '1' then
  local first = decode_state(redis.call('HGET', KEYS[1], ARGV[1]))
  if first then
    local status = first.status
    if status == 'running' and first.token ~= ARGV[3] then
      local left_ms = first.until_ms - server_now_ms()
      if left_ms > 0 then return {'running', 0, 0, left_ms, '', {}, {}} end
    elseif status == 'ok' or status == 'failed' or status == 'interrupted'
      or status == 'cancelled' then
      return {'done', 0, 0, 0, status, {}, {}}
    end
  end
end
