#!/usr/bin/env bash
# The example API (target/release/payments-api) on each backend: BACKEND=module
# against a Redis with the module, BACKEND=functions against a Redis without
# it (the library loaded with FUNCTION LOAD REPLACE), alternating over rounds,
# driven by wrk with bench/peers/keys.lua (a fresh Idempotency-Key per request,
# or replays of keys completed beforehand). Prints req/s per round and the
# medians of per-round ratios functions/module. Uses its own database
# (created and dropped) on $DATABASE_URL's server (default the local
# Postgres). Knobs: SECONDS_PER (5), ROUNDS (3), CONCURRENCY (32),
# IDEM_MODULE, API (the binary).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$ROOT/scripts/lib/common.sh"
MODULE=${IDEM_MODULE:-$ROOT/target/release/module/libidem.so}
API=${API:-$ROOT/target/release/payments-api}
SECONDS_PER=${SECONDS_PER:-5}
ROUNDS=${ROUNDS:-3}
CONCURRENCY=${CONCURRENCY:-32}
BASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
DB=idem_fbench_$$
DB_URL=${BASE_URL%/*}/$DB
for t in redis-server redis-cli wrk psql; do command -v $t >/dev/null || { echo "http.sh: $t not found" >&2; exit 1; }; done
WORK=$(mktemp -d -t idem-fhttp.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  psql "$BASE_URL" -qc "DROP DATABASE IF EXISTS $DB" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
psql "$BASE_URL" -qc "CREATE DATABASE $DB" >/dev/null

RPORT_M=$(free_port); RPORT_F=$(free_port)
redis-server --port "$RPORT_M" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" \
  --logfile "$WORK/rm.log" --loadmodule "$MODULE" effect-format 2 >/dev/null 2>&1 & PIDS+=($!)
redis-server --port "$RPORT_F" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" \
  --logfile "$WORK/rf.log" >/dev/null 2>&1 & PIDS+=($!)
for p in "$RPORT_M" "$RPORT_F"; do
  for _ in $(seq 200); do [[ $(redis-cli -p "$p" PING 2>/dev/null) == PONG ]] && break; sleep 0.05; done
done
redis-cli -p "$RPORT_F" -x FUNCTION LOAD REPLACE <"$ROOT/functions/idem.lua" >/dev/null

declare -A HPORT
start_api() { # start_api <backend> <redis port>: sets HPORT[backend]
  local port
  port=$(free_port)
  BACKEND=$1 REDIS_URL=redis://127.0.0.1:$2/ DATABASE_URL=$DB_URL PORT=$port \
    "$API" >"$WORK/api-$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 300); do
    curl -s -o /dev/null "http://127.0.0.1:$port/payments/none" && { HPORT[$1]=$port; return; }
    sleep 0.1
  done
  cat "$WORK/api-$1.log" >&2; echo "http.sh: the $1 API did not start" >&2; exit 1
}
start_api module "$RPORT_M"
start_api functions "$RPORT_F"

# wrk_rps <backend> <mode> <prefix> [n]
wrk_rps() {
  local out
  out=$(IDEM_BENCH_BODY='{"amount":100,"currency":"EUR","recipient":"acct_bench"}' \
    IDEM_BENCH_AUTHORIZATION="Bearer tok_demo" \
    wrk -t 2 -c "$CONCURRENCY" -d "${SECONDS_PER}s" -s "$ROOT/bench/peers/keys.lua" \
    "http://127.0.0.1:${HPORT[$1]}" -- "$2" "$3" /payments ${4:-} | grep '^PEERS ')
  python3 -c 'import json,sys; d=json.loads(sys.argv[1][6:]); bad=d["non_2xx_3xx"]+d["connect"]+d["read"]+d["write"]+d["timeout"]
assert bad == 0, d; print("%.0f" % (d["requests"] / d["duration_us"] * 1e6))' "$out"
}
# Replay keys, completed once on each backend.
REPLAY_N=200
for b in module functions; do
  for i in $(seq 0 $((REPLAY_N - 1))); do
    curl -sf -o /dev/null -X POST -H 'Content-Type: application/json' -H 'Authorization: Bearer tok_demo' -H "Idempotency-Key: rp-$b-$i" \
      -d '{"amount":100,"currency":"EUR","recipient":"acct_bench"}' "http://127.0.0.1:${HPORT[$b]}/payments"
  done
done
declare -A R
for r in $(seq "$ROUNDS"); do
  order=(module functions); ((r % 2 == 0)) && order=(functions module)
  for b in "${order[@]}"; do R[new-$b]+="$(wrk_rps "$b" new "n$r-$b") "; done
  for b in "${order[@]}"; do R[rep-$b]+="$(wrk_rps "$b" replay "rp-$b" "$REPLAY_N") "; done
  echo "round $r/$ROUNDS (load $(cut -d' ' -f1 /proc/loadavg))" >&2
done
python3 - "${R[new-module]}" "${R[new-functions]}" "${R[rep-module]}" "${R[rep-functions]}" <<'PY'
import statistics as st, sys
nm, nf, rm, rf = ([float(x) for x in a.split()] for a in sys.argv[1:])
med = st.median
for what, m, f in (("new key", nm, nf), ("replay", rm, rf)):
    print(f"{what:8} module {med(m):8.0f} req/s  functions {med(f):8.0f} req/s  "
          f"functions/module {med(b / a for a, b in zip(m, f)):.2f}x  "
          f"(rounds: {' '.join('%.0f' % x for x in m)} | {' '.join('%.0f' % x for x in f)})")
PY
echo "wrk: 2 threads, $CONCURRENCY connections, ${SECONDS_PER}s per run, $ROUNDS rounds alternating; load average now $(cut -d' ' -f1-3 /proc/loadavg)"
