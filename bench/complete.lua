-- IDEM.COMPLETE for the Lua baseline of bench/begin.lua: only the holder of
-- the in-progress record (exact token) stores the response.
--
-- KEYS[1]  the record (a hash)
-- ARGV[1]  token  ARGV[2]  status  ARGV[3]  body  ARGV[4..]  name, value, ...

local rec = redis.call('HMGET', KEYS[1], 'state', 'token')
if not rec[1] then
  return redis.error_reply('NOTFOUND no idempotency record under this key')
end
if rec[2] ~= ARGV[1] then
  return redis.error_reply('STALE token is not the current holder\'s')
end
if rec[1] == 'completed' then
  return redis.error_reply('COMPLETED the record is already completed')
end
local status = tonumber(ARGV[2])
if not status or status < 100 or status > 599 then
  return redis.error_reply('BADARG status must be between 100 and 599')
end
local headers = {}
for i = 4, #ARGV do
  headers[#headers + 1] = ARGV[i]
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', KEYS[1], 'lease_until')
redis.call('HSET', KEYS[1], 'state', 'completed', 'status', status, 'body', ARGV[3],
  'headers', cmsgpack.pack(headers), 'completed_at', now)
return redis.status_reply('OK')
