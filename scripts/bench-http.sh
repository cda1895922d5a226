#!/usr/bin/env bash
# HTTP benchmark of the payments example: the same handler without the
# idempotency layer, with it (read-through off), with it and the Postgres
# fence, both again with read-through on, and replays, in one run, every
# request with a fresh key. Prints throughput ratios (the fence against the
# same layer without it, too), the added p50/p99 latency, and CPU per request
# of the server (its own runtime's threads), the load generator and Redis.
# Then the middleware's CPU per request in process, without HTTP (mw_cpu).
#
# Uses $DATABASE_URL, else the local Postgres on 127.0.0.1:5432, else a
# throwaway one; the bench creates and drops its own database and starts its
# own Redis with the module on a free port.
# Settings: BENCH_SECONDS (2 per variant and round), BENCH_ROUNDS (5),
# BENCH_CONCURRENCY (32), BENCH_VARIANTS (a comma-separated subset).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh
ensure_base_packages

ensure_database_url 54328

# The module alone (never linked against redis-rs), as test.sh builds it.
IDEM_MODULE=$(build_module)
export IDEM_MODULE
cargo build --release -q -p idem-example-payments --example http_bench
cargo build --release -q -p idem-client --example mw_cpu
echo "== HTTP middleware (issue 4) and the Postgres fence (issue 9) =="
target/release/examples/http_bench
echo "== Middleware CPU per request, in process, 2 workers (issue 12) =="
# MW_ROUNDS rounds alternating every mode; medians of the CPU per request.
# The layer's own figure is its mode's minus `bare` (the handler alone).
# Targets: half the issue's baseline (16 us a replay, 28 us a new key).
rounds=${MW_ROUNDS:-5}
declare -A cpu
for ((round = 1; round <= rounds; round++)); do
  for spec in bare:pipe ping:pipe pipe:pipe replay:manager replay:pipe new:manager new:pipe; do
    mode=${spec%%:*} transport=${spec#*:}
    line=$(MW_MODE=$mode MW_TRANSPORT=$transport MW_THREADS=2 MW_REQUESTS=40000 \
      target/release/examples/mw_cpu | grep '^mode ')
    echo "round $round $transport: $line"
    value=$(sed -E 's/.* ([0-9.]+) us CPU\/request.*/\1/' <<<"$line")
    cpu[$spec]+="$value "
  done
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
bare=$(median "${cpu[bare:pipe]}")
over() { awk -v a="$(median "$1")" -v b="$bare" 'BEGIN {printf "%.1f", a - b}'; }
echo "medians over $rounds rounds, us of CPU per request over the bare handler ($bare us):"
echo "  round trip: redis-rs ConnectionManager $(over "${cpu[ping:pipe]}"), Pipe $(over "${cpu[pipe:pipe]}")"
for mode in replay new; do
  baseline=$([[ $mode == replay ]] && echo 16 || echo 28)
  manager=$(over "${cpu[$mode:manager]}") pipe=$(over "${cpu[$mode:pipe]}")
  awk -v m="$mode" -v mg="$manager" -v p="$pipe" -v b="$baseline" 'BEGIN {
    printf "  %-6s ConnectionManager %5.1f us, Pipe %5.1f us (%.2fx of the manager); %.2fx of the issue baseline %d us (target <= 0.5x)\n",
      m, mg, p, p / mg, p / b, b }'
done
