#!lua name=idem
--[[
idem as a Redis Functions library: the module's commands for a Redis that
refuses MODULE LOAD (managed services). Each function answers byte for byte
what the module's command answers for the same history, in RESP2 and RESP3,
errors included. The calling contract is spec/functions.json:

  FCALL idem_begin         1 record          fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]
  FCALL idem_complete      2 record outbox   token status body [HEADER name value]... [MIRRORED]
  FCALL idem_abort         1 record          token
  FCALL idem_touch         1 record          token lease-ms
  FCALL_RO idem_get        1 record
  FCALL idem_mirror_claim  1+n outbox record...  claim-ms
  FCALL idem_mirror_ack    2 record outbox   token
  FCALL_RO idem_version    0

The scripts form (Redis 6, no FUNCTION) is this source without its first
line: EVALSHA <sha1> <numkeys> <keys...> <function name> <arguments...>.
Where redis.register_function exists the source registers the functions,
otherwise it dispatches ARGV[1].

Storage. A record is a hash under its own key:
  idem          "1", the layout's version: a hash without it is not a
                record (WRONGTYPE), one with another value is CORRUPT
  token         the fencing token, decimal
  state         in_progress | completed | aborted (a tombstone, see below)
  fp_sent       the fingerprint as sent, when it was exactly 32 bytes, or
  fp_sha256     SHA-256 of the fingerprint sent (any other length)
  created_at    Unix ms
  lease_until   Unix ms (in_progress)
  response      (completed) status, body and headers in the layout of
                IDEM.BEGIN ... PACKED (`body | (name-len name value-len
                value)... | status | header-count | body-len`), so a packed
                replay is the field itself
  completed_at  Unix ms (completed)
  mirror        pending | mirrored (completed)
The key's TTL is the record's expires_at (PEXPIREAT at creation; a takeover,
TOUCH and COMPLETE keep it; IDEM.GET's expires_at is PEXPIRETIME, -1 when
the key has none). Every record read back is validated: what does not
decode answers CORRUPT, never a Lua error.

The outbox of the mirror is a sorted set per hash slot (spec/outbox_slots.json
names it; the caller passes it as a key), members record keys, scored by the
time (Unix ms) each is next due to the writer: a completion that is not
MIRRORED adds its key scored by completed_at; idem_mirror_claim re-scores what
it hands out to now + claim-ms; idem_mirror_ack and claims of records gone,
mirrored or not completed remove the member.

Differences from the module (everything else answers the same bytes):
- WAIT never blocks: the functions answer at once, as the module does inside
  MULTI and Lua (in_flight while the lease is alive).
- No configs: lease-ms 30000, max-ttl 2592000 s, max-body-bytes 1048576,
  max-headers 256 and mirror-max-claim-ms 300000 are the module's
  defaults, as constants (nothing is read with CONFIG).
- No INFO idem, no IDEM.MIRROR.PULL (idem_mirror_claim takes the keys the
  writer found due in one slot's outbox instead, and answers their entries
  in the order of its keys) and no BLOCK.
- Tokens are max(last + 1, now_ms * 1000) with `last` the token the key
  holds (its record, or an abort's tombstone), not the node's last token:
  they only grow per key, and two keys can hold the same token (the
  module's are unique on the node). A key that expired or was deleted has
  no last: its next token rests on the clock, and is larger since a record
  lives a second at least, unless the key was deleted (DEL, not ABORT)
  within the millisecond of its token or the clock stepped back. There is
  no jump after a failover (the module's JUMP_MS): a replica promoted with
  a clock behind the old primary's can issue a token a holder on the lost
  primary had, for a key whose record it never received.
- IDEM.ABORT deletes the record; idem_abort leaves a tombstone (state
  aborted, the last token) that expires a second after that token's
  millisecond, so a BEGIN right after the abort still issues a larger token.
  Every function reads a tombstone as no record; EXISTS/TYPE see a hash.
- The outbox is a sorted set per slot that the caller names; the module
  keeps one index per database in memory. Keys deleted, renamed or expired
  behind idem's back leave their member until a claim meets it.
- OOM: idem_complete has no allow-oom flag, so Redis refuses it above
  maxmemory with the very error it gives the module's deny-oom COMPLETE.
  The other write functions carry allow-oom, and BEGIN of a new record
  checks used memory against maxmemory itself with INFO memory, as the
  module does (a replay, 409 or 422 still answers at maxmemory). A reading
  well below maxmemory (under 90%) is reused for up to 100 ms, so a jump of
  over a tenth of maxmemory within that time goes unseen for as long; a
  refused INFO counts as enough memory. The scripts form (no flags) checks
  with INFO on every new record and every COMPLETE.
- SHA-256 runs in Lua, at some 0.1 ms of the server per 64 bytes: every
  BEGIN with a fingerprint that is not 32 bytes pays it (the module hashes
  natively), and so do IDEM.GET and each claimed entry, which show the
  digest of a fingerprint kept as sent. Clients should send 32 bytes.
]]

local VERSION = 1

-- The module's limits (its configs' defaults) and bounds.
local DEFAULT_LEASE_MS = 30000
local MAX_TTL_SECS = 2592000
local MAX_BODY_BYTES = 1048576
local MAX_HEADERS = 256
local HEADER_OVERHEAD = 32 -- bytes each header counts besides its own
local MAX_CLAIM_MS = 300000 -- the module's mirror-max-claim-ms
local MAX_MS = 31622400000 -- 366 days
local TOKEN_LIMIT = 9007199254740992 -- 2^53
local TIME_LIMIT_MS = 9007199254740 -- 2^53 / 1000: no token after that
local MAX_SKEW_MS = 86400000 -- an observed token this far ahead moves nothing
local TOMBSTONE_MS = 1000

local WRONGTYPE = 'WRONGTYPE Operation against a key holding the wrong kind of value'
local OOM = "OOM command not allowed when used memory > 'maxmemory'."

-- Redis 7.0 runs a library's top level with `redis` as its only global:
-- everything else (string, math, bit, pcall...) is used inside functions.

---------------------------------------------------------------------------
-- Errors: `fail` throws an error reply; `run` turns it into the reply.

local function fail(text)
  error({ idem_error = text }, 0)
end

-- Error texts never carry CR, LF or NUL (the module replaces them too).
local function sanitize(text)
  return (string.gsub(text, '[%z\r\n]', ' '))
end

local function run(fn, keys, args)
  local ok, res = pcall(fn, keys, args)
  if ok then
    return res
  end
  if type(res) == 'table' and res.idem_error then
    return redis.error_reply(sanitize(res.idem_error))
  end
  error(res, 0)
end

---------------------------------------------------------------------------
-- Numbers. Decimal arguments are checked as strings (a u64 does not fit a
-- Lua number); values are converted once in range.

local U64_MAX = '18446744073709551615'

-- '007' -> '7'; digits only (checked by the caller).
local function strip(d)
  d = string.gsub(d, '^0+', '')
  if d == '' then
    return '0'
  end
  return d
end

-- Compares two stripped decimal strings of up to 20 digits (by value: Lua
-- compares strings with strcoll, which follows the server's locale).
local function less(a, b)
  if #a ~= #b then
    return #a < #b
  end
  local ha, hb = tonumber(string.sub(a, 1, 10)), tonumber(string.sub(b, 1, 10))
  if ha ~= hb then
    return ha < hb
  end
  return (tonumber(string.sub(a, 11)) or 0) < (tonumber(string.sub(b, 11)) or 0)
end

-- A strict unsigned decimal (`args::uint`): the stripped digits.
local function uint(arg, what)
  if arg == '' or string.find(arg, '%D') then
    fail('BADARG ' .. what .. ' must be a non-negative integer')
  end
  local d = strip(arg)
  if less(U64_MAX, d) then
    fail('BADARG ' .. what .. ' must be a non-negative integer')
  end
  return d
end

-- `args::ranged`; min and max as decimal strings. Returns a Lua number
-- (exact for every bound but the token's, see `token_arg`).
local function ranged(arg, what, min, max)
  local d = uint(arg, what)
  if less(d, min) or less(max, d) then
    fail('BADARG ' .. what .. ' must be between ' .. min .. ' and ' .. max)
  end
  return tonumber(d)
end

-- A token as issued: 1 ..= i64::MAX. One above 2^53 becomes a Lua number
-- that no stored token (all below 2^53) equals, so comparisons stay exact.
local function token_arg(arg)
  return ranged(arg, 'token', '1', '9223372036854775807')
end

-- An integer as a decimal string, for redis.call.
local function dec(n)
  return string.format('%d', n)
end

local function usage(text)
  fail('BADARG wrong number of arguments, usage: ' .. text)
end

-- String::from_utf8_lossy: each maximal invalid subsequence becomes U+FFFD.
local REPLACEMENT = '\239\191\189'
local function utf8_lossy(s)
  local byte = string.byte
  local out, i, n = {}, 1, #s
  while i <= n do
    local c = byte(s, i)
    local len, lo, hi = 0, 0x80, 0xBF
    if c < 0x80 then
      len = 1
    elseif c >= 0xC2 and c <= 0xDF then
      len = 2
    elseif c == 0xE0 then
      len, lo = 3, 0xA0
    elseif c == 0xED then
      len, hi = 3, 0x9F
    elseif c >= 0xE1 and c <= 0xEF then
      len = 3
    elseif c == 0xF0 then
      len, lo = 4, 0x90
    elseif c >= 0xF1 and c <= 0xF3 then
      len = 4
    elseif c == 0xF4 then
      len, hi = 4, 0x8F
    end
    if len == 1 then
      out[#out + 1] = string.char(c)
      i = i + 1
    elseif len == 0 then
      out[#out + 1] = REPLACEMENT
      i = i + 1
    else
      local j = 1
      local b = byte(s, i + 1)
      if b and b >= lo and b <= hi then
        j = 2
        while j < len do
          b = byte(s, i + j)
          if not b or b < 0x80 or b > 0xBF then
            break
          end
          j = j + 1
        end
      end
      if j == len then
        out[#out + 1] = string.sub(s, i, i + len - 1)
      else
        out[#out + 1] = REPLACEMENT
      end
      i = i + j
    end
  end
  return table.concat(out)
end

local function unknown_option(arg)
  fail("BADARG unknown option '" .. utf8_lossy(string.sub(arg, 1, 64)) .. "'")
end

local function is_word(arg, word)
  return #arg == #word and string.upper(arg) == word
end

---------------------------------------------------------------------------
-- SHA-256 (FIPS 180-4) with the `bit` library Redis ships: only for
-- fingerprints that are not 32 bytes, and where a digest is shown.

local K = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
}

local function be32(n)
  local floor = math.floor
  return string.char(floor(n / 16777216) % 256, floor(n / 65536) % 256, floor(n / 256) % 256, n % 256)
end

local function read32(s, at)
  local a, b, c, d = string.byte(s, at, at + 3)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

-- Each `bit` call costs about 0.1 us (a C call): a 64-byte block takes
-- some 1400 of them, so the rounds use as few as they can. Sums stay
-- unnormalised where only `bit` functions (which reduce modulo 2^32) and
-- further small sums read them.
local function sha256(msg)
  local band, bor, bxor = bit.band, bit.bor, bit.bxor
  local rshift, ror, tobit = bit.rshift, bit.ror, bit.tobit
  local byte, floor = string.byte, math.floor
  local bits = #msg * 8
  local pad = (55 - #msg) % 64
  msg = msg .. '\128' .. string.rep('\0', pad) .. be32(floor(bits / 4294967296)) .. be32(bits % 4294967296)
  local h0, h1, h2, h3 = 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a
  local h4, h5, h6, h7 = 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19
  local w = {}
  for chunk = 1, #msg, 64 do
    for i = 0, 15 do
      local a, b, c, d = byte(msg, chunk + i * 4, chunk + i * 4 + 3)
      w[i] = ((a * 256 + b) * 256 + c) * 256 + d
    end
    for i = 16, 63 do
      local x, y = w[i - 15], w[i - 2]
      local s0 = bxor(ror(x, 7), ror(x, 18), rshift(x, 3))
      local s1 = bxor(ror(y, 17), ror(y, 19), rshift(y, 10))
      w[i] = band(w[i - 16] + s0 + w[i - 7] + s1, 0xffffffff)
    end
    local a, b, c, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
    for i = 0, 63 do
      local s1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
      local ch = bxor(g, band(e, bxor(f, g)))
      local t1 = h + s1 + ch + K[i + 1] + w[i]
      local s0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
      local maj = bor(band(a, b), band(c, bor(a, b)))
      h, g, f, e = g, f, e, tobit(d + t1)
      d, c, b, a = c, b, a, tobit(t1 + s0 + maj)
    end
    h0, h1, h2, h3 = tobit(h0 + a), tobit(h1 + b), tobit(h2 + c), tobit(h3 + d)
    h4, h5, h6, h7 = tobit(h4 + e), tobit(h5 + f), tobit(h6 + g), tobit(h7 + h)
  end
  return be32(h0 % 4294967296) .. be32(h1 % 4294967296) .. be32(h2 % 4294967296)
    .. be32(h3 % 4294967296) .. be32(h4 % 4294967296) .. be32(h5 % 4294967296)
    .. be32(h6 % 4294967296) .. be32(h7 % 4294967296)
end

local function hex(s)
  return (string.gsub(s, '.', function(c)
    return string.format('%02x', string.byte(c))
  end))
end

---------------------------------------------------------------------------
-- The stored response: the PACKED replay's layout.

local function pack_response(status, body, headers)
  local parts = { body }
  for i = 1, #headers, 2 do
    local name, value = headers[i], headers[i + 1]
    parts[#parts + 1] = be32(#name) .. name .. be32(#value) .. value
  end
  parts[#parts + 1] = string.char(math.floor(status / 256), status % 256) .. be32(#headers / 2) .. be32(#body)
  return table.concat(parts)
end

-- (status, body length, flat headers) of a packed response, or nil and why.
local function unpack_response(p)
  local byte, sub = string.byte, string.sub
  local n = #p
  if n < 10 then
    return nil, 'does not decode: response'
  end
  local status = byte(p, n - 9) * 256 + byte(p, n - 8)
  local count, body_len = read32(p, n - 7), read32(p, n - 3)
  local fields_end = n - 10
  if status < 100 or status > 599 then
    return nil, 'has a status outside 100..599'
  end
  if body_len > fields_end or count > (fields_end - body_len) / 8 then
    return nil, 'does not decode: response'
  end
  local headers, at = {}, body_len + 1
  for _ = 1, count * 2 do
    if at + 3 > fields_end then
      return nil, 'does not decode: response'
    end
    local len = read32(p, at)
    if at + 3 + len > fields_end then
      return nil, 'does not decode: response'
    end
    headers[#headers + 1] = sub(p, at + 4, at + 3 + len)
    at = at + 4 + len
  end
  if at ~= fields_end + 1 then
    return nil, 'does not decode: response'
  end
  for i = 1, #headers, 2 do
    if headers[i] == '' then
      return nil, 'has a header without a name'
    end
  end
  return status, body_len, headers
end

---------------------------------------------------------------------------
-- Records.

local FIELDS = {
  'idem', 'token', 'state', 'fp_sent', 'fp_sha256', 'created_at',
  'lease_until', 'response', 'completed_at', 'mirror',
}

local function corrupt(why)
  fail('CORRUPT idem record ' .. why)
end

-- A stored time: digits, at most TIME_LIMIT_MS.
local function stored_time(v, what)
  if type(v) ~= 'string' or v == '' or string.find(v, '%D') or #v > 16 then
    corrupt('does not decode: ' .. what)
  end
  local n = tonumber(v)
  if n > TIME_LIMIT_MS then
    corrupt('has a time out of range')
  end
  return n
end

local function stored_token(v)
  if type(v) ~= 'string' or v == '' or string.find(v, '%D') then
    corrupt('does not decode: token')
  end
  local n = #v <= 16 and tonumber(v) or TOKEN_LIMIT
  if n == 0 or n >= TOKEN_LIMIT then
    corrupt('has a token outside 1..2^53')
  end
  return n
end

-- The record under `key`: nil (none, or an abort's tombstone: then also the
-- last token), or a table; WRONGTYPE for any other value, CORRUPT for a
-- record that does not decode.
local function load(key)
  local v = redis.pcall('HMGET', key, unpack(FIELDS))
  if v.err then
    if string.sub(v.err, 1, 9) == 'WRONGTYPE' then
      fail(WRONGTYPE)
    end
    error(v, 0)
  end
  if not v[1] then
    if redis.call('EXISTS', key) == 1 then
      fail(WRONGTYPE)
    end
    return nil, 0
  end
  if v[1] ~= '1' then
    corrupt('has an unknown layout')
  end
  local token = stored_token(v[2])
  local state = v[3]
  if state == 'aborted' then
    return nil, token
  end
  local r = { token = token, state = state, fp_sent = v[4], fp_sha256 = v[5] }
  local fp = r.fp_sent or r.fp_sha256
  if (r.fp_sent and r.fp_sha256) or not fp or #fp ~= 32 then
    corrupt('does not decode: fingerprint')
  end
  r.created_at = stored_time(v[6], 'created_at')
  if state == 'in_progress' then
    if v[8] then
      corrupt('does not decode: response')
    end
    r.lease_until = stored_time(v[7], 'lease_until')
  elseif state == 'completed' then
    if v[7] then
      corrupt('does not decode: lease_until')
    end
    local status, body_len, headers = unpack_response(v[8] or '')
    if not status then
      corrupt(body_len)
    end
    r.response, r.status, r.body_len, r.headers = v[8], status, body_len, headers
    r.completed_at = stored_time(v[9], 'completed_at')
    r.mirror = v[10]
    if r.mirror ~= 'pending' and r.mirror ~= 'mirrored' then
      corrupt('does not decode: mirror')
    end
  else
    corrupt('does not decode: state')
  end
  return r, token
end

-- The outbox must be a sorted set (or nothing yet): checked before any
-- write, so a call never fails half done.
local function check_outbox(outbox)
  local t = redis.call('TYPE', outbox)
  t = type(t) == 'table' and t.ok or t
  if t ~= 'zset' and t ~= 'none' then
    fail(WRONGTYPE)
  end
end

local function body(r)
  return string.sub(r.response, 1, r.body_len)
end

local function digest(r)
  return r.fp_sha256 or sha256(r.fp_sent)
end

-- Whether the fingerprint sent equals the record's: bytes against bytes
-- when both are as sent, else digests (a fingerprint that is not 32 bytes
-- never equals one that is).
local function same_fingerprint(r, sent)
  if r.fp_sent then
    return #sent == 32 and sent == r.fp_sent
  end
  return sha256(sent) == r.fp_sha256
end

-- The key's absolute expiry, -1 without one.
local function expires_at(key)
  local at = redis.pcall('PEXPIRETIME', key)
  if type(at) == 'number' then
    return at
  end
  local ttl = redis.call('PTTL', key) -- Redis 6: no PEXPIRETIME
  if ttl < 0 then
    return -1
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
end

---------------------------------------------------------------------------
-- Clock, tokens, memory.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- `TokenClock::next` after observing the key's last token: a token far
-- ahead of the clock (a forged record) moves nothing.
local function next_token(last, now)
  local horizon = math.min((now + MAX_SKEW_MS) * 1000, TOKEN_LIMIT - 1)
  if last > horizon then
    last = 0
  end
  return math.max(last + 1, now * 1000)
end

-- The scripts form runs each call afresh and has no flags (see `dispatch`).
local scripts_form = false

-- The last reading of INFO memory: one that found used memory well below
-- maxmemory (or none set) stands for MEMORY_FRESH_MS, so a stream of new
-- records does not pay for INFO each (a library keeps its upvalues between
-- calls; the scripts form reads every time).
local MEMORY_FRESH_MS = 100
local memory_read_at, memory_far = 0, false

-- Used memory (less what eviction does not count) above maxmemory: what
-- makes the module refuse a new record (RedisModule_GetUsedMemoryRatio > 1).
local function out_of_memory(now)
  if memory_far and now >= memory_read_at and now - memory_read_at < MEMORY_FRESH_MS then
    return false
  end
  local info = redis.pcall('INFO', 'memory')
  if type(info) ~= 'string' then
    return false -- INFO refused: count it as enough memory
  end
  local max = tonumber(string.match(info, '\nmaxmemory:(%d+)') or '0')
  local used = tonumber(string.match(info, '\nused_memory:(%d+)') or '0')
  local uncounted = tonumber(string.match(info, '\nmem_not_counted_for_evict:(%d+)') or '0')
  used = math.max(used - uncounted, 0)
  memory_read_at, memory_far = now, max == 0 or used < max * 0.9
  return max > 0 and used > max
end

---------------------------------------------------------------------------
-- The functions. Each takes (keys, args) and parses exactly as the module's
-- command parses `key args...`, in the same order, so the first error is
-- the same one.

local function keys_usage(keys, n, text)
  if #keys ~= n then
    fail('BADARG wrong number of keys, usage: ' .. text)
  end
end

-- IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]
local function begin(keys, args)
  keys_usage(keys, 1, 'FCALL idem_begin 1 key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]')
  if #args < 2 then
    usage('IDEM.BEGIN key fingerprint ttl-seconds [LEASE ms] [WAIT ms] [PACKED]')
  end
  local key, sent = keys[1], args[1]
  local ttl = ranged(args[2], 'ttl', '1', dec(MAX_TTL_SECS))
  local lease_ms, packed = DEFAULT_LEASE_MS, false
  local i = 3
  while i <= #args do
    local opt = args[i]
    if is_word(opt, 'PACKED') then
      packed = true
      i = i + 1
    else
      local name
      if is_word(opt, 'LEASE') then
        name = 'LEASE'
      elseif is_word(opt, 'WAIT') then
        name = 'WAIT'
      else
        unknown_option(opt)
      end
      local value = args[i + 1]
      if value == nil then
        fail('BADARG ' .. name .. ' needs a value')
      end
      if name == 'LEASE' then
        lease_ms = ranged(value, 'LEASE', '1', dec(MAX_MS))
      else
        -- WAIT answers at once here, as the module's does inside Lua.
        ranged(value, 'WAIT', '0', dec(MAX_MS))
      end
      i = i + 2
    end
  end

  local r, last = load(key)
  if not r then
    local now = now_ms()
    if out_of_memory(now) then
      fail(OOM)
    end
    local token = next_token(last, now)
    local fp_field, fp = 'fp_sent', sent
    if #sent ~= 32 then
      fp_field, fp = 'fp_sha256', sha256(sent)
    end
    -- Over nothing, or over a tombstone's three fields.
    redis.call('HSET', key, 'idem', '1', 'token', dec(token), 'state', 'in_progress',
      fp_field, fp, 'created_at', dec(now), 'lease_until', dec(now + lease_ms))
    redis.call('PEXPIREAT', key, dec(now + ttl * 1000))
    return { 'new', token }
  end
  if not same_fingerprint(r, sent) then
    return { 'mismatch' }
  end
  if r.state == 'completed' then
    if packed then
      return { 'replay', r.response }
    end
    return { 'replay', r.status, body(r), r.headers }
  end
  local now = now_ms()
  if r.lease_until > now then
    return { 'in_flight', r.lease_until - now }
  end
  local token = next_token(r.token, now)
  redis.call('HSET', key, 'token', dec(token), 'lease_until', dec(now + lease_ms))
  return { 'new', token }
end

-- `engine::holder`: the in-progress record `token` holds.
local function holder(key, token)
  local r = load(key)
  if not r then
    fail('NOTFOUND no idempotency record under this key')
  end
  if r.token ~= token then
    fail("STALE token is not the current holder's")
  end
  if r.state == 'completed' then
    fail('COMPLETED the record is already completed')
  end
  return r
end

-- IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]
local function complete(keys, args)
  keys_usage(keys, 2, 'FCALL idem_complete 2 key outbox token status body [HEADER name value]... [MIRRORED]')
  -- The module's COMPLETE is deny-oom, and so is this function (it has no
  -- allow-oom flag): Redis refuses both with the same error before they
  -- run. The scripts form has no flags, so it checks itself.
  if scripts_form and out_of_memory(now_ms()) then
    fail(OOM)
  end
  if #args < 3 then
    usage('IDEM.COMPLETE key token status body [HEADER name value]... [MIRRORED]')
  end
  local key, outbox = keys[1], keys[2]
  local token = token_arg(args[1])
  local status = ranged(args[2], 'status', '100', '599')
  local content = args[3]
  local headers, mirrored = {}, false
  local i = 4
  while i <= #args do
    if is_word(args[i], 'HEADER') then
      if #headers / 2 >= MAX_HEADERS then
        fail('TOOLARGE more than ' .. MAX_HEADERS .. ' headers (max-headers)')
      end
      local name, value = args[i + 1], args[i + 2]
      if name == nil or value == nil then
        fail('BADARG HEADER needs a name and a value')
      end
      if name == '' then
        fail('BADARG HEADER name must not be empty')
      end
      headers[#headers + 1] = name
      headers[#headers + 1] = value
      i = i + 3
    elseif is_word(args[i], 'MIRRORED') then
      mirrored = true
      i = i + 1
    else
      unknown_option(args[i])
    end
  end
  local size = #content + #headers / 2 * HEADER_OVERHEAD
  for j = 1, #headers do
    size = size + #headers[j]
  end
  if size > MAX_BODY_BYTES then
    fail('TOOLARGE body is ' .. size .. ' bytes, max-body-bytes is ' .. MAX_BODY_BYTES)
  end

  holder(key, token)
  if not mirrored then
    check_outbox(outbox)
  end
  local now = now_ms()
  redis.call('HSET', key, 'state', 'completed', 'response', pack_response(status, content, headers),
    'completed_at', dec(now), 'mirror', mirrored and 'mirrored' or 'pending')
  redis.call('HDEL', key, 'lease_until')
  if not mirrored then
    redis.call('ZADD', outbox, dec(now), key)
  end
  return { ok = 'OK' }
end

-- IDEM.ABORT key token
local function abort(keys, args)
  keys_usage(keys, 1, 'FCALL idem_abort 1 key token')
  if #args ~= 1 then
    usage('IDEM.ABORT key token')
  end
  local key = keys[1]
  local token = token_arg(args[1])
  local r = load(key)
  if not r or r.token ~= token or r.state ~= 'in_progress' then
    return 0
  end
  -- The record goes; its token stays a little (see the header).
  redis.call('DEL', key)
  redis.call('HSET', key, 'idem', '1', 'state', 'aborted', 'token', dec(r.token))
  redis.call('PEXPIREAT', key, dec(math.floor(r.token / 1000) + TOMBSTONE_MS))
  return 1
end

-- IDEM.TOUCH key token lease-ms
local function touch(keys, args)
  keys_usage(keys, 1, 'FCALL idem_touch 1 key token lease-ms')
  if #args ~= 2 then
    usage('IDEM.TOUCH key token lease-ms')
  end
  local key = keys[1]
  local token = token_arg(args[1])
  local lease_ms = ranged(args[2], 'lease-ms', '1', dec(MAX_MS))
  holder(key, token)
  redis.call('HSET', key, 'lease_until', dec(now_ms() + lease_ms))
  return lease_ms
end

-- IDEM.GET key
local function get(keys, args)
  keys_usage(keys, 1, 'FCALL_RO idem_get 1 key')
  if #args ~= 0 then
    usage('IDEM.GET key')
  end
  local key = keys[1]
  local r = load(key)
  if not r then
    return false
  end
  local reply = {
    'state', r.state, 'fingerprint', hex(digest(r)), 'token', r.token,
    'created_at', r.created_at, 'expires_at', expires_at(key),
  }
  local function add(name, value)
    reply[#reply + 1] = name
    reply[#reply + 1] = value
  end
  if r.state == 'in_progress' then
    add('lease_until', r.lease_until)
  else
    add('status', r.status)
    add('body', body(r))
    add('headers', r.headers)
    add('completed_at', r.completed_at)
    add('mirror', r.mirror)
  end
  return reply
end

-- The outbox's IDEM.MIRROR.PULL: of the given record keys, those due in the
-- outbox and still pending, each claimed for claim-ms, as PULL's entries.
local function mirror_claim(keys, args)
  if #keys < 1 then
    fail('BADARG wrong number of keys, usage: FCALL idem_mirror_claim 1+n outbox key... claim-ms')
  end
  if #args ~= 1 then
    usage('FCALL idem_mirror_claim 1+n outbox key... claim-ms')
  end
  local claim_ms = ranged(args[1], 'claim-ms', '1', dec(MAX_CLAIM_MS))
  local outbox = keys[1]
  check_outbox(outbox)
  local now = now_ms()
  local out = {}
  for i = 2, #keys do
    local key = keys[i]
    local due = redis.call('ZSCORE', outbox, key)
    if due and tonumber(due) <= now then
      local ok, r = pcall(load, key)
      if ok and r and r.state == 'completed' and r.mirror == 'pending' then
        redis.call('ZADD', outbox, 'XX', dec(now + claim_ms), key)
        out[#out + 1] = {
          key, r.token, hex(digest(r)), r.status, body(r), r.headers,
          r.created_at, r.completed_at, expires_at(key),
        }
      elseif ok or (type(r) == 'table' and r.idem_error) then
        redis.call('ZREM', outbox, key) -- gone, mirrored, not completed, not a record
      else
        error(r, 0)
      end
    end
  end
  return out
end

-- IDEM.MIRROR.ACK key token
local function mirror_ack(keys, args)
  keys_usage(keys, 2, 'FCALL idem_mirror_ack 2 key outbox token')
  if #args ~= 1 then
    usage('IDEM.MIRROR.ACK key token')
  end
  local key, outbox = keys[1], keys[2]
  local token = token_arg(args[1])
  local r = load(key)
  if not r or r.token ~= token or r.state ~= 'completed' then
    return 0
  end
  if r.mirror == 'pending' then
    check_outbox(outbox)
    redis.call('HSET', key, 'mirror', 'mirrored')
    redis.call('ZREM', outbox, key)
  end
  return 1
end

local function version()
  return VERSION
end

---------------------------------------------------------------------------
-- Registration (FUNCTION LOAD), or the scripts form's dispatch (EVAL).

-- Flags: the module's commands are not deny-oom but COMPLETE (allow-oom
-- lets a function run above maxmemory: BEGIN refuses only a new record).
local WRITES = { 'allow-oom' }
local DENY_OOM = {}
local READS = { 'no-writes' }

local FUNCTIONS = {
  idem_begin = { begin, WRITES },
  idem_complete = { complete, DENY_OOM },
  idem_abort = { abort, WRITES },
  idem_touch = { touch, WRITES },
  idem_get = { get, READS },
  idem_mirror_claim = { mirror_claim, WRITES },
  idem_mirror_ack = { mirror_ack, WRITES },
  idem_version = { version, READS },
}

local function register(name)
  local fn = FUNCTIONS[name][1]
  redis.register_function({
    function_name = name,
    callback = function(keys, args)
      return run(fn, keys, args)
    end,
    flags = FUNCTIONS[name][2],
  })
end

if redis.register_function then
  register('idem_begin')
  register('idem_complete')
  register('idem_abort')
  register('idem_touch')
  register('idem_get')
  register('idem_mirror_claim')
  register('idem_mirror_ack')
  register('idem_version')
else
  local f = FUNCTIONS[ARGV[1]]
  if not f then
    return redis.error_reply('ERR Function not found')
  end
  if redis.replicate_commands then
    redis.replicate_commands() -- Redis 6: effects, since TIME decides
  end
  scripts_form = true
  local args = {}
  for i = 2, #ARGV do
    args[i - 1] = ARGV[i]
  end
  return run(f[1], KEYS, args)
end
