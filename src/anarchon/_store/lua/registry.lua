-- registry: an instance says it is alive, and what it runs (with lease_state.lua's
-- definitions prepended: the server's clock).
-- KEYS[1] instances (sorted set: instance id scored by when its registration expires)
-- KEYS[2] this instance (a string: what it runs, as JSON; it expires with it)
-- KEYS[3] jobs (hash: job name -> its definition, as JSON)
-- KEYS[4] first seen (hash: job name -> when it first appeared in the store, server ms)
-- KEYS[5] timer kinds (hash: kind -> its definition, as JSON)
-- ARGV: instance id, ttl_ms, the instance's JSON, the number of jobs, then for each job a
--       name, a definition and its oldest remembered slot ('' if none: a store written
--       before the registry existed has slots older than the job's entry here), then a
--       name and a definition for each timer kind
-- Reply: {now_ms, then each job's first-seen time (ms), in order, then the malformed
--        first-seen times repaired ({key, field, problem, excerpt} each)}
local instances_key, instance_key, jobs_key, first_seen_key, kinds_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local job_count = tonumber(ARGV[4])

local now = server_now_ms()

-- Instances that stopped renewing are gone (bounded by the live ones).
redis.call('ZREMRANGEBYSCORE', instances_key, '-inf', '(' .. int(now))
redis.call('ZADD', instances_key, int(now + ttl_ms), id)
redis.call('SET', instance_key, ARGV[3], 'PX', int(ttl_ms))

local reply = {int(now)}
local repaired = {}
for i = 0, job_count - 1 do
  local name, definition, oldest = ARGV[5 + 3 * i], ARGV[6 + 3 * i], tonumber(ARGV[7 + 3 * i])
  redis.call('HSET', jobs_key, name, definition)
  local seen = now
  if oldest and oldest < now then seen = oldest end
  local stored = redis.call('HGET', first_seen_key, name)
  if stored and not instant(stored) then
    -- Not a time (another client wrote it): repaired to what this registration knows.
    repaired[#repaired + 1] = {first_seen_key, name, 'not a time in ms: repaired', excerpt(stored)}
    stored = false
  end
  if not stored then
    stored = int(seen)
    redis.call('HSET', first_seen_key, name, stored)
  end
  reply[#reply + 1] = stored
end
for i = 5 + 3 * job_count, #ARGV, 2 do
  redis.call('HSET', kinds_key, ARGV[i], ARGV[i + 1])
end
reply[#reply + 1] = repaired
return reply
