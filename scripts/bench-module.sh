#!/usr/bin/env bash
# Benchmarks the idem module against its baselines, in one run against one
# redis-server it starts itself (free port, never 6379, no persistence):
#
#   1. IDEM.BEGIN on fresh keys   vs  SET key fp NX EX ttl        (>= 0.9x)
#   2. IDEM.BEGIN on fresh keys   vs  EVALSHA bench/begin.lua     (>= 2.5x)
#   3. IDEM.BEGIN replaying a 256-byte body  vs  GET of a 256-byte string
#      with the same TTL (>= 0.9x)
#   4. memory per completed record (36-byte key, 256-byte body) vs the Lua
#      version's hash (no more), as INFO used_memory deltas over MEM_RECORDS.
#   5. Redis' own time per call (INFO commandstats usec_per_call, reset
#      before each phase), steadier than throughput on a shared machine:
#      BEGIN new vs SET NX EX (<= 1.25x), BEGIN replay vs GET (<= 1.25x;
#      PACKED, as idem-client asks, and the four-field reply for reference),
#      BEGIN in-flight and mismatch vs GET, COMPLETE vs SET EX of the same
#      256-byte body (<= 1.5x; both called from the same Lua fill loop), and
#      COMPLETE waking one WAIT client vs COMPLETE alone.
#      Ratios are medians of per-round ratios, as for throughput.
#
# Throughput comes from redis-benchmark (pipelined, many clients, random keys
# via -r and __rand_int__), ROUNDS times in turn. New keys are measured on a
# flushed database; replay and GET run back to back on one dataset holding
# both the records and the strings (in alternating order), after COMPLETE
# and SET EX filled them. A ratio is the median of the per-round ratios of
# adjacent phases (so a noisy neighbour slowing one round skews neither
# side); the ops/s shown
# are medians too. Every phase checks that the commands did what they should
# (no error replies, the expected outcome counts).
#
# `scripts/bench-module.sh instructions` measures the same pairs in
# instructions instead of time: the server runs under valgrind's callgrind,
# each phase sends INSTR_CALLS commands on its own keys (redis-cli --pipe),
# and a phase's figure is the inclusive instruction count of the command's
# handler (`setCommand`, `getCommand`, or `RedisModuleCommandDispatcher`:
# what commandstats times) divided by the calls. Repeatable to a few
# instructions on a busy machine. The module's SHA-256 runs its portable
# code under valgrind (no SHA extensions, ~3,600 instructions for what
# SHA-NI hardware does in a few hundred cycles); with the 32-byte
# fingerprint used here no phase hashes (effects carry it as sent, with
# EFFECT_FORMAT=2, the default here).
#
# The server has no replica and no AOF, so idem builds no effects
# (src/consumers.rs) and `SET` propagates nothing either. EFFECTS=consumed
# measures the other case: a replica syncs and is shut down before the
# phases, leaving the replication backlog that then receives every effect
# (and every `SET`), as on a primary with replicas, without a third process
# on the cores.
#
# Usage: scripts/bench-module.sh [instructions]
#                                       (env knobs below; BENCH_STRICT=1 makes
#                                        a missed target exit non-zero;
#                                        KEEP_WORK=dir keeps the server's log
#                                        and callgrind dumps there)
set -euo pipefail
MODE=${1:-time}
[[ $MODE == time || $MODE == instructions ]] || { echo "usage: $0 [instructions]" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/lib/common.sh"
# The module as test.sh builds it (alone, never linked against redis-rs).
MODULE=${IDEM_MODULE:-$(cd "$ROOT" && build_module)}
REQUESTS=${REQUESTS:-500000}         # per module / SET / GET phase
LUA_REQUESTS=${LUA_REQUESTS:-150000} # the Lua script is slower
CLIENTS=${CLIENTS:-50}
PIPELINE=${PIPELINE:-16}
ROUNDS=${ROUNDS:-5}
REPLAY_KEYS=${REPLAY_KEYS:-100000}
# The module's effect-format (docs/module/configuration.md): 2, as on a deployment whose
# nodes all run this version; 1 is the default for rolling upgrades.
EFFECT_FORMAT=${EFFECT_FORMAT:-2}
MEM_RECORDS=${MEM_RECORDS:-100000}
FRESH_KEYSPACE=1000000000 # -r: keys drawn from 10^9, so repeats are rare
TTL=3600
LEASE_MS=30000
FP=$(printf 'f%.0s' {1..32})       # a 32-byte fingerprint, as idem-client sends (raw SHA-256)
OTHER_FP=$(printf 'g%.0s' {1..32}) # another one, for the mismatch
BODY=$(printf 'b%.0s' {1..256}) # a 256-byte response body

TOOLS=(redis-server redis-cli redis-benchmark awk)
[[ $MODE == instructions ]] && TOOLS+=(valgrind callgrind_control callgrind_annotate)
for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null || { echo "bench-module: $tool not found" >&2; exit 1; }
done
if [[ ! -f $MODULE ]]; then
    echo "bench-module: module $MODULE does not exist" >&2
    exit 1
fi

PORT=$(free_port)

WORK=$(mktemp -d -t idem-bench.XXXXXX)
SERVER_PID=
cleanup() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    [[ -n ${KEEP_WORK:-} ]] && cp -r "$WORK" "$KEEP_WORK"; rm -rf "$WORK"
}
trap cleanup EXIT

