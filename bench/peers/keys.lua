-- wrk script for the peer benchmark (bench/peers/peers.py). Every request is
-- POST PATH with the body {"amount":100} and an Idempotency-Key:
--   wrk ... -s keys.lua URL -- new PREFIX PATH       a fresh key per request
--   wrk ... -s keys.lua URL -- replay PREFIX PATH N  PREFIX-0 .. PREFIX-(N-1)
--                                                     in turn (completed beforehand)
-- done() prints one line "PEERS {json}" that the driver reads.
local threads = {}
local serial = 0

function setup(thread)
  thread:set("tid", serial)
  serial = serial + 1
  table.insert(threads, thread)
end

local mode, prefix, path, n
local counter = 0
local headers = { ["Content-Type"] = "application/json" }
-- IDEM_BENCH_BODY and IDEM_BENCH_AUTHORIZATION: another body, and an
-- Authorization header (bench/functions/http.sh: the example API's token).
local body = os.getenv("IDEM_BENCH_BODY") or '{"amount":100}'
local authorization = os.getenv("IDEM_BENCH_AUTHORIZATION")
if authorization then headers["Authorization"] = authorization end

function init(args)
  mode, prefix, path, n = args[1], args[2], args[3], tonumber(args[4] or "1")
  prefix = prefix .. "-" .. tostring(tid)
  if mode == "replay" then prefix = args[2] end
end

function request()
  local key
  if mode == "new" then
    key = prefix .. "-" .. counter
  else
    key = prefix .. "-" .. (counter % n)
  end
  counter = counter + 1
  headers["Idempotency-Key"] = key
  return wrk.format("POST", path, headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'PEERS {"requests":%d,"duration_us":%d,"non_2xx_3xx":%d,"connect":%d,"read":%d,"write":%d,"timeout":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
