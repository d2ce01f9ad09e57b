-- renew: extend an IN_FLIGHT lease whose request is still upstream (the filter
-- that forwarded it renews it at a third of its length). Owner-checked: a lease
-- that moved on (completed, released, claimed) is not ours to extend.
--
-- KEYS[1] = idem:{<nonce>}
-- ARGV[1] = owner
-- ARGV[2] = lease in ms (from now)
--
-- Returns 'OK', 'MISSING' or 'NOT_OWNER'. Redis is a cache: SQL decides whether
-- the lease is still the owner's; this keeps the fast path's answer (IN_FLIGHT,
-- a live holder: age 0 again) in step with it.
local h = redis.call('HMGET', KEYS[1], 'state', 'owner')
if not h[1] then
  return 'MISSING'
end
if h[1] ~= 'IN_FLIGHT' or h[2] ~= ARGV[1] then
  return 'NOT_OWNER'
end
redis.call('HSET', KEYS[1], 'lease_ms', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 'OK'
