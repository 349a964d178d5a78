-- claim: decide whether the caller runs a slot of a job (the lease flowchart).
-- KEYS[1] state (hash)   KEYS[2] active (set)   KEYS[3] slots (sorted set)
-- KEYS[4] runs (stream)  KEYS[5] results (sorted set)  KEYS[6] permits (sorted set:
-- lease_state.lua's fleet permits; sent with fleet_max only, by a job with a limit)
-- ARGV: slot, slot_score, token, runner, lease_ms, max_attempts, allow_overlap (0/1),
--       trigger, keep_ms, history_size, history_ttl_ms, trim_runs_by_id (0/1: XTRIM MINID
--       exists, Redis 6.2+ and Valkey), may_start (0/1), skip_if_blocked (0/1: a first claim
--       answered overlap records the slot as skipped, once, for every instance; 2: a slot
--       waiting behind an older run that a newer slot replaces in the wait, overlap
--       'buffer_one': recorded as skipped if it has not started, blocked or not;
--       text starting 'excluded:': a scheduled slot the job's exclude= leaves out,
--       recorded as skipped with this text as the reason by its first claim),
--       probe (0/1: only ask whether the caller's token holds a live lease; changes nothing),
--       replace (0/1: overlap 'replace': a first claim blocked by older runs of the job
--       ends them, recorded cancelled, and wins),
--       fleet_max (max_concurrent_fleet: the most of the job's runs at once in the fleet,
--       each holding a permit while its lease lives; absent or 0 for no limit),
--       max_runs (the job's runs that may end, ok or finally failed, counted in
--       RUNS_FIELD; 0 for no bound),
--       fingerprint (of the caller's definition of the job: a first claim of a scheduled
--       or backfilled slot starts nothing while IN_FORCE_FIELD names another; '' or
--       absent: not asked)
-- Every reply is {kind, attempt, fence, ms, text, orphans, malformed}:
--   {'won', attempt, fence, lease_ms_left, trigger, orphans, malformed, progress}  the
--                     caller runs this attempt; progress: what the slot's last attempt
--                     saved (run.save_progress), or ''.
--   {'running', 0, 0, ms}   the run is in progress (or waits for its retry): be a backup,
--                           ask again in ms
--   {'overlap', 0, 0, ms, '', orphans}  another run of the job is unsettled (ms: the longest
--                              time left on its lease or retry delay, 0 for orphans); this
--                              slot does not start; text 'fleet': the job's runs hold
--                              every permit (ms: until the soonest expires); the slot
--                              waits, it is not skipped
--   {'done', 0, 0, 0, status, orphans}  the run is settled ('forgotten': a later claim found
--                     no state; 'skipped': another instance's first claim found it blocked or
--                     paused; 'paused': this claim found the job paused, and recorded the slot
--                     as skipped; 'excluded': this claim recorded the excluded slot as skipped;
--                     'finished': the job's runs reached its max_runs: nothing is recorded,
--                     and the job is marked finished (FINISHED_FIELD); 'outdated': the
--                     caller's definition of the job is not the one in force: nothing is
--                     recorded; 'superseded': this claim (skip_if_blocked 2) recorded it as
--                     skipped; 'malformed': the slot's state, or the job's fence, does not
--                     read: nothing starts)
-- orphans (on a slot's first claim only, at most ORPHANS_MAX): other unsettled slots of
-- the job that nobody holds any more (lease expired, or retry due). Claiming them is how
-- instances notice a dead runner without polling every run they back up.
-- malformed: {key, field, problem, excerpt} for each entry this claim met that does not
-- read (lease_state.lua): skipped, left as it is, and reported for the caller to
-- quarantine.
local state_key, active_key, slots_key, runs_key, results_key, permits_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local slot = ARGV[1]
local slot_score = tonumber(ARGV[2])
local token = ARGV[3]
local runner = ARGV[4]
local lease_ms = tonumber(ARGV[5])
local max_attempts = tonumber(ARGV[6])
local allow_overlap = ARGV[7] == '1'
local trigger = ARGV[8]
local keep_ms = tonumber(ARGV[9])
local history_size = tonumber(ARGV[10])
local history_ttl_ms = tonumber(ARGV[11])
local trim_runs_by_id = ARGV[12] == '1'
local may_start = ARGV[13] == '1'
local skip_if_blocked = ARGV[14] == '1'
local superseded = ARGV[14] == '2'
local excluded = string.sub(ARGV[14], 1, 9) == 'excluded:' and ARGV[14] or nil
local probe = ARGV[15] == '1'
local replace = ARGV[16] == '1'
local fleet_max = tonumber(ARGV[17] or '0')
local max_runs = tonumber(ARGV[18] or '0')
local fingerprint = ARGV[19] or ''

local now = server_now_ms()

-- The other unsettled slots of this job. With overlap protection a job's runs go
-- one at a time, oldest first, so a slot's first claim is blocked by any other
-- unsettled run: one holding a live lease, one waiting for its retry, or one
-- nobody holds any more (an orphan, which the claimer then takes over). A retry
-- is blocked only by a live lease. Returns the longest time left on the blocking
-- leases and retry delays (nil if nothing blocks; 0 if only orphans do), and the
-- orphans: runs whose lease expired, or whose retry is due.
local bad = {}
-- When a job's active set is read in part: the soonest its first claims ask again.
local SAMPLED_WAIT_MS = 1000

local function scan_active(first_claim)
  local blocked_ms = nil
  local orphans = {}
  local members, sampled = members_to_scan(active_key)
  if sampled and first_claim and not allow_overlap then
    -- More unsettled runs than one claim looks at: the slot waits behind them (they
    -- drain as they are taken over and settle, ORPHANS_MAX per claim); asked again in a
    -- second at the soonest.
    blocked_ms = SAMPLED_WAIT_MS
  end
  for _, other in ipairs(members) do
    if not is_slot_id(other) then
      -- Not a run's slot: it leaves the set of unsettled runs (it would block the job's
      -- slots for ever), reported with its name.
      bad[#bad + 1] = {active_key, excerpt(other), 'not a slot id: removed from the set', ''}
      redis.call('SREM', active_key, other)
    elseif other ~= slot then
      local raw = redis.call('HGET', state_key, other)
      local o, problem = decode_state(raw)
      if o == false then
        -- A state that does not read: reported; it leaves the set (the state stays).
        bad[#bad + 1] = {state_key, other, problem .. ': removed from the active set',
          excerpt(raw)}
        redis.call('SREM', active_key, other)
      elseif o == nil or not (o.status == 'running' or o.status == 'retry') then
        -- Settled, or forgotten: no unsettled run, so not one of the set (a finish
        -- removes its own; another client's member would block the job for ever).
        redis.call('SREM', active_key, other)
      else
        local left_ms = math.max(o.until_ms - now, 0)
        if left_ms == 0 and #orphans < ORPHANS_MAX then orphans[#orphans + 1] = other end
        local blocks = (first_claim or (o.status == 'running' and left_ms > 0))
          and not allow_overlap
        if blocks then blocked_ms = math.max(blocked_ms or 0, left_ms) end
      end
    end
  end
  if not allow_overlap then
    -- The holder's lease is seen even when the sample missed it.
    local held_ms = holder_live_ms(state_key, slot, now)
    if held_ms > 0 then blocked_ms = math.max(blocked_ms or 0, held_ms) end
  end
  return blocked_ms, orphans
end

-- Forget settled runs that no claim can ask for any more: a slot is kept for
-- keep_ms after its instant (late and catch-up claims) and for keep_ms after it
-- settled (a backup of a long run asks again after the run ends). Scores start
-- as the slot's instant; a run still active, or settled less than keep_ms ago,
-- is scored again with the time to look at it next. A few per call keep the
-- script short.
local function trim_old_state()
  local horizon = now - keep_ms
  local old = redis.call('ZRANGEBYSCORE', slots_key, '-inf', '(' .. int(horizon),
    'LIMIT', 0, 32)
  for _, other in ipairs(old) do
    if not is_slot_id(other) then
      -- Not a slot: it leaves the index (the state hash, which it names no field of
      -- anarchon's, is not touched).
      bad[#bad + 1] = {slots_key, excerpt(other), 'not a slot id: removed from the index', ''}
      redis.call('ZREM', slots_key, other)
    elseif other ~= slot then
      local raw = redis.call('HGET', state_key, other)
      local o, problem = decode_state(raw)
      if o and (o.status == 'running' or o.status == 'retry') then
        redis.call('ZADD', slots_key, int(now), other)
      elseif o and o.until_ms >= horizon then
        redis.call('ZADD', slots_key, int(o.until_ms), other)
      else
        -- Settled long ago, or a state that does not read (reported as it goes): no
        -- claim asks for it again.
        if o == false then
          bad[#bad + 1] = {state_key, other, problem .. ': forgotten with its slot',
            excerpt(raw)}
        end
        redis.call('HDEL', state_key, other, PROGRESS_PREFIX .. other)
        redis.call('ZREM', slots_key, other)
        drop_permit(permits_key, other)
      end
    end
  end
end

-- first: a slot's first claim (a slot that finds no permit free waits for one, and is
-- told 'overlap' with the text 'fleet'); otherwise a retry or a takeover (told
-- 'running': the run waits in the store for whichever instance finds a permit first).
local function win(attempt, win_trigger, orphans, first)
  local permitted, wait_ms = take_permit(permits_key, slot, now + lease_ms, now, fleet_max, bad)
  if not permitted then
    if first then return {'overlap', 0, 0, wait_ms, 'fleet', orphans, bad} end
    return {'running', 0, 0, wait_ms, '', {}, bad}
  end
  -- The job's last fence, read strictly (lease_state.lua's last_fence): one near 2^53
  -- stops the job's wins, loudly, until an operator mends it.
  local last = last_fence(state_key, bad)
  if not last then return {'done', 0, 0, 0, 'malformed', {}, bad} end
  -- A job's fences follow the server's clock in microseconds (one more than the last
  -- when it won within the same millisecond), so they keep growing where the counter
  -- went back: a new job, a wiped store, a promoted replica that lacks the last wins.
  local fence = math.max(last + 1, now * 1000)
  redis.call('HSET', state_key, FENCE_FIELD, int(fence))
  local s = {
    status = 'running', attempt = attempt, token = token, until_ms = now + lease_ms,
    fence = fence, trigger = win_trigger, started_ms = now, runner = runner,
  }
  redis.call('HSET', state_key, slot, encode_state(s))
  redis.call('HSET', state_key, HOLDER_FIELD, slot)
  redis.call('SADD', active_key, slot)
  redis.call('ZADD', slots_key, slot_score, slot)
  -- pcall: the runs stream is a log, never a reason for a won run not to start (a stream
  -- whose last id another client put at the end of time refuses every entry).
  local logged = redis.pcall('XADD', runs_key, 'MAXLEN', history_size, '*',
    'slot', slot, 'attempt', attempt, 'token', token, 'runner', runner,
    'trigger', win_trigger, 'fence', int(fence))
  if type(logged) == 'table' and logged.err then
    bad[#bad + 1] = {runs_key, '', 'cannot take an entry: ' .. logged.err, ''}
  elseif history_ttl_ms > 0 and trim_runs_by_id then
    -- Entry ids are the server's milliseconds, so the age limit is an id.
    redis.call('XTRIM', runs_key, 'MINID', int(now - history_ttl_ms))
  end
  local progress = redis.call('HGET', state_key, PROGRESS_PREFIX .. slot) or ''
  return {'won', attempt, int(fence), lease_ms, win_trigger, orphans, bad, progress}
end

local raw_state = redis.call('HGET', state_key, slot)
local s, problem = decode_state(raw_state)
if s == false then
  -- This slot's state does not read: it is not run, nor overwritten (it may be a run
  -- that started), and it is reported; the job's other slots go on.
  bad[#bad + 1] = {state_key, slot, problem, excerpt(raw_state)}
  return {'done', 0, 0, 0, 'malformed', {}, bad}
end

-- A probe (a stopping instance asking about a claim whose reply it lost) learns
-- whether it holds a live lease, and changes nothing: it must not end an expired
-- attempt or win the next one, since it will not run it.
if probe then
  if s and s.status == 'running' and s.token == token and s.until_ms > now then
    return {'won', s.attempt, int(s.fence), s.until_ms - now, s.trigger, {}, bad}
  end
  return {'done', 0, 0, 0, s and s.status or 'forgotten', {}, bad}
end

-- No state on a later claim: the run settled and was forgotten. Only a first
-- claim, made while the slot is young enough to be remembered, starts a run.
if not s and not may_start then return {'done', 0, 0, 0, 'forgotten', {}, bad} end

-- A skipped slot: settled for every instance's claims of it, and in the history
-- with the reason.
local function skip(reason)
  local skipped = {
    status = 'skipped', attempt = 0, token = '', until_ms = now, fence = 0,
    trigger = trigger, started_ms = now, runner = runner,
  }
  redis.call('HSET', state_key, slot, encode_state(skipped))
  redis.call('ZADD', slots_key, slot_score, slot)
  record_result(results_key, slot, slot_score, skipped, 'skipped', now, reason,
    history_size, history_ttl_ms, bad)
end

-- overlap='replace': the job's older unsettled runs (running, waiting for a retry, or
-- orphaned) end, recorded cancelled with the reason; each leaves the active set, and
-- its token holds nothing from now on, so its runner's next heartbeat (or finish) is
-- refused and its handler is cancelled. The holder is seen even if the sample misses it.
local function replace_older()
  local members = members_to_scan(active_key)
  local holder = redis.call('HGET', state_key, HOLDER_FIELD)
  if holder then members[#members + 1] = holder end
  for _, other in ipairs(members) do
    if other ~= slot and is_slot_id(other) then
      local o = decode_state(redis.call('HGET', state_key, other))
      if o and (o.status == 'retry' or o.status == 'running') then
        -- The slot's instant: the id of a scheduled slot, the ms after 'm' of a manual one.
        local score = tonumber(other) or tonumber(string.match(other, '^m(%d+)')) or now
        record_result(results_key, other, score, o, 'cancelled', now,
          'replaced: slot ' .. slot .. ' started in its place (overlap replace)',
          history_size, history_ttl_ms, bad)
        o.status, o.until_ms, o.token = 'cancelled', now, ''
        redis.call('HSET', state_key, other, encode_state(o))
        redis.call('HDEL', state_key, PROGRESS_PREFIX .. other)
        redis.call('SREM', active_key, other)
        drop_permit(permits_key, other)
      end
    end
  end
end

-- No state: nobody has claimed this run yet.
if not s then
  trim_old_state()
  local manual = string.sub(slot, 1, 1) == 'm'
  if fingerprint ~= '' and not manual then
    local in_force = redis.call('HGET', state_key, IN_FORCE_FIELD)
    if in_force and in_force ~= fingerprint then
      -- A newer definition of the job is in force: its instances decide the slot.
      local _, orphans = scan_active(true)
      return {'done', 0, 0, 0, 'outdated', orphans, bad}
    end
  end
  if max_runs > 0 then
    -- max_runs: the runs that ended, and those under way (any of them may end counted).
    local ended = read_count(state_key, RUNS_FIELD, bad)
    if ended >= max_runs then
      redis.call('HSET', state_key, FINISHED_FIELD,
        'max_runs ' .. max_runs .. ' reached: ' .. ended .. ' runs ended')
      return {'done', 0, 0, 0, 'finished', {}, bad}
    end
    redis.call('HDEL', state_key, FINISHED_FIELD)  -- the bound may have been raised
    if not manual and ended + redis.call('SCARD', active_key) >= max_runs then
      skip('max_runs: ' .. max_runs .. ' runs have ended or are under way')
      local _, orphans = scan_active(true)
      return {'done', 0, 0, 0, 'skipped', orphans, bad}
    end
  end
  if excluded and not manual then
    -- Left out by the job's exclude=: settled as skipped, dead runs still taken over.
    skip(excluded)
    local _, orphans = scan_active(true)
    return {'done', 0, 0, 0, 'excluded', orphans, bad}
  end
  if not manual and redis.call('HEXISTS', state_key, PAUSED_FIELD) == 1 then
    -- Paused: the slot does not start (dead runs are still taken over).
    skip('paused: the job is paused')
    local _, orphans = scan_active(true)
    return {'done', 0, 0, 0, 'paused', orphans, bad}
  end
  if superseded then
    skip('overlap: a newer slot waits in its place (overlap buffer_one)')
    return {'done', 0, 0, 0, 'superseded', {}, bad}
  end
  local blocked_ms, orphans = scan_active(true)
  if blocked_ms and replace then
    replace_older()
    return win(1, trigger, {}, true)
  end
  if blocked_ms then
    if skip_if_blocked then
      skip('overlap: an older run of the job was not settled')
    end
    return {'overlap', 0, 0, blocked_ms, '', orphans, bad}
  end
  return win(1, trigger, orphans, true)
end

-- The caller already holds this attempt (a claim repeated after a lost reply),
-- while its lease is live. An expired one is not handed back: a backup may take
-- over at any moment, so the attempt is over, as any expired attempt is.
if s.status == 'running' and s.token == token and s.until_ms > now then
  local progress = redis.call('HGET', state_key, PROGRESS_PREFIX .. slot) or ''
  return {'won', s.attempt, int(s.fence), s.until_ms - now, s.trigger, {}, bad, progress}
end

if s.status == 'running' then
  if s.until_ms > now then return {'running', 0, 0, s.until_ms - now, '', {}, bad} end
  -- The lease expired: its runner vanished, and that attempt is over. Its token
  -- no longer holds anything: a late finish or heartbeat of it reports the loss.
  record_result(results_key, slot, slot_score, s, 'interrupted', now, 'lease expired',
    history_size, history_ttl_ms, bad)
  s.token = ''
  if s.attempt >= max_attempts then
    s.status, s.until_ms = 'interrupted', now
    redis.call('HSET', state_key, slot, encode_state(s))
    redis.call('HDEL', state_key, PROGRESS_PREFIX .. slot)
    redis.call('SREM', active_key, slot)
    drop_permit(permits_key, slot)
    count_run(state_key, 'interrupted', bad)
    return {'done', 0, 0, 0, 'interrupted', {}, bad}
  end
  -- Attempts are left: the run now waits for its next attempt, which starts at once.
  s.status, s.until_ms = 'retry', now
  redis.call('HSET', state_key, slot, encode_state(s))
end

if s.status == 'retry' then
  if s.until_ms > now then return {'running', 0, 0, s.until_ms - now, '', {}, bad} end
  local blocked_ms = scan_active(false)
  if blocked_ms then return {'running', 0, 0, blocked_ms, '', {}, bad} end
  -- Attempt 0: a run the fleet was asked for (anarchon run-now), not yet started.
  -- An expired attempt left no token: its runner vanished, and this one takes over.
  local next_trigger = 'retry'
  if s.attempt == 0 then next_trigger = s.trigger
  elseif s.token == '' then next_trigger = 'takeover' end
  return win(s.attempt + 1, next_trigger, {}, false)
end

-- ok, failed, interrupted, cancelled or skipped. A first claim of a skipped slot
-- still hears of orphans, so that every instance can take a dead run over.
if s.status == 'skipped' and may_start then
  local _, orphans = scan_active(true)
  return {'done', 0, 0, 0, s.status, orphans, bad}
end
return {'done', 0, 0, 0, s.status, {}, bad}