UNDER=()
[[ $MODE == instructions ]] &&
    UNDER=(valgrind --tool=callgrind --dump-instr=no --callgrind-out-file="$WORK/cg.out")
"${UNDER[@]}" redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$WORK" --logfile "$WORK/redis.log" \
    --loadmodule "$MODULE" effect-format "$EFFECT_FORMAT" >/dev/null 2>&1 &
SERVER_PID=$!

cli() { redis-cli -h 127.0.0.1 -p "$PORT" "$@"; }
for _ in $(seq 600); do
    [[ $(cli PING 2>/dev/null) == PONG ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/redis.log" >&2; exit 1; }
    sleep 0.05
done
[[ $(cli PING) == PONG ]] || { echo "bench-module: server not up" >&2; exit 1; }

fail() { echo "bench-module: $*" >&2; exit 1; }

# A numeric field of INFO <section>.
info_field() { cli INFO "$2" | tr -d '\r' | awk -F: -v f="$1" '$1 == f { print $2 }'; }

EFFECTS=${EFFECTS:-unconsumed}
case $EFFECTS in
unconsumed) ;;
consumed)
    # A replica syncs once and goes: the backlog it leaves consumes effects.
    RPORT=$(free_port)
    redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$WORK" --logfile "$WORK/replica.log" --loadmodule "$MODULE" \
        --replicaof 127.0.0.1 "$PORT" >/dev/null 2>&1 &
    for _ in $(seq 600); do
        [[ $(redis-cli -p "$RPORT" INFO replication 2>/dev/null | tr -d '\r' |
            awk -F: '$1 == "master_link_status" { print $2 }') == up ]] && break
        sleep 0.05
    done
    redis-cli -p "$RPORT" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    wait $! 2>/dev/null || true
    (($(info_field repl_backlog_active replication) == 1)) || fail "no replication backlog"
    ;;
*) fail "EFFECTS is unconsumed or consumed, not $EFFECTS" ;;
esac
# idem checks for consumers once a second (src/consumers.rs): wait for the
# answer the phases are meant to measure.
want=$([[ $EFFECTS == consumed ]] && echo 1 || echo 0)
for _ in $(seq 100); do
    [[ $(info_field idem_effects_consumed idem) == "$want" ]] && break
    sleep 0.05
done
[[ $(info_field idem_effects_consumed idem) == "$want" ]] || fail "idem_effects_consumed is not $want"
errors_so_far() { info_field total_error_replies stats; }

flush() {
    cli FLUSHALL >/dev/null
    cli CONFIG RESETSTAT >/dev/null
}

# usec <command>: usec_per_call of a command since the last flush.
usec() {
    cli INFO commandstats | tr -d '\r' |
        awk -F'[:,=]' -v c="cmdstat_$1" '$1 == c { for (i = 2; i < NF; i++) if ($i == "usec_per_call") print $(i + 1) }'
}

