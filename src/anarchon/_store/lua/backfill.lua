-- backfill: a job's backfill record (backfill.py), with lease_state.lua's definitions
-- prepended. The record is a hash under the job's hash tag, beside its state:
--   status  running | done | cancelled | stopped
--   from, to  the range [from, to) in ms        next  the range's slots from here on
--             are still to be decided            slots  how many it holds ('' unknown)
--   ok, failed, before, skipped  the slots decided, by how
--   by, note  who asked, why                     started, ended  the server's ms
--   driver, until  the instance driving it, and until when its turn lasts
--   reason  why anarchon stopped it, or who cancelled it
-- KEYS[1] backfill (hash)   KEYS[2] the job's state (hash: its paused flag)
-- ARGV[1] is the operation:
--   start from to slots by note keep_ms   a new backfill, unless one runs: {'started'}, or
--                                 {'busy', next, slots, decided}
--   drive instance lease_ms       take (or keep) the turn to drive it: {'driving', from,
--                                 to, next, slots, paused (0/1)}, {'held', ms left},
--                                 {'over', status} or {'none'}
--   advance instance lease_ms next outcome slots end keep_ms
--                                 one slot decided (outcome: ok, failed, before, skipped,
--                                 or '' for none), the cursor moved to next, the count set
--                                 (slots, '' to keep it); end: '' to go on, 'done', or a
--                                 reason to stop: {'ok'}, or {'lost'} when the caller's
--                                 turn is over (another instance drives it, or it ended)
--   cancel by keep_ms             {1} when a running backfill was cancelled, else {0}
-- A record that does not read (another client's) is reported in the reply's last
-- element ({key, field, problem, excerpt}, as the lease scripts report) and left alone:
-- it costs this job's backfill, never a claim.
local backfill_key, state_key = KEYS[1], KEYS[2]
local op = ARGV[1]
local now = server_now_ms()
local bad = {}

local STATUSES = {running = true, done = true, cancelled = true, stopped = true}
local COUNTS = {ok = true, failed = true, before = true, skipped = true}

-- The record's range and cursor, read strictly; nil (and a report) when they do not read.
local function read_record()
  local raw = redis.call('HMGET', backfill_key, 'status', 'from', 'to', 'next', 'driver', 'until')
  if not raw[1] then return nil end
  local r = {
    status = raw[1], from = instant(raw[2]), to = instant(raw[3]), next = instant(raw[4]),
    driver = raw[5] or '', until_ms = raw[6] and instant(raw[6]) or 0,
  }
  if not STATUSES[r.status] or not r.from or not r.to or not r.next or not r.until_ms then
    bad[#bad + 1] = {backfill_key, 'status', 'not a backfill record anarchon writes: '
      .. 'delete it (anarchon backfill --cancel does not mend it)', excerpt(raw[1])}
    return false
  end
  return r
end

-- An ended backfill stays readable for keep_ms, then goes.
local function end_record(status, reason)
  redis.call('HSET', backfill_key, 'status', status, 'ended', int(now))
  if reason then redis.call('HSET', backfill_key, 'reason', reason) end
  redis.call('HDEL', backfill_key, 'driver', 'until')
end

if op == 'start' then
  local r = read_record()
  if r == false then return {'malformed', 0, '', 0, bad} end
  if r and r.status == 'running' then
    local decided = 0
    for field in pairs(COUNTS) do
      decided = decided + read_count(backfill_key, field, bad)
    end
    return {'busy', int(r.next), redis.call('HGET', backfill_key, 'slots') or '', decided, bad}
  end
  redis.call('DEL', backfill_key)
  redis.call('HSET', backfill_key, 'status', 'running', 'from', ARGV[2], 'to', ARGV[3],
    'next', ARGV[2], 'slots', ARGV[4], 'by', ARGV[5], 'note', ARGV[6], 'started', int(now),
    'ok', 0, 'failed', 0, 'before', 0, 'skipped', 0)
  return {'started', 0, '', 0, bad}
end

if op == 'cancel' then
  local r = read_record()
  if not r or r.status ~= 'running' then return {0, bad} end
  end_record('cancelled', ARGV[2])
  redis.call('PEXPIRE', backfill_key, ARGV[3])
  return {1, bad}
end

local instance = ARGV[2]
local lease_ms = tonumber(ARGV[3])
local r = read_record()
if r == nil then return {'none', bad} end
if r == false then return {'over', 'malformed', bad} end
if r.status ~= 'running' then return {'over', r.status, bad} end

if op == 'drive' then
  if r.driver ~= instance and r.driver ~= '' and r.until_ms > now then
    return {'held', r.until_ms - now, bad}
  end
  redis.call('HSET', backfill_key, 'driver', instance, 'until', int(now + lease_ms))
  local paused = redis.call('HEXISTS', state_key, PAUSED_FIELD)
  return {'driving', int(r.from), int(r.to), int(r.next),
    redis.call('HGET', backfill_key, 'slots') or '', paused, bad}
end

if op == 'advance' then
  -- Only the instance whose turn it is moves the cursor (a turn that ran out may have
  -- been taken: the new driver decides the same slot again, and the claim says it is
  -- settled).
  if r.driver ~= instance then return {'lost', bad} end
  local next_ms, outcome, slots, finish, keep_ms = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
  if COUNTS[outcome] then add_count(backfill_key, outcome, bad) end
  if instant(next_ms) and tonumber(next_ms) > r.next then
    redis.call('HSET', backfill_key, 'next', next_ms)
  end
  if slots ~= '' then redis.call('HSET', backfill_key, 'slots', slots) end
  if finish == 'done' then
    end_record('done', nil)
    redis.call('PEXPIRE', backfill_key, keep_ms)
  elseif finish ~= '' then
    end_record('stopped', finish)
    redis.call('PEXPIRE', backfill_key, keep_ms)
  else
    redis.call('HSET', backfill_key, 'until', int(now + lease_ms))
  end
  return {'ok', bad}
end

return redis.error_reply('backfill.lua: unknown operation ' .. tostring(op))
