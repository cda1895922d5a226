#!/usr/bin/env bash
# The Node peer benchmark (run.mjs): installs its pinned dependencies (npm ci,
# and clients/node's), builds clients/node, and runs idem's Express middleware
# against the Powertools TypeScript idempotency utility on one redis-server
# with the module (a free port). Uses $IDEM_MODULE when set, else builds the
# module. Arguments go to run.mjs (--seconds 5 --concurrency 32 --reverse).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/common.sh
ensure_packages node:nodejs npm:npm redis-server:redis-server
if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
(cd clients/node && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build)
(cd bench/node-peers && npm ci --no-audit --no-fund --loglevel=error)
exec node bench/node-peers/run.mjs "$@"
