-- idmp strategy: make the job's stream remember run ids for duration_sec, at most
-- max_size of them. XCFGSET forgets the ids the stream remembers, so it is sent
-- only when the stream is new or its settings differ; the stream must exist
-- first, so a new one is created empty (XADD MAXLEN 0). Atomic, so instances
-- starting together configure it once.
-- KEYS[1] runs (stream)
-- ARGV: duration_sec, max_size
-- Replies 'created', 'changed' or 'kept'.
local runs_key = KEYS[1]
local duration_sec = tonumber(ARGV[1])
local max_size = tonumber(ARGV[2])

local reply = 'changed'
if redis.call('EXISTS', runs_key) == 0 then
  redis.call('XADD', runs_key, 'MAXLEN', 0, '*', 'created', '1')
  reply = 'created'
else
  local info = redis.call('XINFO', 'STREAM', runs_key)
  local current = {}
  for i = 1, #info, 2 do current[info[i]] = info[i + 1] end
  if tonumber(current['idmp-duration']) == duration_sec
    and tonumber(current['idmp-maxsize']) == max_size then
    return 'kept'
  end
end
redis.call('XCFGSET', runs_key, 'IDMP-DURATION', duration_sec, 'IDMP-MAXSIZE', max_size)
return reply
