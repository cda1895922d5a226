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
for mode in bare new replay; do
  MW_MODE=$mode MW_THREADS=2 MW_REQUESTS=40000 target/release/examples/mw_cpu
done
