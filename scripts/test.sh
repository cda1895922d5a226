#!/usr/bin/env bash
# Runs every test: installs what a fresh Debian machine lacks (cargo-nextest
# included), builds the workspace in release mode once (the module's
# libidem.so included), then runs side by side, in three lanes sharing the
# two cores:
#   rust:    every test binary of the workspace with cargo nextest
#            (.config/nextest.toml: how many at once, which never together,
#            per-test timeouts), unit, property and integration tests
#            against real redis-server and PostgreSQL; then
#            scripts/test-node.sh;
#   lint:    clippy (all targets, and idem-client's feature combinations),
#            rustdoc, the dependency gate and the doc tests, at a lower
#            CPU priority than the tests; then scripts/test-ops.sh and
#            test-docs.sh;
#   clients: scripts/test-python.sh, then test-conformance.sh.
# Each part prints its time; a summary lists them all. Format and import
# circles are checked first (a failure stops the run at once).
# Uses $DATABASE_URL, else a local Postgres on 127.0.0.1:5432, else starts a
# throwaway one for the duration of the run. Arguments are passed to nextest
# as test filters (e.g. `scripts/test.sh partitions`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh
source scripts/lib/parts.sh

ensure_base_packages
ensure_packages python3:python3
command -v cargo >/dev/null || { echo "cargo (Rust) is required" >&2; exit 1; }
ensure_nextest

target=${CARGO_TARGET_DIR:-$PWD/target}
parts_init "$target/ci"
trap lanes_kill EXIT
ensure_database_url 54329 # replaces the trap when it starts a throwaway cluster
[[ -n ${IDEM_THROWAWAY_PG:-} ]] &&
  trap 'lanes_kill; stop_throwaway_postgres "$IDEM_THROWAWAY_PG"; rm -rf "$IDEM_THROWAWAY_PG"' EXIT

run_gates() {
  cargo fmt --all --check
  python3 scripts/lib/import_cycles.py src crates/idem-core/src crates/idem-client/src crates/idem-writer/src crates/idem-cli/src
  # Generated data is what its generator writes.
  python3 scripts/gen-outbox-slots.py --check
  # The module's unsafe code lives in src/ffi only (docs/layout.md).
  if grep -rnw --include='*.rs' unsafe src | grep -v '^src/ffi/' | grep -v 'undocumented_unsafe_blocks'; then
    echo "unsafe outside src/ffi (above): put it behind a safe wrapper in src/ffi" >&2
    return 1
  fi
  # The commit format (CONTRIBUTING.md) for every commit since the hook
  # came (b72d51e, whose subject is over 72, predates it on its branch).
  if git rev-parse -q --verify b72d51e^{commit} >/dev/null; then
    scripts/hooks/commit-msg --range b72d51e..HEAD
  fi
}

# One build for every part: the test binaries, the examples (the fence test's
# holder, the conformance suite's payments-api), the writer, and the module
# on its own (build_module).
run_build() {
  cargo build --release --workspace --all-targets
  build_module >"$PARTS_DIR/module.path"
  # What nextest runs, listed now so that it need not call cargo (and wait
  # for the build directory's lock while the lint lane holds it).
  cargo nextest list --release --workspace --list-type binaries-only \
    --message-format json >"$PARTS_DIR/binaries.json"
  cargo metadata --format-version 1 --all-features --no-deps >"$PARTS_DIR/metadata.json"
}

part gates
part build
if part_failed gates || part_failed build; then
  parts_summary
  exit 1
fi
IDEM_MODULE=$(cat "$PARTS_DIR/module.path")
export IDEM_MODULE
export IDEM_FENCE_HOLDER=$target/release/examples/fence_holder

test_filters=("$@")
run_rust() {
  cargo nextest run --profile ci \
    --binaries-metadata "$PARTS_DIR/binaries.json" --cargo-metadata "$PARTS_DIR/metadata.json" \
    -- "${test_filters[@]}"
}

# Below the tests' priority: the compiler takes the cores the tests leave.
run_lint() {
  nice -n 15 cargo clippy --release --workspace --all-targets -- -D warnings
  RUSTDOCFLAGS=-Dwarnings nice -n 15 cargo doc --release --no-deps --workspace
  # idem-client's feature combinations (docs/client.md, "Features"): each
  # builds without warnings, and without features it pulls in neither tower
  # nor tokio-postgres.
  local features
  for features in "" middleware postgres; do
    nice -n 15 cargo clippy --release -p idem-client --no-default-features --features "$features" -- -D warnings
  done
  if cargo tree -p idem-client --no-default-features -e normal | grep -E ' (tower|tokio-postgres|deadpool-postgres) '; then
    echo "idem-client without features depends on tower or Postgres" >&2
    return 1
  fi
}
run_doctests() { nice -n 15 cargo test --release --workspace --doc; }

run_python() { scripts/test-python.sh; }
run_node() { scripts/test-node.sh; }
# The binaries the suite drives were built above.
run_conformance() { CONFORMANCE_SKIP_BUILD=1 scripts/test-conformance.sh; }
run_ops() { scripts/test-ops.sh; }
run_docs() { scripts/test-docs.sh; }

# Python and the conformance suite share target/py-venv: one lane, in that
# order. The other lanes take Node, ops and the book after their first part.
lane rust rust node
lane lint lint doctests ops docs
lane clients python conformance
lane_wait rust lint clients
scripts/lib/slowest.py "$target/nextest/ci/junit.xml" 15 || true
parts_summary
