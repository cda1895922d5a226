#!/usr/bin/env bash
# What loading idem costs commands that never touch an idem key: idem follows
# every key's TTL changes (the `expire`/`persist` keyspace events) to keep its
# records' `expires_at` equal to their keys' TTLs. Instructions per native
# `SET key value EX ttl` and `EXPIRE key ttl` (the inclusive count of
# `setCommand` / `expireCommand`) on a redis-server under callgrind, once
# without the module and once with it; repeatable to a few instructions.
# Also checks that the server's keyspace_hits/misses stay 0 with idem loaded.
#
# Usage: scripts/bench-keyspace.sh   (IDEM_MODULE: the module to load;
#                                     CALLS: commands per phase, 20000)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/lib/common.sh"
MODULE=${IDEM_MODULE:-$(cd "$ROOT" && build_module)}
CALLS=${CALLS:-20000}
for tool in redis-server redis-cli valgrind callgrind_annotate; do
    command -v "$tool" >/dev/null || { echo "bench-keyspace: $tool not found" >&2; exit 1; }
done
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    [[ -n $SERVER_PID ]] && kill "$SERVER_PID" 2>/dev/null && wait "$SERVER_PID" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# run <label> [module]: prints "<label> <set per call> <expire per call> <hits> <misses>"
run() {
    local label=$1 port
    port=$(for p in $(seq 7400 7499); do port_free "$p" && echo "$p" && break; done)
    local args=(--port "$port" --save "" --appendonly no --dir "$WORK")
    [[ -n ${2:-} ]] && args+=(--loadmodule "$2")
    valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.$label" redis-server "${args[@]}" \
        >"$WORK/server.$label.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 150); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.2; done
    awk -v n="$CALLS" 'BEGIN { for (i = 0; i < n; i++) {
        k = "k:" i; printf "*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nv\r\n$2\r\nEX\r\n$3\r\n100\r\n", length(k), k } }' |
        redis-cli -p "$port" --pipe >/dev/null
    awk -v n="$CALLS" 'BEGIN { for (i = 0; i < n; i++) {
        k = "k:" i; printf "*3\r\n$6\r\nEXPIRE\r\n$%d\r\n%s\r\n$3\r\n200\r\n", length(k), k } }' |
        redis-cli -p "$port" --pipe >/dev/null
    local stats
    stats=$(redis-cli -p "$port" INFO stats | tr -d '\r')
    redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
    count() {
        callgrind_annotate --inclusive=yes --threshold=100 "$WORK/cg.$label" 2>/dev/null |
            awk -v fn=":$1" '$0 ~ fn " " && !t { gsub(",", "", $1); t = $1 } END { print t }'
    }
    local set expire
    set=$(count setCommand)
    expire=$(count expireCommand)
    [[ $set =~ ^[0-9]+$ && $expire =~ ^[0-9]+$ ]] || { echo "bench-keyspace: no counts ($label)" >&2; exit 1; }
    echo "$label $((set / CALLS)) $((expire / CALLS)) $(awk -F: '/^keyspace_hits:/ { h = $2 } /^keyspace_misses:/ { m = $2 } END { print h, m }' <<<"$stats")"
}

read -r _ set0 exp0 _ _ < <(run plain)
read -r _ set1 exp1 hits misses < <(run idem "$MODULE")
printf '%-34s %12s %12s %8s\n' "instructions per call ($CALLS each)" "with idem" "without" "ratio"
printf '%.0s-' {1..70}; echo
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2fx", a / b }'; }
printf '%-34s %12s %12s %8s\n' "SET key value EX 100" "$set1" "$set0" "$(ratio "$set1" "$set0")"
printf '%-34s %12s %12s %8s\n' "EXPIRE key 200" "$exp1" "$exp0" "$(ratio "$exp1" "$exp0")"
echo "keyspace_hits/misses counted with idem loaded (must be 0/0): $hits/$misses"
((hits == 0 && misses == 0)) || { echo "bench-keyspace: idem counted its own lookups" >&2; exit 1; }
