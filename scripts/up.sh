#!/usr/bin/env bash
# The project's main job: installs what a fresh Debian machine lacks, builds
# everything in release mode, and runs the whole stack in the foreground:
#   - redis-server with the idem module (AOF on), port $REDIS_PORT (6390),
#     data in .data/redis; with BACKEND=functions (or scripts) a redis-server
#     run as a managed service runs it (no module, MODULE renamed away) and
#     idem runs on the Functions library (functions/idem.lua, loaded with
#     `idem functions load`; the clients would load it themselves too)
#   - Postgres: $DATABASE_URL when set, else a throwaway cluster in
#     .data/postgres on port $PG_PORT (5433, or the next free one)
#   - the mirror writer (metrics on 127.0.0.1:$METRICS_PORT, 9187)
#   - the example payments API on http://127.0.0.1:$PORT (8080): the Rust
#     one (examples/payments-api), or with APP=python or APP=node the same
#     API in Python (examples/payments-python) or Node
#     (examples/payments-node), each started by its `serve`, which installs
#     its dependencies on first use
# It shows the four IDEM outcomes with redis-cli, prints curl commands that
# show the four HTTP outcomes, and stops everything it started on Ctrl-C.
# Logs: .data/logs/. Other knobs: PROCESSOR_DELAY_MS (simulated payment
# processor latency, 2000, so that a duplicate can catch the original in
# flight), WAIT_MS (duplicates wait for the original's answer instead of 409),
# API_TOKENS (the bearer tokens the API accepts and their accounts; unset:
# the demo table tok_demo=acct_demo,tok_a=acct_a,tok_b=acct_b).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/lib/common.sh

REDIS_PORT=${REDIS_PORT:-6390}
PORT=${PORT:-8080}
METRICS_PORT=${METRICS_PORT:-9187}
PROCESSOR_DELAY_MS=${PROCESSOR_DELAY_MS:-2000}
APP=${APP:-rust}
BACKEND=${BACKEND:-module}
DATA=$ROOT/.data
LOGS=$DATA/logs

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'up.sh: %s\n' "$*" >&2; exit 1; }

# ---- install and build -------------------------------------------------------
ensure_base_packages
ensure_packages curl:curl
command -v cargo >/dev/null 2>&1 ||
  die "Rust is required (cargo not found): install it with rustup, then rerun"

case $APP in
  rust) api=(target/release/payments-api) ;;
  python | node) api=("examples/payments-$APP/serve") ;;
  *) die "APP=$APP: use rust, python or node" ;;
esac
case $BACKEND in
  module | functions | scripts) ;;
  *) die "BACKEND=$BACKEND: use module, functions or scripts" ;;
esac
if [[ $APP == python ]]; then
  ensure_packages python3:python3
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 ||
    ensure_packages /usr/share/doc/python3-venv:python3-venv
fi
[[ $APP == node ]] && ensure_packages node:nodejs npm:npm

for port in "$REDIS_PORT" "$PORT" "$METRICS_PORT"; do
  port_open "$port" && die "port $port is in use (set REDIS_PORT, PORT or METRICS_PORT)"
done

say "building the workspace (release)"
cargo build --release --workspace
MODULE=$(build_module)

# ---- process bookkeeping -----------------------------------------------------
mkdir -p "$DATA/redis" "$LOGS"
declare -A names=()
pids=()
started_postgres=""

