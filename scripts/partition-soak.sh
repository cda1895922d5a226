#!/usr/bin/env bash
# The randomized partition run (issue 31, docs/partitions.md): the example
# API, the writer, Redis and Postgres in network namespaces of their own,
# a nemesis drawing both-way and one-way partitions, cuts and writer kills
# from a seed for DURATION seconds while clients pay, then a checked
# history (no double effect, no lost or contradicting answer, everything
# mirrored). Needs root (namespaces); skips with a message without it.
#   SEED=<u64>      replay a run (printed by every run); default: random
#   DURATION=<s>    how long the nemesis runs; default 60
# The bounded scenarios run in `cargo test` (examples/payments-api/tests/partitions.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

ensure_packages redis-server:redis-server psql:postgresql-client ip:iproute2 \
    python3:python3 "$(pg_bindir)/initdb:postgresql" "$(pg_bindir)/pg_basebackup:postgresql"
ensure_base_packages
if [[ -z ${IDEM_MODULE:-} ]]; then
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
if [[ -n ${SEED:-} ]]; then
    export NEMESIS_SEED=$SEED
fi
export DURATION=${DURATION:-60}
[[ $DURATION =~ ^[0-9]+$ ]] || { echo "DURATION=$DURATION: whole seconds, please" >&2; exit 2; }

cargo build --release -p idem-writer --bin idem-writer
cargo test --release -p idem-example-payments --test partitions -- \
    --ignored --exact a_random_nemesis_never_pays_twice_with_the_fence --nocapture
