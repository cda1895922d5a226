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
ensure_packages python3:python3
command -v cargo >/dev/null || { echo "cargo (Rust) is required" >&2; exit 1; }

ensure_database_url 54329

echo "==> gates: format, import circles, clippy, docs"
cargo fmt --all --check
python3 scripts/lib/import_cycles.py src crates/idem-core/src crates/idem-client/src crates/idem-writer/src crates/idem-cli/src
cargo clippy --release --workspace --all-targets -- -D warnings
RUSTDOCFLAGS=-Dwarnings cargo doc --release --no-deps --workspace
# idem-client's feature combinations (docs/client.md, "Features"): each
# builds without warnings, and without features it pulls in neither tower
# nor tokio-postgres.
for features in "" middleware postgres; do
    cargo clippy --release -p idem-client --no-default-features --features "$features" -- -D warnings
done
if cargo tree -p idem-client --no-default-features -e normal | grep -E ' (tower|tokio-postgres|deadpool-postgres) '; then
    echo "idem-client without features depends on tower or Postgres" >&2
    exit 1
fi

echo "==> build (release)"
cargo build --release --workspace --all-targets
IDEM_MODULE=$(build_module)
export IDEM_MODULE

started=$SECONDS
echo "==> tests"
cargo test --release --workspace -- "$@"
echo "==> tests: $((SECONDS - started)) s"

# Each part prints its own time; the whole run stays well under 45 minutes.
part() {
    local name=$1 started=$SECONDS
    shift
    echo "==> $name"
    "$@"
    echo "==> $name: $((SECONDS - started)) s"
}
part python scripts/test-python.sh
part node scripts/test-node.sh
# The binaries the suite drives were built above.
part conformance env CONFORMANCE_SKIP_BUILD=1 scripts/test-conformance.sh
part ops scripts/test-ops.sh
part docs scripts/test-docs.sh
