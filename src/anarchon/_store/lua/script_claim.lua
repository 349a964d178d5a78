-- script strategy: claim a slot by appending it to the job's stream, unless an
-- entry for the same slot is already there. One key, so it runs on any cluster node.
-- KEYS[1] runs (stream)
-- ARGV: slot, token, runner, window_ms
-- Replies {'won', entry_ms} (the new entry's id, in server milliseconds) or
-- {'done', entry_ms} (the entry that claimed the slot first).
if redis.replicate_commands then pcall(redis.replicate_commands) end

local runs_key = KEYS[1]
local slot = ARGV[1]
local token = ARGV[2]
local runner = ARGV[3]
local window_ms = tonumber(ARGV[4])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local oldest = string.format('%.0f', now - window_ms)

-- The claims of the last window_ms: is this slot among them?
for _, entry in ipairs(redis.call('XRANGE', runs_key, oldest, '+')) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'slot' and fields[i + 1] == slot then
      return {'done', tonumber(string.match(entry[1], '^(%d+)'))}
    end
  end
end

local id = redis.call('XADD', runs_key, '*', 'slot', slot, 'token', token, 'runner', runner)

-- Forget claims older than the window (XRANGE and XDEL exist on Redis 5; XTRIM
-- MINID does not). A bounded number per call keeps the script short.
local old = redis.call('XRANGE', runs_key, '-', string.format('%.0f', now - window_ms - 1),
  'COUNT', 100)
for _, entry in ipairs(old) do
  redis.call('XDEL', runs_key, entry[1])
end
return {'won', tonumber(string.match(id, '^(%d+)'))}