# bench <requests> <keyspace> <command...>: requests per second.
bench() {
    local n=$1 r=$2
    shift 2
    local before rps
    before=$(errors_so_far)
    rps=$(redis-benchmark -h 127.0.0.1 -p "$PORT" -c "$CLIENTS" -P "$PIPELINE" \
        -n "$n" -r "$r" --csv "$@" | tail -n 1 | awk -F'","' '{ print $2 }')
    [[ $rps =~ ^[0-9.]+$ ]] || fail "no figure from redis-benchmark $*"
    (($(errors_so_far) == before)) || fail "error replies during: $*"
    echo "$rps"
}

# at_least <got> <want> <what>: guards that a phase did real work.
at_least() { (($1 >= $2)) || fail "$3: got $1, expected at least $2"; }

SHA_BEGIN=$(cli SCRIPT LOAD "$(cat "$ROOT/bench/begin.lua")")
SHA_COMPLETE=$(cli SCRIPT LOAD "$(cat "$ROOT/bench/complete.lua")")

# Loads records or strings in batches of 10,000 with a server-side loop.
# fill_module <count> <key-format> <fp> <body>: completed records.
FILL_MODULE='for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  local k = string.format(ARGV[3], i)
  local r = redis.call("IDEM.BEGIN", k, ARGV[4], ARGV[6])
  redis.call("IDEM.COMPLETE", k, r[2], 200, ARGV[5])
end
return 1'
# Strings get the records' TTL: every idempotency record has one, and a key
# with an expiry costs a second lookup on every read.
FILL_STRINGS='for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  redis.call("SET", string.format(ARGV[3], i), ARGV[4], "EX", ARGV[5])
end
return 1'
batched() { # batched <count> <script> <args after the range...>
    local count=$1 script=$2
    shift 2
    local from=0
    while ((from < count)); do
        local to=$((from + 10000 < count ? from + 10000 - 1 : count - 1))
        cli EVAL "$script" 0 "$from" "$to" "$@" >/dev/null
        from=$((to + 1))
    done
}
fill_module() { batched "$1" "$FILL_MODULE" "$2" "$3" "$4" "$TTL"; }
# In-progress records with a long lease (for the in-flight phase).
FILL_HELD='for i = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  redis.call("IDEM.BEGIN", string.format(ARGV[3], i), ARGV[4], ARGV[5], "LEASE", 3600000)
end
return 1'

# COMPLETE with one client blocked in BEGIN ... WAIT on each key, vs COMPLETE
# of keys nobody waits on: what waking a waiter adds to the completion.
WAKE_KEYS=${WAKE_KEYS:-200}
wake_phase() {
    flush
    local tokens i pids=()
    mapfile -t tokens < <(for i in $(seq "$WAKE_KEYS"); do
        cli IDEM.BEGIN "w:$i" "$FP" "$TTL" | sed -n 2p; done)
    for i in $(seq "$WAKE_KEYS"); do
        cli IDEM.BEGIN "w:$i" "$FP" "$TTL" WAIT 30000 >/dev/null &
        pids+=($!)
    done
    for _ in $(seq 200); do
        (($(info_field idem_waiters idem) == WAKE_KEYS)) && break
        sleep 0.05
    done
    (($(info_field idem_waiters idem) == WAKE_KEYS)) || fail "waiters did not block"
    cli CONFIG RESETSTAT >/dev/null
    for i in $(seq "$WAKE_KEYS"); do
        printf 'IDEM.COMPLETE w:%s %s 200 %s\n' "$i" "${tokens[$((i - 1))]}" "$BODY"
    done | cli >/dev/null
    wait "${pids[@]}"
    U_WAKE+=("$(usec IDEM.COMPLETE)")
    mapfile -t tokens < <(for i in $(seq "$WAKE_KEYS"); do
        cli IDEM.BEGIN "n:$i" "$FP" "$TTL" | sed -n 2p; done)
    cli CONFIG RESETSTAT >/dev/null
    for i in $(seq "$WAKE_KEYS"); do
        printf 'IDEM.COMPLETE n:%s %s 200 %s\n' "$i" "${tokens[$((i - 1))]}" "$BODY"
    done | cli >/dev/null
    U_NOWAKE+=("$(usec IDEM.COMPLETE)")
}
fill_strings() { batched "$1" "$FILL_STRINGS" "$2" "$3" "$TTL"; }

