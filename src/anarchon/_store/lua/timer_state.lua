-- Shared definitions of the timer scripts. anarchon prepends lease_state.lua (the
-- server clock, int) and this file to timer_set.lua, timer_cancel.lua,
-- timer_claim.lua, timer_heartbeat.lua and timer_finish.lua when it loads them.
--
-- A kind of timer (or one bucket of it) has three keys under one hash tag:
--   timers (hash)       key -> the timer's state (below)
--   due (sorted set)    key -> when the key needs attention next: its due time while it
--                       is pending, its lease's expiry while it fires, its retry time
--                       while it waits for a retry. A claim takes what is due by now.
--   meta (hash)         gen: the kind's generation counter; fence: its fencing counter
--
-- A timer's state is one field of the timers hash, named for its key:
--   gen|due_ms|status|attempt|token|until_ms|fence|fire_gen|fire_due_ms|trigger|runner|schedule|payload
-- gen, due_ms, schedule, payload: the newest set (due_ms empty: cancelled while firing);
-- status p (pending: nothing in flight), f (firing: the attempt holding token holds a
-- lease until until_ms), r (retry: its next attempt may start at until_ms);
-- attempt, token, fence, fire_gen, fire_due_ms, trigger, runner: the firing in flight (or the
-- one waiting for its retry). A firing of an older generation than gen (the key was set
-- again, or cancelled, while it fired) goes on, but nothing follows it: no retry, no
-- rearm, no recurrence; the newest generation is pending once it settles.
-- The payload comes last: it may hold any bytes, '|' included.

-- Returns the timer, nil when there is none, or false and a problem when the field holds
-- something else (what the store holds is input, lease_state.lua): a malformed timer.

local function decode_timer(raw)
  if not raw then return nil end
  -- One pattern checks every number's digits at once (claims are hot); a due time may
  -- be empty (cancelled while a firing was in flight).
  local gen, due, status, attempt, token, until_ms, fence, fire_gen, fire_due, trigger,
        runner, schedule, payload = string.match(raw,
    '^(%d+)|(%d*)|([pfr])|(%d+)|([^|]*)|(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if not gen then
    return false, 'not a timer (13 fields separated by |, its numbers in digits)'
  end
  local t = {
    gen = digits(gen, MAX_WHOLE), due_ms = due ~= '' and digits(due, MAX_INSTANT) or nil,
    status = status, attempt = digits(attempt, MAX_WHOLE), token = token,
    until_ms = digits(until_ms, MAX_INSTANT), fence = digits(fence, MAX_WHOLE),
    fire_gen = digits(fire_gen, MAX_WHOLE), fire_due_ms = digits(fire_due, MAX_INSTANT),
    trigger = trigger, runner = runner, schedule = schedule, payload = payload,
  }
  if not (t.gen and t.attempt and t.until_ms and t.fence and t.fire_gen and t.fire_due_ms)
    or (due ~= '' and not t.due_ms) or (status == 'p' and not t.due_ms) then
    return false, 'a number that is not a whole number (or an instant)'
  end
  return t
end

-- The kind's next generation (a set, a cancel during a firing, a rearm). A counter that
-- does not read (HINCRBY would refuse it, and with it every set of the kind), or that
-- nears 2^53 (past it, no timer of the kind would read), is set first to the server clock
-- in microseconds: above any generation anarchon counted from 0.
local function next_gen(meta_key)
  local raw = redis.call('HGET', meta_key, 'gen')
  local gen = whole(raw)
  if raw and not (gen and gen <= MAX_COUNTER) then
    redis.call('HSET', meta_key, 'gen', int(server_now_ms() * 1000))
  end
  return redis.call('HINCRBY', meta_key, 'gen', 1)
end

local function encode_timer(t)
  return table.concat({
    int(t.gen), t.due_ms and int(t.due_ms) or '', t.status, int(t.attempt), t.token,
    int(t.until_ms), int(t.fence), int(t.fire_gen), int(t.fire_due_ms), t.trigger, t.runner,
    t.schedule, t.payload,
  }, '|')
end

-- A pending timer: nothing in flight.
local function pending_timer(gen, due_ms, schedule, payload)
  return {
    gen = gen, due_ms = due_ms, status = 'p', attempt = 0, token = '', until_ms = 0,
    fence = 0, fire_gen = 0, fire_due_ms = 0, trigger = '', runner = '', schedule = schedule,
    payload = payload,
  }
end

-- When the key needs attention next (its score in the due set).
local function next_attention_ms(t)
  if t.status == 'p' then return t.due_ms end
  return t.until_ms
end

-- Store the timer, or forget it when nothing is left of it (a settled firing of a
-- timer that was cancelled, spent, or not set again).
local function store_timer(timers_key, due_key, key, t)
  if t == nil then
    redis.call('HDEL', timers_key, key)
    redis.call('ZREM', due_key, key)
    return
  end
  redis.call('HSET', timers_key, key, encode_timer(t))
  redis.call('ZADD', due_key, int(next_attention_ms(t)), key)
end

-- The firing in flight is over: what is left is the newest generation, if it is not
-- the one that fired (set again while it fired), or nothing (cancelled, or spent).
local function after_firing(t)
  if t.gen ~= t.fire_gen and t.due_ms then
    return pending_timer(t.gen, t.due_ms, t.schedule, t.payload)
  end
  return nil
end

-- A firing's progress (fire.save_progress, timer_save_progress.lua) is kept in the
-- kind's progress hash under the key, as '<generation>|<text>', while the firing is in
-- flight or waits for its retry; it goes when the firing is over, and when the key is
-- set again or cancelled with no firing in flight.
-- The progress an attempt of t's firing reads: its generation's, or '' (none, another
-- generation's, or one that does not read: reported in bad).
local function firing_progress(progress_key, key, t, bad)
  local raw = redis.call('HGET', progress_key, key)
  if not raw then return '' end
  local gen, text = string.match(raw, '^(%d+)|(.*)$')
  if not gen then
    bad[#bad + 1] = {progress_key, excerpt(key), "not a firing's progress (<generation>|<json>)",
      excerpt(raw)}
    return ''
  end
  if tonumber(gen) ~= t.fire_gen then return '' end
  return text
end

-- Key groups (a kind's max_concurrent_per_group): a key's group is its text before the
-- first group_by separator (the whole key without one). At most group_max firings of a
-- group are in flight at once: each holds a permit in the group's permits (a sorted set
-- per group, lease_state.lua's fleet permits). A due timer whose group holds every permit
-- waits in the group's waiting set (scored as it was in the due index) instead of the
-- due index, so that a group with thousands of due timers does not hold the others back;
-- the kind's groups index scores each group with waiting timers by when to look at it
-- again (a finish of one of its firings: at once; else when its soonest lease ends, or a
-- second at most). A claim moves a group's waiting timers back to the due index, oldest
-- first, as permits free.
local GROUP_RECHECK_MS = 1000

local function group_of(key, sep)
  local at = string.find(key, sep, 1, true)
  if at then return string.sub(key, 1, at - 1) end
  return key
end

-- Look at group again at when (or sooner, if the index says so already).
local function recheck_group(groups_key, group, when)
  local at = tonumber(redis.call('ZSCORE', groups_key, group))
  if not at or when < at then redis.call('ZADD', groups_key, int(when), group) end
end
