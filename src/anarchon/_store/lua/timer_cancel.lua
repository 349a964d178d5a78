-- timer_cancel: cancel a key's timer.
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] meta (hash)
-- KEYS[4] progress (hash): a firing's progress goes with a timer forgotten here
-- ARGV: key
-- Replies {1} when a timer was cancelled, {0} when the key had none.
-- A firing in flight goes on (it cannot be called back), but nothing follows it: no
-- retry, rearm or recurrence; the key is forgotten once it settles.
local timers_key, due_key, meta_key, progress_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key = ARGV[1]

local t = decode_timer(redis.call('HGET', timers_key, key))
if t == false then
  -- A record that does not read: cancelling the key forgets it.
  store_timer(timers_key, due_key, key, nil)
  redis.call('HDEL', progress_key, key)
  return {1}
end
if not t or (t.status == 'f' and not t.due_ms) then return {0} end
if t.status == 'f' then
  -- A new generation with nothing due: the firing's finish sees it was replaced.
  t.gen = next_gen(meta_key)
  t.due_ms, t.schedule, t.payload = nil, '', ''
  store_timer(timers_key, due_key, key, t)
else
  store_timer(timers_key, due_key, key, nil)
  redis.call('HDEL', progress_key, key)
end
return {1}
