-- Shared definitions of the lease scripts. anarchon prepends this file to
-- claim.lua, heartbeat.lua and finish.lua when it loads them, so each loaded
-- script is self-contained and runs atomically on the server.

-- Redis 5 and 6 replicate a script as the script itself unless told otherwise,
-- and refuse writes after a non-deterministic command such as TIME. Replicating
-- the effects instead is what Redis 7+ and Valkey always do.
if redis.replicate_commands then pcall(redis.replicate_commands) end

-- Every decision about a lease uses the server's clock, never an instance's.
local function server_now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Whole numbers as decimal text, exact for any millisecond timestamp.
local function int(n)
  return string.format('%.0f', n)
end

-- What the store holds is input: another client, a bad migration or a hand edit can
-- leave anything in these keys. Whole numbers are read strictly (decimal digits, at most
-- 2^53 - 1, so exact as Lua numbers): never 'inf', 'nan', '1e3' or '-5', which tonumber
-- would take. An entry that does not read is malformed: the scripts skip it and report
-- it ({key, field, problem} in a reply's list of malformed entries, which the caller
-- quarantines: logged once, counted, shown); it costs that entry, at most its job.
local MAX_WHOLE = 9007199254740991
-- The last millisecond of the year 9999: an instant (a slot, a due time, a start) beyond
-- it is no time anarchon writes, and no date Python can show.
local MAX_INSTANT = 253402300799999
-- Fences and generations stop this far below 2^53 - 1, so that a claim's wins (one more
-- each) stay exact.
local MAX_COUNTER = MAX_WHOLE - 1000000

local function whole(text)
  if type(text) ~= 'string' or #text > 16 or not string.match(text, '^%d+$') then
    return nil
  end
  local n = tonumber(text)
  if n > MAX_WHOLE then return nil end
  return n
end

-- An instant in ms, read strictly (whole, at most MAX_INSTANT); nil otherwise.
local function instant(text)
  local n = whole(text)
  if n and n <= MAX_INSTANT then return n end
  return nil
end

-- Text a field may hold, shown in a report of a malformed entry (bounded).
local function excerpt(text)
  if type(text) ~= 'string' then return '' end
  if #text > 80 then return string.sub(text, 1, 80) .. '...(' .. #text .. ' bytes)' end
  return text
end

-- A slot id: a scheduled slot's instant (digits), or a manual run's 'm<instant>-<nonce>'
-- with a nonce of at most 100 letters, digits and '-' (records.py's is_slot_id is the
-- same rule).
local function is_slot_id(text)
  if type(text) ~= 'string' or #text > 120 then return false end
  if instant(text) then return true end
  local ms, nonce = string.match(text, '^m(%d+)%-([%w%-]*)$')
  return ms ~= nil and instant(ms) ~= nil and #nonce <= 100
end

-- The most members of a job's active set one script looks at, and the most orphans one
-- claim reports: a set grown without bound (requests piled up, or foreign members)
-- costs a claim no more than this.
local SCAN_MAX = 256
local ORPHANS_MAX = 32

-- The members of a set to look at: all of them, or a sample of SCAN_MAX when there are
-- more (and then `true`: the set was not read whole).
local function members_to_scan(set_key)
  if redis.call('SCARD', set_key) <= SCAN_MAX then
    return redis.call('SMEMBERS', set_key), false
  end
  return redis.call('SRANDMEMBER', set_key, SCAN_MAX), true
end

-- The hash field that counts wins of the job (the fencing token). Slot ids
-- are digits (scheduled) or start with 'm' (manual), so it never collides.
local FENCE_FIELD = 'fence'

-- The hash field that pauses the job (its value says who paused it, and when):
-- while it is there, a scheduled slot's first claim records the slot as skipped
-- instead of starting it. Runs already started, their retries and manual runs go on.
local PAUSED_FIELD = 'paused'

-- The hash field that counts the job's runs that ended ok or finally failed (finish.lua,
-- and claim.lua for a run whose last attempt's lease ran out), and the one that says the
-- job reached its max_runs (claim.lua: why, in words). A claim with a higher max_runs
-- (the bound raised in code) clears it.
local RUNS_FIELD = 'runs'
local FINISHED_FIELD = 'finished'

-- The hash field naming the fingerprint of the job's definition in force (the registry's
-- newest among its live instances: lua/registry.lua), written by the instances when it
-- changes: a first claim that carries another fingerprint starts nothing (an instance of
-- an older definition, during a deploy, claims no new slot; its runs under way go on).
local IN_FORCE_FIELD = 'in-force'

