#!/usr/bin/env bash
# The Node package (clients/node) and the Node example (examples/payments-node):
# `npm ci` from their committed lockfiles, then tsc --strict, eslint and the
# node:test suites against a redis-server with the module (on a free port the
# tests pick) and Postgres (each run creates and drops its own databases).
# Uses $IDEM_MODULE when set, else builds the module; $DATABASE_URL when set,
# else the local Postgres on 127.0.0.1:5432, else a throwaway cluster.
# Arguments are passed to node --test (e.g. a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

ensure_packages node:nodejs npm:npm redis-server:redis-server psql:postgresql-client \
    "$(pg_bindir)/initdb:postgresql"
major=$(node -p 'process.versions.node.split(".")[0]')
if ((major < 20)); then
    echo "Node 20 or later is required (found $(node --version))" >&2
    exit 1
fi

if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    command -v cargo >/dev/null || { echo "cargo (Rust) is required to build the module" >&2; exit 1; }
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
ensure_database_url 54333

for dir in clients/node examples/payments-node; do
    echo "==> npm ci ($dir)"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
done

cd clients/node
echo "==> tsc --strict (clients/node)"
npm run --silent build
echo "==> eslint (clients/node)"
npx --no-install eslint .
echo "==> node --test (clients/node)"
node --test --test-concurrency=1 --test-timeout=300000 "${@:-test/}"

cd ../../examples/payments-node
echo "==> tsc --strict (examples/payments-node)"
npx --no-install tsc -p tsconfig.json --noEmit
echo "==> eslint (examples/payments-node)"
npx --no-install eslint .
echo "==> node --test (examples/payments-node)"
node --test --test-concurrency=1 --test-timeout=300000 test/