# The Lua baseline's records, through the scripts themselves: the counter
# starts at 0 after a flush, so the i-th BEGIN gets token i + 1.
fill_lua() { # fill_lua <count> <key-format>
    awk -v n="$1" -v fmt="$2" -v sb="$SHA_BEGIN" -v sc="$SHA_COMPLETE" \
        -v fp="$FP" -v body="$BODY" -v ttl="$TTL" -v lease="$LEASE_MS" '
        function out(c,   i, s) {
            s = "*" c "\r\n"
            for (i = 1; i <= c; i++) s = s "$" length(a[i]) "\r\n" a[i] "\r\n"
            printf "%s", s
        }
        BEGIN {
            for (i = 0; i < n; i++) {
                k = sprintf(fmt, i)
                a[1] = "EVALSHA"; a[2] = sb; a[3] = "2"; a[4] = k; a[5] = "idem:tokens"
                a[6] = fp; a[7] = ttl; a[8] = lease; out(8)
                a[1] = "EVALSHA"; a[2] = sc; a[3] = "1"; a[4] = k; a[5] = i + 1
                a[6] = "200"; a[7] = body; out(7)
            }
        }' >"$WORK/lua-fill.resp"
    local summary
    summary=$(cli --pipe <"$WORK/lua-fill.resp" 2>&1 | tail -n 1)
    [[ $summary == *"errors: 0,"* ]] || fail "Lua fill: $summary"
}

used_memory() {
    sleep 0.2
    info_field used_memory memory
}

median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

declare -a R_BEGIN R_SET R_LUA R_REPLAY R_GET R_LUA_REPLAY
declare -a U_BEGIN U_SET U_REPLAY U_REPLAY_FIELDS U_GET U_INFLIGHT U_MISMATCH U_COMPLETE U_SETBODY U_WAKE U_NOWAKE
NINETY_NINE=$((REQUESTS * 99 / 100))
LUA_NINETY_NINE=$((LUA_REQUESTS * 99 / 100))

