-- record_result (claim-only strategies): one member of the job's results sorted
-- set, then the history bound, in one call.
-- KEYS[1] results (sorted set)
-- ARGV: score (the slot's instant), member, history_size
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[3]) + 1))
return 1
