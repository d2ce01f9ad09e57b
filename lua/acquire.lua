-- acquire: read and write the operation's state in one atomic step, so two
-- concurrent confirms can never both believe they are first (a SETNX followed
-- by more commands cannot promise that).
--
-- KEYS[1] = idem:{<nonce>}   (hash-tagged: one slot in Redis Cluster)
-- ARGV[1] = param_hash
-- ARGV[2] = subject_hash
-- ARGV[3] = scope
-- ARGV[4] = owner            (fresh token, minted by idemd for this attempt)
-- ARGV[5] = lease in ms      (the IN_FLIGHT TTL)
--
-- Returns {outcome, detail, age_ms}:
--   {'ACQUIRED', owner, 0}          the caller owns it now (idemd still has to win the SQL insert)
--   {'PARAM_MISMATCH', '', 0}       same nonce, different binding: a security event
--   {'DONE'|'FAILED', result, 0}    replay the stored result
--   {'NEEDS_REVIEW', '', 0}
--   {'IN_FLIGHT', owner, age_ms}    someone holds it; age_ms lets idemd tell a
--                                   live holder from a copy left behind by a release
--                                   that could only reach SQL
local h = redis.call('HMGET', KEYS[1],
  'state', 'param_hash', 'subject_hash', 'scope', 'owner', 'result', 'lease_ms')
local st = h[1]

if not st then
  redis.call('HSET', KEYS[1],
    'state', 'IN_FLIGHT',
    'param_hash', ARGV[1],
    'subject_hash', ARGV[2],
    'scope', ARGV[3],
    'owner', ARGV[4],
    'lease_ms', ARGV[5])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return {'ACQUIRED', ARGV[4], 0}
end

-- The nonce is bound to one subject, scope and set of parameters. Anything
-- else arriving with it was tampered with: refuse before revealing any result.
if h[2] ~= ARGV[1] or h[3] ~= ARGV[2] or h[4] ~= ARGV[3] then
  return {'PARAM_MISMATCH', '', 0}
end

if st == 'DONE' or st == 'FAILED' then
  return {st, h[6] or '', 0}
end

if st == 'NEEDS_REVIEW' then
  return {st, '', 0}
end

-- IN_FLIGHT: the caller must wait and poll, never re-send.
local age = 0
local lease = tonumber(h[7] or '')
local pttl = redis.call('PTTL', KEYS[1])
if lease and pttl >= 0 then
  age = lease - pttl
end
return {'IN_FLIGHT', h[5] or '', age}
