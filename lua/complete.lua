-- complete: record the terminal state, but only for the current owner.
--
-- idemd has already won the same owner-checked UPDATE in SQL (the truth), so
-- this only keeps the cache in step. The owner check still matters: if the
-- cache disagrees with SQL (it lost state and was refilled in between), it
-- answers instead of writing, and idemd drops the key so the next acquire
-- refills it from SQL.
--
-- KEYS[1] = idem:{<nonce>}
-- ARGV[1] = owner
-- ARGV[2] = DONE | FAILED
-- ARGV[3] = result (StoredResult JSON)
-- ARGV[4] = terminal retention in ms
--
-- Returns 'OK', 'MISSING' (nothing cached: the next acquire refills from SQL)
-- or 'NOT_OWNER' (the cache holds someone else's state).
local h = redis.call('HMGET', KEYS[1], 'state', 'owner', 'result')
if not h[1] then
  return 'MISSING'
end
if h[2] ~= ARGV[1] then
  return 'NOT_OWNER'
end
if h[1] ~= 'IN_FLIGHT' then
  -- A repeated complete (the filter retried the callout) is fine; a
  -- different outcome for the same owner is not.
  if h[1] == ARGV[2] and h[3] == ARGV[3] then
    return 'OK'
  end
  return 'NOT_OWNER'
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'result', ARGV[3])
redis.call('HDEL', KEYS[1], 'lease_ms')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 'OK'
