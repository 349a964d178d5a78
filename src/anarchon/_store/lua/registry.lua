-- registry: an instance says it is alive, and what it runs (with lease_state.lua's
-- definitions prepended: the server's clock).
-- KEYS[1] instances (sorted set: instance id scored by when its registration expires)
-- KEYS[2] this instance (a string: what it runs, as JSON; it expires with it)
-- KEYS[3] jobs (hash: job name -> its definition in force, as JSON)
-- KEYS[4] first seen (hash: job name -> when it first appeared in the store, server ms)
-- KEYS[5] timer kinds (hash: kind -> its definition, as JSON)
-- KEYS[6] definitions (hash: job name -> the fingerprints of its definitions that live
--         instances registered, 'fp:first_ms:until_ms' each, ',' between: when each first
--         appeared, and until when a registration that holds it lasts)
-- ARGV: instance id, ttl_ms, the instance's JSON, the number of jobs, then for each job a
--       name, a definition, its oldest remembered slot ('' if none: a store written
--       before the registry existed has slots older than the job's entry here) and its
--       definition's fingerprint, then a name and a definition for each timer kind
-- Reply: {now_ms, then each job's first-seen time (ms), in order, then each job's
--        fingerprint in force, then the malformed entries repaired ({key, field, problem,
--        excerpt} each)}
-- The definition in force is the newest: of the fingerprints live registrations hold,
-- the one that first appeared last (a deploy's new definition is in force from its first
-- instance's registration on). A fingerprint no live registration holds is forgotten, so
-- a definition deployed again (a rollback) is new again.
local instances_key, instance_key, jobs_key, first_seen_key, kinds_key, definitions_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id = ARGV[1]
local ttl_ms = tonumber(ARGV[2])
local job_count = tonumber(ARGV[4])

local now = server_now_ms()

-- Instances that stopped renewing are gone (bounded by the live ones).
redis.call('ZREMRANGEBYSCORE', instances_key, '-inf', '(' .. int(now))
redis.call('ZADD', instances_key, int(now + ttl_ms), id)
redis.call('SET', instance_key, ARGV[3], 'PX', int(ttl_ms))

local repaired = {}
-- The most fingerprints kept per job (the newest): a fleet of many definitions at once
-- costs a registration no more than this.
local FINGERPRINTS_MAX = 8

-- Register fp as a definition of the job a live instance holds; the fingerprint in force.
local function in_force_of(name, fp)
  local raw = redis.call('HGET', definitions_key, name)
  local kept, own_first = {}, now
  if raw then
    local readable = #raw <= 64 * FINGERPRINTS_MAX
    for part in string.gmatch(raw, '[^,]+') do
      local f, first, last = string.match(part, '^(%x+):(%d+):(%d+)$')
      first, last = instant(first), instant(last)
      if not (f and #f == 16 and first and last) then
        readable = false
        break
      end
      if f == fp then
        if last > now then own_first = first end  -- held without a break: not new
      elseif last > now then
        kept[#kept + 1] = {f, first, last}
      end
    end
    if not readable then
      repaired[#repaired + 1] = {definitions_key, name,
        'not a list of fingerprints: written again from this registration', excerpt(raw)}
      kept, own_first = {}, now
    end
  end
  kept[#kept + 1] = {fp, own_first, now + ttl_ms}
  table.sort(kept, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    return a[1] > b[1]
  end)
  local parts = {}
  for i = 1, math.min(#kept, FINGERPRINTS_MAX) do
    parts[i] = kept[i][1] .. ':' .. int(kept[i][2]) .. ':' .. int(kept[i][3])
  end
  redis.call('HSET', definitions_key, name, table.concat(parts, ','))
  return kept[1][1]
end

local reply = {int(now)}
local in_force = {}
for i = 0, job_count - 1 do
  local name, definition, oldest = ARGV[5 + 4 * i], ARGV[6 + 4 * i], tonumber(ARGV[7 + 4 * i])
  local fp = ARGV[8 + 4 * i]
  in_force[#in_force + 1] = in_force_of(name, fp)
  -- The views show the definition in force: an instance of another does not write it.
  if in_force[#in_force] == fp then redis.call('HSET', jobs_key, name, definition) end
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
for i = 5 + 4 * job_count, #ARGV, 2 do
  redis.call('HSET', kinds_key, ARGV[i], ARGV[i + 1])
end
for _, fp in ipairs(in_force) do reply[#reply + 1] = fp end
reply[#reply + 1] = repaired
return reply
