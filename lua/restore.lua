-- restore: copy the SQL row (the truth) back into the cache after Redis was
-- found to have lost it (flush, failover, expired lease), so the fast path
-- answers correctly again.
--
-- Several acquirers may restore the same key at once, each from a snapshot
-- read a moment earlier. A snapshot never moves the cache backwards:
-- IN_FLIGHT < NEEDS_REVIEW < DONE/FAILED.
--
-- KEYS[1] = idem:{<nonce>}
-- ARGV[1] = state (IN_FLIGHT | DONE | FAILED | NEEDS_REVIEW)
-- ARGV[2] = param_hash
-- ARGV[3] = subject_hash
-- ARGV[4] = scope
-- ARGV[5] = owner ('' when none)
-- ARGV[6] = result ('' when none)
-- ARGV[7] = TTL in ms
--
-- Returns 'OK' or 'KEPT' (the cache already held a later state).
local rank = { IN_FLIGHT = 1, NEEDS_REVIEW = 2, DONE = 3, FAILED = 3 }
local cur = redis.call('HGET', KEYS[1], 'state')
if cur and (rank[cur] or 0) > (rank[ARGV[1]] or 0) then
  return 'KEPT'
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1],
  'state', ARGV[1],
  'param_hash', ARGV[2],
  'subject_hash', ARGV[3],
  'scope', ARGV[4])
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[5])
end
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'result', ARGV[6])
end
if ARGV[1] == 'IN_FLIGHT' then
  redis.call('HSET', KEYS[1], 'lease_ms', ARGV[7])
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return 'OK'