# Instruction counts per call (see the header); exits when done.
INSTR_CALLS=${INSTR_CALLS:-20000}
instructions() {
    local n=$INSTR_CALLS part=0
    declare -A per_call
    # lines <command>: n commands in RESP (as clients send them, not inline:
    # the argument encodings differ), %d in an argument replaced by 0..n-1.
    lines() {
        awk -v n="$n" -v cmd="$1" 'BEGIN {
            c = split(cmd, a, " ")
            for (i = 0; i < n; i++) {
                s = "*" c "\r\n"
                for (j = 1; j <= c; j++) { v = a[j]; sub(/%d/, i, v); s = s "$" length(v) "\r\n" v "\r\n" }
                printf "%s", s
            }
        }'
    }
    # phase <name> <handler> <commands>: runs the commands between a zero
    # and a dump (in this shell: per_call must survive).
    phase() {
        printf '%s\n' "$3" >"$WORK/phase.in" # $(...) took the last newline
        callgrind_control -z "$SERVER_PID" >/dev/null 2>&1
        local summary
        summary=$(cli --pipe <"$WORK/phase.in" 2>&1 | tail -n 1)
        callgrind_control -d "$SERVER_PID" >/dev/null 2>&1
        [[ $summary == *"errors: 0,"* ]] || fail "instructions, $1: $summary"
        part=$((part + 1))
        local total
        total=$(callgrind_annotate --inclusive=yes --threshold=100 "$WORK/cg.out.$part" 2>/dev/null |
            awk -v fn=":$2" '$0 ~ fn " " && !t { gsub(",", "", $1); t = $1 } END { print t }')
        [[ $total =~ ^[0-9]+$ ]] || fail "instructions, $1: no count for $2"
        per_call[$1]=$((total / n))
    }
    local mod=RedisModuleCommandDispatcher tokens
    phase new "$mod" "$(lines "IDEM.BEGIN n:%d $FP $TTL")"
    phase setnx setCommand "$(lines "SET s:%d $FP NX EX $TTL")"
    phase setbody setCommand "$(lines "SET v:%d $BODY EX $TTL")"
    phase get getCommand "$(lines "GET v:%d")"
    lines "IDEM.BEGIN h:%d $FP $TTL LEASE 3600000" | cli --pipe >/dev/null
    phase inflight "$mod" "$(lines "IDEM.BEGIN h:%d $FP $TTL")"
    tokens=$(cli EVAL 'local t = {}
for i = 0, tonumber(ARGV[1]) - 1 do
  t[#t + 1] = redis.call("IDEM.BEGIN", "c:" .. i, ARGV[2], ARGV[3], "LEASE", 3600000)[2]
end
return t' 0 "$n" "$FP" "$TTL")
    phase complete "$mod" "$(awk -v b="$BODY" '{
        k = "c:" NR - 1
        printf "*5\r\n$13\r\nIDEM.COMPLETE\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$3\r\n200\r\n$%d\r\n%s\r\n",
            length(k), k, length($1), $1, length(b), b
    }' <<<"$tokens")"
    phase replay "$mod" "$(lines "IDEM.BEGIN c:%d $FP $TTL PACKED")"
    phase replay_fields "$mod" "$(lines "IDEM.BEGIN c:%d $FP $TTL")"
    phase mismatch "$mod" "$(lines "IDEM.BEGIN c:%d $OTHER_FP $TTL")"
    (($(info_field idem_replay idem) == 2 * n && $(info_field idem_mismatch idem) == n)) ||
        fail "instructions: replay/mismatch phases did not replay/mismatch"
    (($(info_field idem_in_flight idem) == n && $(info_field idem_completes idem) == n)) ||
        fail "instructions: in-flight/complete phases went wrong"
    irow() { # irow <what> <idem phase> <baseline phase>
        printf '%-46s %14s %14s %8s\n' "$1" "${per_call[$2]}" "${per_call[$3]}" \
            "$(awk -v a="${per_call[$2]}" -v b="${per_call[$3]}" 'BEGIN { printf "%.2fx", a / b }')"
    }
    echo
    printf '%-46s %14s %14s %8s\n' "instructions per call ($n calls each)" "idem" "baseline" "ratio"
    printf '%.0s-' {1..85}
    echo
    irow "BEGIN new vs SET NX EX" new setnx
    irow "BEGIN replay (256 B) vs GET (256 B)" replay get
    irow "  the same, four-field reply (no PACKED)" replay_fields get
    irow "BEGIN in-flight vs GET" inflight get
    irow "BEGIN mismatch vs GET" mismatch get
    irow "COMPLETE (256 B) vs SET EX (256 B)" complete setbody
}
if [[ $MODE == instructions ]]; then
    instructions
    exit 0
fi

echo "idem module benchmark: redis $(redis-server --version | awk '{ print $3 }' | cut -d= -f2)," \
    "port $PORT, $CLIENTS clients, pipeline $PIPELINE, $ROUNDS rounds (medians)" >&2
# The replay as idem-client asks for it (PACKED: one bulk string).
replay_phase() {
    cli CONFIG RESETSTAT >/dev/null
    local before
    before=$(info_field idem_replay idem)
    R_REPLAY+=("$(bench "$REQUESTS" "$REPLAY_KEYS" IDEM.BEGIN "k:__rand_int__" "$FP" "$TTL" PACKED)")
    at_least $(($(info_field idem_replay idem) - before)) "$REQUESTS" "BEGIN replay: replays"
    U_REPLAY+=("$(usec IDEM.BEGIN)")
}
# The four-field replay (clients that do not send PACKED).
replay_fields_phase() {
    cli CONFIG RESETSTAT >/dev/null
    local before
    before=$(info_field idem_replay idem)
    bench "$REQUESTS" "$REPLAY_KEYS" IDEM.BEGIN "k:__rand_int__" "$FP" "$TTL" >/dev/null
    at_least $(($(info_field idem_replay idem) - before)) "$REQUESTS" "BEGIN replay (fields): replays"
    U_REPLAY_FIELDS+=("$(usec IDEM.BEGIN)")
}
get_phase() {
    cli CONFIG RESETSTAT >/dev/null
    R_GET+=("$(bench "$REQUESTS" "$REPLAY_KEYS" GET "v:__rand_int__")")
    at_least "$(info_field keyspace_hits stats)" "$REQUESTS" "GET: hits"
    U_GET+=("$(usec get)")
}

