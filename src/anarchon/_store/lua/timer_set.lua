-- timer_set: set a key's timer, replacing what was set before (the newest set wins).
-- KEYS[1] timers (hash)   KEYS[2] due (sorted set)   KEYS[3] meta (hash)
-- KEYS[4] progress (hash): an older generation's progress goes (none is in flight)
-- ARGV: key, at_ms (epoch ms, or '' to count delay_ms from the server's clock),
--       delay_ms, schedule ('' for a one-shot timer), payload,
--       hint channel ('' or absent for none)
-- Replies {gen, due_ms, replaced}: the new generation, when it is due, and 1 if it
-- replaced a timer the key had (one pending or waiting for its retry, or the next
-- generation of a firing, or a record that did not read), else 0.
-- When the key becomes the first of the kind (bucket) to need attention, the set is
-- published on the hint channel as '<due_ms> <KEYS[2]>': instances that sleep until a
-- later time look then. A hint is never relied on (instances also poll).
-- A firing of the key in flight goes on (it cannot be called back); the new
-- generation is due once it settles, and no retry, rearm or recurrence of the old
-- generation follows. An old generation waiting for its retry is dropped.
local timers_key, due_key, meta_key, progress_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local key = ARGV[1]
local at_ms = ARGV[2]
local delay_ms = ARGV[3]
local schedule = ARGV[4]
local payload = ARGV[5]
local hint_channel = ARGV[6] or ''

local now = server_now_ms()
local due_ms
if at_ms ~= '' then due_ms = tonumber(at_ms) else due_ms = now + tonumber(delay_ms) end
-- Generations grow per kind (and bucket), across a cancel and a new set of a key.
local gen = next_gen(meta_key)

local t = decode_timer(redis.call('HGET', timers_key, key))
local replaced = 0
-- A record that does not read is replaced: this set is what the key is to hold now.
if t == false then t, replaced = nil, 1 end
if t and not (t.status == 'f' and not t.due_ms) then replaced = 1 end
if t and t.status == 'f' then
  t.gen, t.due_ms, t.schedule, t.payload = gen, due_ms, schedule, payload
else
  t = pending_timer(gen, due_ms, schedule, payload)
  redis.call('HDEL', progress_key, key)
end
store_timer(timers_key, due_key, key, t)
if hint_channel ~= '' and t.status == 'p' then
  local first = redis.call('ZRANGE', due_key, 0, 0)
  if first[1] == key then
    -- pcall: a hint is never relied on, and a user the ACL lets set timers but not
    -- publish (no channel rule) must not see an error for a timer that is stored.
    redis.pcall('PUBLISH', hint_channel, int(due_ms) .. ' ' .. due_key)
  end
end
return {gen, int(due_ms), replaced}
