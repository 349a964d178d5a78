-- idmp strategy: claim a slot with Redis 8.6's idempotent XADD, then read the
-- entry it answers with: the caller won only if that entry carries its token.
-- One key, so it runs on any cluster node.
-- KEYS[1] runs (stream, configured by idmp_configure.lua)
-- ARGV: job, slot_ms, history_size, slot, token, runner
-- Replies {'won', entry_id} or {'done', entry_id} (another instance's entry, or
-- one already trimmed away: either way not the caller's).
local runs_key = KEYS[1]
local id = redis.call('XADD', runs_key, 'IDMP', ARGV[1], ARGV[2], 'MAXLEN', '~', ARGV[3], '*',
  'slot', ARGV[4], 'token', ARGV[5], 'runner', ARGV[6])
local entry = redis.call('XRANGE', runs_key, id, id)[1]
if entry then
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'token' then
      if fields[i + 1] == ARGV[5] then return {'won', id} end
      break
    end
  end
end
return {'done', id}
