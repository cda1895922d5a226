#!/usr/bin/env bash
# Runs every test: installs what a fresh Debian machine lacks, builds the
# workspace in release mode (the module's libidem.so included), and runs unit,
# property and integration tests against real redis-server and PostgreSQL.
# Uses $DATABASE_URL, else a local Postgres on 127.0.0.1:5432, else starts a
# throwaway one for the duration of the run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

ensure_base_packages
command -v cargo >/dev/null || { echo "cargo (Rust) is required" >&2; exit 1; }

if [[ -z ${DATABASE_URL:-} ]]; then
  if port_open 5432; then
    export DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
  else
    pgdir=$(mktemp -d /tmp/idem-test-pg.XXXXXX)
    start_throwaway_postgres "$pgdir" 54329
    trap 'stop_throwaway_postgres "$pgdir"; rm -rf "$pgdir"' EXIT
    export DATABASE_URL=postgres://postgres@127.0.0.1:54329/postgres
  fi
fi

echo "==> build (release)"
cargo build --release --workspace --all-targets
export IDEM_MODULE=$PWD/target/release/libidem.so

echo "==> tests"
cargo test --release --workspace -- "$@"