for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS..." >&2

    flush
    before=$(info_field idem_new idem)
    R_BEGIN+=("$(bench "$REQUESTS" "$FRESH_KEYSPACE" IDEM.BEGIN "k:__rand_int__" "$FP" "$TTL")")
    at_least $(($(info_field idem_new idem) - before)) "$NINETY_NINE" "BEGIN fresh: new outcomes"
    U_BEGIN+=("$(usec IDEM.BEGIN)")

    flush
    R_SET+=("$(bench "$REQUESTS" "$FRESH_KEYSPACE" SET "k:__rand_int__" "$FP" NX EX "$TTL")")
    at_least "$(cli DBSIZE)" "$NINETY_NINE" "SET NX: keys"
    U_SET+=("$(usec set)")

    flush
    R_LUA+=("$(bench "$LUA_REQUESTS" "$FRESH_KEYSPACE" EVALSHA "$SHA_BEGIN" 2 "k:__rand_int__" \
        idem:tokens "$FP" "$TTL" "$LEASE_MS")")
    at_least "$(cli GET idem:tokens)" "$LUA_NINETY_NINE" "Lua BEGIN: tokens issued"

    # The records and the strings of the same bodies side by side, so that
    # COMPLETE and SET EX, and then replay and GET, run back to back on the
    # same dataset (replay and GET in alternating order).
    flush
    fill_module "$REPLAY_KEYS" "k:%012d" "$FP" "$BODY"
    U_COMPLETE+=("$(usec IDEM.COMPLETE)")
    fill_strings "$REPLAY_KEYS" "v:%012d" "$BODY"
    U_SETBODY+=("$(usec set)")
    if ((round % 2)); then
        replay_phase; get_phase; replay_fields_phase
    else
        replay_fields_phase; get_phase; replay_phase
    fi
    cli CONFIG RESETSTAT >/dev/null
    before=$(info_field idem_mismatch idem)
    bench "$REQUESTS" "$REPLAY_KEYS" IDEM.BEGIN "k:__rand_int__" "$OTHER_FP" "$TTL" >/dev/null
    at_least $(($(info_field idem_mismatch idem) - before)) "$REQUESTS" "BEGIN mismatch"
    U_MISMATCH+=("$(usec IDEM.BEGIN)")

    flush
    batched "$REPLAY_KEYS" "$FILL_HELD" "k:%012d" "$FP" "$TTL"
    cli CONFIG RESETSTAT >/dev/null
    before=$(info_field idem_in_flight idem)
    bench "$REQUESTS" "$REPLAY_KEYS" IDEM.BEGIN "k:__rand_int__" "$FP" "$TTL" >/dev/null
    at_least $(($(info_field idem_in_flight idem) - before)) "$REQUESTS" "BEGIN in-flight"
    U_INFLIGHT+=("$(usec IDEM.BEGIN)")

    wake_phase

    flush
    fill_lua "$REPLAY_KEYS" "k:%012d"
    R_LUA_REPLAY+=("$(bench "$LUA_REQUESTS" "$REPLAY_KEYS" EVALSHA "$SHA_BEGIN" 2 "k:__rand_int__" \
        idem:tokens "$FP" "$TTL" "$LEASE_MS")")
    [[ $(cli GET idem:tokens) == "$REPLAY_KEYS" ]] || fail "Lua replay issued tokens"
done

echo "memory: $MEM_RECORDS completed records per variant..." >&2
KEY_FMT="mem:%032d" # 36-byte keys
ACK_ALL='local n = 0
while true do
  local batch = redis.call("IDEM.MIRROR.PULL", 10000)
  if #batch == 0 then return n end
  for _, e in ipairs(batch) do n = n + redis.call("IDEM.MIRROR.ACK", e[1], e[2]) end
end'

flush
m0=$(used_memory)
fill_module "$MEM_RECORDS" "$KEY_FMT" "$FP" "$BODY"
m1=$(used_memory)
at_least "$(cli DBSIZE)" "$MEM_RECORDS" "module records"
[[ $(cli EVAL "$ACK_ALL" 0) == "$MEM_RECORDS" ]] || fail "not every record acknowledged"
m2=$(used_memory)
MEM_PENDING=$(((m1 - m0) / MEM_RECORDS))
MEM_MIRRORED=$(((m2 - m0) / MEM_RECORDS))

