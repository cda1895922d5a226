-- IDEM.BEGIN written as a Lua script on a plain hash: the baseline that
-- scripts/bench-module.sh measures the module against. Same four outcomes,
-- same checks, in one round trip (EVALSHA).
--
-- KEYS[1]  the record (a hash)      KEYS[2]  the token counter (a string)
-- ARGV[1]  fingerprint  ARGV[2]  ttl-seconds  ARGV[3]  lease-ms
--
-- Replies: {'new', token} | {'in_flight', retry_after_ms}
--        | {'replay', status, body, {name, value, ...}} | {'mismatch'}
-- Hash fields: state, fp, token, created_at, expires_at, lease_until
-- (in_progress) or status, body, headers (msgpack), completed_at.

local ttl = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
if not ttl or ttl < 1 or ttl > 2592000 or ttl ~= math.floor(ttl) then
  return redis.error_reply('BADARG ttl must be between 1 and 2592000')
end
if not lease or lease < 1 or lease ~= math.floor(lease) then
  return redis.error_reply('BADARG LEASE must be a positive integer')
end

-- Lua has no SHA-256; SHA-1 of the fingerprint is the cheaper stand-in.
local fp = redis.sha1hex(ARGV[1])
local rec = redis.call('HMGET', KEYS[1], 'state', 'fp', 'lease_until', 'status', 'body', 'headers')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if not rec[1] then
  local token = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'state', 'in_progress', 'fp', fp, 'token', token,
    'created_at', now, 'expires_at', now + ttl * 1000, 'lease_until', now + lease)
  redis.call('PEXPIREAT', KEYS[1], now + ttl * 1000)
  return {'new', token}
end
if rec[2] ~= fp then
  return {'mismatch'}
end
if rec[1] == 'completed' then
  return {'replay', tonumber(rec[4]), rec[5], cmsgpack.unpack(rec[6])}
end
local lease_until = tonumber(rec[3])
if lease_until > now then
  return {'in_flight', lease_until - now}
end
-- Takeover: a larger token, a new lease, the original expiry.
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'token', token, 'lease_until', now + lease)
return {'new', token}
