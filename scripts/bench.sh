#!/usr/bin/env bash
# Runs every benchmark and prints its figures: the module against SET NX, a
# Lua script and GET (bench-module.sh), what idem adds to native SET EX and
# EXPIRE (bench-keyspace.sh), the Postgres mirror (bench-mirror.sh),
# the HTTP middleware (bench-http.sh), WAIT wake-up cost, and cleanup of the
# partitioned vs the unpartitioned table (bench-partition.sh, 10M rows).
# The fence at processor latencies 0/50/200 ms against the same API without
# it (fence_bench). The Functions library against the module on one server
# (bench/functions/run.py). `scripts/bench.sh
# module|mirror|http|fence|wait|partition|peers|functions` runs one of them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh
ensure_base_packages
cargo build --release --workspace --bins --examples >/dev/null

# The module twice: as benchmarked (no replica, no AOF: idem builds no
# effects), and with a replication backlog receiving every effect.
run_module() {
  scripts/bench-module.sh
  echo; EFFECTS=consumed scripts/bench-module.sh
}
run_fence() {
  echo "== The fence at production latency (issue 28) =="
  IDEM_MODULE=$(build_module) target/release/examples/fence_bench
}
run_wait() {
  echo "== WAIT wake-up (issue 5) =="
  ulimit -n 8192 2>/dev/null || true
  target/release/examples/wait_wakeup
}

# The Python and Node middlewares against AWS Powertools' idempotency, on
# the same Redis, under one load generator (wrk), alternating over rounds
# (bench/peers; arguments after `peers` go to its driver).
run_peers() {
  IDEM_MODULE=$(build_module) bench/peers/run.sh "$@"
}

# The Functions library (functions/idem.lua) against the module, both loaded
# in one redis-server, alternating over rounds; Redis' own time per call
# (INFO commandstats) and calls/s; then the example API's req/s on each
# backend (bench/functions/http.sh, wrk and a throwaway Postgres database).
run_functions() {
  local module=${IDEM_MODULE:-$(build_module)}
  IDEM_MODULE=$module python3 bench/functions/run.py
  echo; IDEM_MODULE=$module bench/functions/http.sh
}

case ${1:-all} in
  module) run_module; echo; scripts/bench-keyspace.sh ;;
  mirror) scripts/bench-mirror.sh ;;
  http) scripts/bench-http.sh ;;
  fence) run_fence ;;
  wait) run_wait ;;
  partition) scripts/bench-partition.sh ;;
  peers) shift; run_peers "$@" ;;
  functions) run_functions ;;
  all)
    run_module
    echo; scripts/bench-keyspace.sh
    echo; run_wait
    echo; scripts/bench-mirror.sh
    echo; scripts/bench-http.sh
    echo; run_fence
    echo; scripts/bench-partition.sh
    echo; run_peers
    echo; run_functions
    ;;
  *) echo "usage: $0 [module|mirror|http|fence|wait|partition|peers|functions]" >&2; exit 2 ;;
esac