flush
m0=$(used_memory)
fill_lua "$MEM_RECORDS" "$KEY_FMT"
m1=$(used_memory)
[[ $(cli HGET "$(printf "$KEY_FMT" $((MEM_RECORDS - 1)))" state) == completed ]] ||
    fail "Lua records not completed"
MEM_LUA=$(((m1 - m0) / MEM_RECORDS))

flush
m0=$(used_memory)
fill_strings "$MEM_RECORDS" "$KEY_FMT" "$BODY"
m1=$(used_memory)
MEM_STRING=$(((m1 - m0) / MEM_RECORDS))
flush

BEGIN_RPS=$(median "${R_BEGIN[@]}")
SET_RPS=$(median "${R_SET[@]}")
LUA_RPS=$(median "${R_LUA[@]}")
REPLAY_RPS=$(median "${R_REPLAY[@]}")
GET_RPS=$(median "${R_GET[@]}")
LUA_REPLAY_RPS=$(median "${R_LUA_REPLAY[@]}")

# paired <idem rounds...> -- <baseline rounds...>: median of per-round ratios.
paired() {
    local -a a=() b=() r=()
    while [[ $1 != -- ]]; do a+=("$1"); shift; done
    shift
    b=("$@")
    for i in "${!a[@]}"; do
        r+=("$(awk -v x="${a[$i]}" -v y="${b[$i]}" 'BEGIN { printf "%.4f", x / y }')")
    done
    median "${r[@]}"
}
RATIO_SET=$(paired "${R_BEGIN[@]}" -- "${R_SET[@]}")
RATIO_LUA=$(paired "${R_BEGIN[@]}" -- "${R_LUA[@]}")
RATIO_GET=$(paired "${R_REPLAY[@]}" -- "${R_GET[@]}")
RATIO_LUA_REPLAY=$(paired "${R_REPLAY[@]}" -- "${R_LUA_REPLAY[@]}")