cleanup() {
  trap - EXIT INT TERM
  ((${#pids[@]})) && say "stopping"
  local pid
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  if [[ -n $started_postgres ]]; then
    stop_throwaway_postgres "$started_postgres"
  fi
  pids=()
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start NAME LOG CMD...: runs CMD in the background, output to LOG.
start() {
  local name=$1 log=$2
  shift 2
  "$@" >"$log" 2>&1 &
  pids+=("$!")
  names[$!]=$name
}

# wait_for NAME SECONDS CHECK...: polls CHECK until it succeeds.
wait_for() {
  local name=$1 seconds=$2 i
  shift 2
  for ((i = 0; i < seconds * 10; i++)); do
    "$@" && return 0
    sleep 0.1
  done
  die "$name did not come up in ${seconds}s (see $LOGS)"
}

# ---- Redis: with the module, or as a managed service runs it -----------------
redis_args=(--port "$REDIS_PORT" --bind 127.0.0.1 --dir "$DATA/redis" --appendonly yes
  --appendfsync always --save "")
if [[ $BACKEND == module ]]; then
  say "starting redis-server with the idem module on 127.0.0.1:$REDIS_PORT (AOF on)"
  redis_args+=(--loadmodule "$MODULE")
else
  say "starting redis-server as a managed service runs it (no module, MODULE renamed away) on 127.0.0.1:$REDIS_PORT (AOF on)"
  redis_args+=(--rename-command MODULE "")
fi
start redis "$LOGS/redis.log" redis-server "${redis_args[@]}"
redis_ping() { [[ $(redis-cli -p "$REDIS_PORT" PING 2>/dev/null) == PONG ]]; }
wait_for redis-server 20 redis_ping
REDIS_URL=redis://127.0.0.1:$REDIS_PORT/
if [[ $BACKEND != module ]]; then
  say "loading the Functions library"
  target/release/idem functions load --redis "$REDIS_URL" --file functions/idem.lua
fi

# ---- Postgres ----------------------------------------------------------------
if [[ -n ${DATABASE_URL:-} ]]; then
  say "using DATABASE_URL"
else
  PG_PORT=${PG_PORT:-5433}
  while port_open "$PG_PORT"; do PG_PORT=$((PG_PORT + 1)); done
  say "starting a throwaway Postgres in .data/postgres on 127.0.0.1:$PG_PORT"
  stop_throwaway_postgres "$DATA/postgres" # a cluster left over by a killed run
  start_throwaway_postgres "$DATA/postgres" "$PG_PORT"
  started_postgres=$DATA/postgres
  DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres
fi
export DATABASE_URL

# ---- writer and API ----------------------------------------------------------
say "starting the mirror writer (metrics on http://127.0.0.1:$METRICS_PORT/metrics)"
start writer "$LOGS/writer.log" target/release/idem-writer run \
  --redis "$REDIS_URL" --database-url "$DATABASE_URL" --metrics-addr "127.0.0.1:$METRICS_PORT" \
  --backend "$([[ $BACKEND == module ]] && echo module || echo functions)"

if [[ $APP != rust ]]; then
  say "installing the $APP example's dependencies (first run only)"
  "${api[0]}" --install-only
fi
say "starting the payments API ($APP) on http://127.0.0.1:$PORT"
start payments-api "$LOGS/api.log" env REDIS_URL="$REDIS_URL" DATABASE_URL="$DATABASE_URL" \
  PORT="$PORT" PROCESSOR_DELAY_MS="$PROCESSOR_DELAY_MS" ${WAIT_MS:+WAIT_MS="$WAIT_MS"} BACKEND="$BACKEND" \
  IDEM_WRITER="$ROOT/target/release/idem-writer" "${api[@]}"
api_up() { port_open "$PORT"; }
wait_for payments-api 60 api_up
writer_up() { port_open "$METRICS_PORT"; }
wait_for idem-writer 30 writer_up

# ---- the four outcomes with redis-cli ----------------------------------------
cli() {
  printf '127.0.0.1:%s> %s\n' "$REDIS_PORT" "$*"
  redis-cli -p "$REDIS_PORT" --no-raw "$@" | sed 's/^/  /'
}
demo_key="demo:{cli}:$(date +%s)"
if [[ $BACKEND == module ]]; then
  say "the four IDEM.BEGIN outcomes, with redis-cli"
  begin=(IDEM.BEGIN "$demo_key")
  complete=(IDEM.COMPLETE "$demo_key")
else
  say "the four outcomes of the library's idem_begin, with redis-cli"
  # idem_complete also names the outbox of the key's slot (spec/functions.json).
  outbox=$(python3 -c 'import json, sys
sys.path.insert(0, "scripts")
from importlib import import_module
slots = import_module("gen-outbox-slots")
spec = json.load(open("spec/outbox_slots.json"))
print(spec["prefix"] + spec["tags"][slots.crc16(b"cli") % 16384] + spec["suffix"])')
  begin=(FCALL idem_begin 1 "$demo_key")
  complete=(FCALL idem_complete 2 "$demo_key" "$outbox")
fi
printf '127.0.0.1:%s> %s fp-1 60\n' "$REDIS_PORT" "${begin[*]}"
begin_reply=$(redis-cli -p "$REDIS_PORT" --no-raw "${begin[@]}" fp-1 60)
sed 's/^/  /' <<<"$begin_reply"
token=$(sed -n 's/^2) (integer) //p' <<<"$begin_reply")
[[ -n $token ]] || die "BEGIN did not answer new: $begin_reply"
cli "${begin[@]}" fp-1 60
cli "${complete[@]}" "$token" 201 '{"id":"demo"}' HEADER content-type application/json
cli "${begin[@]}" fp-1 60
cli "${begin[@]}" fp-2 60

# ---- the four outcomes over HTTP ---------------------------------------------
base=http://127.0.0.1:$PORT
run_id=$(date +%s)
body='{"amount":1000,"currency":"EUR","recipient":"acct_bob"}'
other='{"amount":2000,"currency":"EUR","recipient":"acct_bob"}'
# The API authenticates callers by bearer token (API_TOKENS; the demo table
# when unset); the token's account scopes the idempotency keys.
auth="-H 'Authorization: Bearer tok_demo'"
post="curl -si $base/payments -H 'Content-Type: application/json' $auth"
cat <<EOF

$(say "the payments API is up on $base; try the four outcomes:")

# new: runs the payment (about ${PROCESSOR_DELAY_MS} ms: simulated processor) -> 201 + Location
$post -H 'Idempotency-Key: "order-$run_id"' -d '$body'

# replay: the same request again -> the same 201, byte for byte, plus Idempotent-Replayed: true
$post -H 'Idempotency-Key: "order-$run_id"' -d '$body'

# mismatch: the same key with another amount -> 422 application/problem+json
$post -H 'Idempotency-Key: "order-$run_id"' -d '$other'

# in flight: a duplicate while the original still runs -> 409 with Retry-After
# (start the API with WAIT_MS=5000 and the duplicate waits for the 201 instead)
$post -H 'Idempotency-Key: "order-$run_id-b"' -d '$body' -o /dev/null & sleep 0.5; \\
$post -H 'Idempotency-Key: "order-$run_id-b"' -d '$body'; wait

# read a payment back
curl -s $auth $base/payments/1

# another account (tok_a) with the same key and body: its own payment, no replay
curl -si $base/payments -H 'Content-Type: application/json' -H 'Authorization: Bearer tok_a' -H 'Idempotency-Key: "order-$run_id"' -d '$body'

# no token (or an unknown one) -> 401 before idempotency runs; X-Account-Id is not trusted
curl -si $base/payments -H 'Content-Type: application/json' -H 'X-Account-Id: acct_demo' -H 'Idempotency-Key: "order-$run_id"' -d '$body'

# Redis lost everything? The writer mirrored the answer to Postgres; read-through replays it:
redis-cli -p $REDIS_PORT FLUSHALL
$post -H 'Idempotency-Key: "order-$run_id"' -d '$body'

Logs are in .data/logs/. Press Ctrl-C to stop everything.
EOF

# ---- run until Ctrl-C or until a process dies ----------------------------------
set +e
wait -n "${pids[@]}"
status=$?
set -e
for pid in "${pids[@]}"; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "up.sh: ${names[$pid]} exited (status $status); see $LOGS" >&2
  fi
done
exit 1