-- The hash field that counts the job's slots in a row that finally failed (finish.lua,
-- for a job with pause_after_failures; a run that ends ok, or a resume, clears it), and
-- the server's time of the job's last run that ended ok.
local FAILED_IN_ROW_FIELD = 'failed-in-row'
local LAST_OK_FIELD = 'last-ok'
-- How a pause by pause_after_failures begins (lease.py's PAUSED_BY_FAILURES).
local PAUSED_BY_FAILURES = 'anarchon (pause_after_failures)'

-- A job-wide count (RUNS_FIELD, FAILED_IN_ROW_FIELD), read strictly: 0 when there is none.
-- One that does not read (another client's text, 'inf', '-3') is reported in bad and
-- counts again from 0: read as a number, 'inf' finished the job for good, and HINCRBY
-- refused any other text after the run was recorded.
local function read_count(state_key, field, bad)
  local raw = redis.call('HGET', state_key, field)
  if not raw then return 0 end
  local n = whole(raw)
  if n then return n end
  bad[#bad + 1] = {state_key, field, 'not a whole number: counted again from 0', excerpt(raw)}
  return 0
end

-- One more of a job-wide count (read as read_count does); returns it.
local function add_count(state_key, field, bad)
  local n = read_count(state_key, field, bad) + 1
  redis.call('HSET', state_key, field, int(n))
  return n
end

-- A run of the job ended for good, ok or failed: counted.
local function count_run(state_key, status, bad)
  if status == 'ok' or status == 'failed' or status == 'interrupted' then
    add_count(state_key, RUNS_FIELD, bad)
  end
end

-- The last fence of a hash (a job's state, a timer kind's meta): its FENCE_FIELD read
-- strictly, a problem added to bad when it does not read. Returns the last fence (0 if
-- there is none), or nil:
--   a fence that is a number above MAX_COUNTER (or 'inf') cannot be gone past without
--   losing exactness: nil, and the caller wins nothing (the job or kind stops, loudly,
--   until an operator sets a whole fence at least as large, below MAX_COUNTER);
--   any other malformed fence is repaired forward at the next win: above its whole
--   part when it is a positive number ('12.5', ' 7'), and in any case to the server's
--   clock in microseconds, which every fence anarchon wrote is below ('nan', text).
local function last_fence(hash_key, bad)
  local raw = redis.call('HGET', hash_key, FENCE_FIELD)
  if not raw then return 0 end
  local last = whole(raw)
  local n = last or tonumber(raw)
  if n and n == n and n > MAX_COUNTER then
    bad[#bad + 1] = {hash_key, FENCE_FIELD,
      'a fence too close to 2^53 (or beyond): nothing wins until it is set to a whole '
      .. 'number below 2^53 - 10^6 and at least as large as the last fence handed out',
      excerpt(raw)}
    return nil
  end
  if last then return last end
  bad[#bad + 1] = {hash_key, FENCE_FIELD,
    'not a whole number: repaired forward (above it, and to the server clock in '
    .. 'microseconds at least) at the next win', excerpt(raw)}
  if n and n == n and n > 0 then return math.floor(n) end
  return 0
end

-- A run's state is one field of the state hash, named for its slot:
--   status|attempt|token|until_ms|fence|trigger|started_ms|runner
-- status running: until_ms is the lease expiry;
-- status retry:   the lease is released, until_ms is when the next attempt may start;
-- settled (ok, failed, interrupted, cancelled, skipped): until_ms is when it settled.
local STATUSES = {
  running = true, retry = true, ok = true, failed = true, interrupted = true,
  cancelled = true, skipped = true,
}
local TRIGGERS = {
  schedule = true, ['catch-up'] = true, retry = true, takeover = true, manual = true,
  backfill = true,
}

-- A field a pattern matched as digits, as a number: nil when it has more than 16 digits
-- or is above most (one pattern checks a whole record's digits at once: claims are hot).
local function digits(text, most)
  if #text > 16 then return nil end
  local n = tonumber(text)
  if n > most then return nil end
  return n
end

-- Returns the state, nil when there is none, or false and a problem when the field
-- holds something else (a malformed state: callers skip it and report it).
local function decode_state(raw)
  if not raw then return nil end
  local status, attempt, token, until_ms, fence, trigger, started_ms, runner = string.match(
    raw, '^(%l+)|(%d+)|([^|]*)|(%d+)|(%d+)|([%l%-]+)|(%d+)|(.*)$')
  if not status then
    return false, 'not a run state (8 fields separated by |, its numbers in digits)'
  end
  if not STATUSES[status] or not TRIGGERS[trigger] then
    return false, 'an unknown status or trigger'
  end
  local s = {
    status = status, attempt = digits(attempt, MAX_WHOLE), token = token,
    until_ms = digits(until_ms, MAX_INSTANT), fence = digits(fence, MAX_WHOLE),
    trigger = trigger, started_ms = digits(started_ms, MAX_INSTANT), runner = runner,
  }
  if not (s.attempt and s.until_ms and s.fence and s.started_ms) then
    return false, 'attempt, until_ms, fence or started_ms is not a whole number (or an instant)'
  end
  return s
end

-- FIRST LOOK: a script's first look, if it has one, goes here (scripts.py).

local function encode_state(s)
  return table.concat({
    s.status, int(s.attempt), s.token, int(s.until_ms), int(s.fence), s.trigger,
    int(s.started_ms), s.runner,
  }, '|')
end

-- The hash field naming the slot of the last run that took a lease (a win, or a lease
-- revived by a heartbeat). With overlap protection a lease is taken only while no other
-- is live, so this run's is the only lease besides the caller's that can be live: found
-- without a scan, whatever the active set holds (one claim reads a sample of a large one).
local HOLDER_FIELD = 'holder'

-- A slot's progress (run.save_progress: JSON text, kept for the slot's next attempt) is
-- the field of the state hash named for the slot with this in front: slot ids are digits
-- or start with 'm', so it never meets a slot's own field or the job's. It goes when the
-- run settles for good, or when the slot is forgotten.
local PROGRESS_PREFIX = 'p:'

-- How long the holder's lease has left, if it is live and not the caller's (0 if not).
local function holder_live_ms(state_key, slot, now)
  local holder = redis.call('HGET', state_key, HOLDER_FIELD)
  if not holder or holder == slot then return 0 end
  local h = decode_state(redis.call('HGET', state_key, holder))
  if h and h.status == 'running' and h.until_ms > now then return h.until_ms - now end
  return 0
end


-- One results member per attempt, scored by the slot's instant:
--   slot|attempt|status|started_ms|finished_ms|fence|trigger|runner|error
-- then the history bounds: the newest history_size members, none older than
-- history_ttl_ms (0 = no age limit).
local function record_result(results_key, slot, slot_score, s, status, now, err,
                             history_size, history_ttl_ms, bad)
  local member = table.concat({
    slot, int(s.attempt), status, int(s.started_ms), int(now), int(s.fence), s.trigger,
    s.runner, err,
  }, '|')
  -- pcall: the history is a record of what happened, never a reason for the run's state
  -- not to move on. A results key of another type (another client's) costs the entry.
  local added = redis.pcall('ZADD', results_key, slot_score, member)
  if type(added) == 'table' and added.err then
    if bad then bad[#bad + 1] = {results_key, '', 'cannot take a result: ' .. added.err, ''} end
    return
  end
  redis.call('ZREMRANGEBYRANK', results_key, 0, -(history_size + 1))
  if history_ttl_ms > 0 then
    redis.call('ZREMRANGEBYSCORE', results_key, '-inf', '(' .. int(now - history_ttl_ms))
  end
end

-- Fleet permits (a job's or a timer kind's max_concurrent_fleet): a sorted set of the
-- runs that hold one (a slot id, or a timer's key), each scored with its lease's expiry.
-- A permit is its run's lease: the run's finish gives it back, and one whose lease ran
-- out is free again (its runner vanished: whoever takes the run over takes a permit
-- anew), so a dead instance's permits come back a lease later. A permit scored beyond the
-- longest lease is none anarchon wrote: it is dropped, and reported.
local PERMIT_MAX_MS = 24 * 3600 * 1000

local function drop_stale_permits(permits_key, now, bad)
  redis.call('ZREMRANGEBYSCORE', permits_key, '-inf', int(now))
  local far = redis.call('ZRANGEBYSCORE', permits_key, '(' .. int(now + PERMIT_MAX_MS),
    '+inf', 'LIMIT', 0, 16)
  for _, member in ipairs(far) do
    bad[#bad + 1] = {permits_key, excerpt(member),
      'a permit held beyond the longest lease: dropped', ''}
    redis.call('ZREM', permits_key, member)
  end
end

-- The permits free under limit (a permit of member's, if it holds one, counts as free
-- to it), and the ms until the soonest held one expires (nil when none is held).
local function free_permits(permits_key, member, now, limit, bad)
  drop_stale_permits(permits_key, now, bad)
  local held = redis.call('ZCARD', permits_key)
  if member and redis.call('ZSCORE', permits_key, member) then held = held - 1 end
  local first = redis.call('ZRANGE', permits_key, 0, 0, 'WITHSCORES')
  local soonest = first[2] and math.max(tonumber(first[2]) - now, 1) or nil
  return limit - held, soonest
end

-- A run's permit given back (permits_key nil: the caller's job has no fleet limit, and
-- sent no permits key: the common case costs no more than before).
local function drop_permit(permits_key, member)
  if permits_key then redis.call('ZREM', permits_key, member) end
end

-- Take (or keep) member's permit until until_ms when one is free under limit (0: no
-- limit, nothing is written). Returns true, or false and the ms until the soonest held
-- permit expires.
local function take_permit(permits_key, member, until_ms, now, limit, bad)
  if limit <= 0 then return true end
  local free, soonest = free_permits(permits_key, member, now, limit, bad)
  if free <= 0 then return false, soonest or 1 end
  redis.call('ZADD', permits_key, int(until_ms), member)
  return true
end