FAILED=0
# row <what> <idem> <baseline> <ratio> <target> <pass?>
row() {
    local verdict=PASS
    [[ $6 == 1 ]] || { verdict=FAIL; FAILED=1; }
    [[ $5 == - ]] && verdict=info
    printf '%-46s %14s %14s %8s %8s  %s\n' "$1" "$2" "$3" "$4" "$5" "$verdict"
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
ge() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { print (a / b >= t) ? 1 : 0 }'; }
fmt_ratio() { awk -v r="$1" 'BEGIN { printf "%.2fx", r }'; }
ops() { awk -v a="$1" 'BEGIN { printf "%.0f/s", a }'; }

echo
printf '%-46s %14s %14s %8s %8s  %s\n' "measure ($ROUNDS rounds, medians)" "idem" "baseline" "ratio" "target" "result"
printf '%.0s-' {1..102}
echo
row "BEGIN fresh keys vs SET NX EX" "$(ops "$BEGIN_RPS")" "$(ops "$SET_RPS")" \
    "$(fmt_ratio "$RATIO_SET")" ">=0.90" "$(ge "$RATIO_SET" 1 0.9)"
row "BEGIN fresh keys vs Lua EVALSHA (hash)" "$(ops "$BEGIN_RPS")" "$(ops "$LUA_RPS")" \
    "$(fmt_ratio "$RATIO_LUA")" ">=2.50" "$(ge "$RATIO_LUA" 1 2.5)"
row "BEGIN replay (256 B body) vs GET (256 B)" "$(ops "$REPLAY_RPS")" "$(ops "$GET_RPS")" \
    "$(fmt_ratio "$RATIO_GET")" ">=0.90" "$(ge "$RATIO_GET" 1 0.9)"
row "BEGIN replay vs Lua EVALSHA replay" "$(ops "$REPLAY_RPS")" "$(ops "$LUA_REPLAY_RPS")" \
    "$(fmt_ratio "$RATIO_LUA_REPLAY")" "-" 1
row "memory/record, mirror pending vs Lua hash" "${MEM_PENDING} B" "${MEM_LUA} B" \
    "$(ratio "$MEM_PENDING" "$MEM_LUA")" "<=1.00" "$(ge "$MEM_LUA" "$MEM_PENDING" 1)"
row "memory/record, mirrored (acked) vs Lua hash" "${MEM_MIRRORED} B" "${MEM_LUA} B" \
    "$(ratio "$MEM_MIRRORED" "$MEM_LUA")" "<=1.00" "$(ge "$MEM_LUA" "$MEM_MIRRORED" 1)"
row "memory/record, mirrored vs 256 B string+TTL" "${MEM_MIRRORED} B" "${MEM_STRING} B" \
    "$(ratio "$MEM_MIRRORED" "$MEM_STRING")" "-" 1
# Redis' own time per call: medians of the rounds, and the median of the
# per-round ratios (as for throughput: one slow round skews neither side).
le() { awk -v r="$1" -v t="$2" 'BEGIN { print (r <= t) ? 1 : 0 }'; }
urow() { # urow <what> <target or -> <idem rounds...> -- <baseline rounds...>
    local what=$1 target=$2 r pass=1
    shift 2
    local -a a=() b=()
    while [[ $1 != -- ]]; do a+=("$1"); shift; done
    shift
    b=("$@")
    r=$(paired "${a[@]}" -- "${b[@]}")
    [[ $target == - ]] || pass=$(le "$r" "${target#<=}")
    row "$what" "$(median "${a[@]}") us" "$(median "${b[@]}") us" "$(fmt_ratio "$r")" "$target" "$pass"
}
echo
printf '%-46s %14s %14s %8s %8s  %s\n' "usec_per_call (commandstats, medians)" "idem" "baseline" "ratio" "target" "result"
printf '%.0s-' {1..102}
echo
urow "BEGIN new vs SET NX EX" "<=1.25" "${U_BEGIN[@]}" -- "${U_SET[@]}"
urow "BEGIN replay (256 B) vs GET (256 B)" "<=1.25" "${U_REPLAY[@]}" -- "${U_GET[@]}"
urow "  the same, four-field reply (no PACKED)" - "${U_REPLAY_FIELDS[@]}" -- "${U_GET[@]}"
urow "BEGIN in-flight vs GET" - "${U_INFLIGHT[@]}" -- "${U_GET[@]}"
urow "BEGIN mismatch vs GET" - "${U_MISMATCH[@]}" -- "${U_GET[@]}"
urow "COMPLETE (256 B) vs SET EX (256 B), in Lua" "<=1.50" "${U_COMPLETE[@]}" -- "${U_SETBODY[@]}"
urow "COMPLETE waking 1 WAIT client vs none" - "${U_WAKE[@]}" -- "${U_NOWAKE[@]}"
echo
echo "per round (ops/s):"
echo "  BEGIN fresh  ${R_BEGIN[*]}"
echo "  SET NX EX    ${R_SET[*]}"
echo "  Lua BEGIN    ${R_LUA[*]}"
echo "  BEGIN replay ${R_REPLAY[*]}"
echo "  GET          ${R_GET[*]}"
echo "  Lua replay   ${R_LUA_REPLAY[*]}"
echo "per round (usec_per_call):"
echo "  BEGIN new ${U_BEGIN[*]} | SET NX ${U_SET[*]}"
echo "  replay ${U_REPLAY[*]} | four-field ${U_REPLAY_FIELDS[*]} | in-flight ${U_INFLIGHT[*]} | mismatch ${U_MISMATCH[*]} | GET ${U_GET[*]}"
echo "  COMPLETE ${U_COMPLETE[*]} | SET EX ${U_SETBODY[*]} | wake ${U_WAKE[*]} | no wake ${U_NOWAKE[*]}"
echo "requests: $REQUESTS per phase ($LUA_REQUESTS for Lua), fingerprint: 32 B, keys: 36 B (memory), body: 256 B," \
    "$MEM_RECORDS records per memory variant, effects: $EFFECTS (format $EFFECT_FORMAT)"

if [[ $FAILED == 1 ]]; then
    echo "some targets missed" >&2
    [[ ${BENCH_STRICT:-0} == 1 ]] && exit 1
fi
exit 0
