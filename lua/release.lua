-- release: forget an IN_FLIGHT operation whose request provably never reached
-- the upstream, so the same nonce can be acquired again. Owner-checked: a
-- stale executor must not free an operation someone else now holds.
--
-- KEYS[1] = idem:{<nonce>}
-- ARGV[1] = owner
--
-- Returns 'OK', 'MISSING' or 'NOT_OWNER'.
local h = redis.call('HMGET', KEYS[1], 'state', 'owner')
if not h[1] then
  return 'MISSING'
end
if h[1] ~= 'IN_FLIGHT' or h[2] ~= ARGV[1] then
  return 'NOT_OWNER'
end
redis.call('DEL', KEYS[1])
return 'OK'
