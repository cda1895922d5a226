#!/usr/bin/env bash
# Mirror benchmark: writer throughput vs the same upserts issued straight to
# Postgres (ratio from one run), and COMPLETE -> committed-row lag at a steady
# 5,000 completions/s (p50/p99). Starts its own redis-server with the module
# on a free port and uses a throwaway database on $DATABASE_URL (default
# postgres://postgres@127.0.0.1:5432/postgres). Extra flags go to the bench,
# e.g. `scripts/bench-mirror.sh --rows 200000 --appendfsync everysec`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p idem
exec cargo run --release -q -p idem-writer --example mirror_bench -- "$@"
