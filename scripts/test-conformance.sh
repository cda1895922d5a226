#!/usr/bin/env bash
# The language-neutral conformance suite (conformance/): builds the Rust
# example (target/release/payments-api) and the writer, installs the runner's
# Python dependencies into target/py-venv (as scripts/test-python.sh does) and
# the Python example's own venv (examples/payments-python/serve --install-only),
# checks the runner and the Python example (ruff, mypy --strict, the example's
# unit tests), then runs every scenario against the Rust and Python apps, and
# the Node one when examples/payments-node/serve exists. Each scenario gets its
# own redis-server with the module (free port), Postgres database and writer.
# Uses $IDEM_MODULE when set, else builds the module; $DATABASE_URL when set,
# else the local Postgres on 127.0.0.1:5432, else a throwaway cluster.
# CONFORMANCE_APPS=rust,python narrows the apps; CONFORMANCE_BACKENDS=module,functions
# (the default) the backends: on functions (Redis without the module, managed
# style) every scenario too, unless CONFORMANCE_FUNCTIONS_SCENARIOS narrows it
# (a comma list, or chaos); CONFORMANCE_SKIP_BUILD=1 uses the
# binaries already built; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh
started=$SECONDS

ensure_packages python3:python3 redis-server:redis-server psql:postgresql-client \
    "$(pg_bindir)/initdb:postgresql"
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    ensure_packages /usr/share/doc/python3-venv:python3-venv
fi

if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    command -v cargo >/dev/null || { echo "cargo (Rust) is required to build the module" >&2; exit 1; }
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
if [[ -z ${CONFORMANCE_SKIP_BUILD:-} ]]; then
    echo "==> cargo build --release: payments-api, idem-writer"
    cargo build --release -q -p idem-example-payments --bin payments-api -p idem-writer --bin idem-writer
fi
ensure_database_url 54332

target=${CARGO_TARGET_DIR:-$PWD/target}
venv=$target/py-venv
if [[ ! -x $venv/bin/python ]]; then
    echo "==> python venv in $venv"
    python3 -m venv "$venv"
fi
echo "==> pip install clients/python[test] and the example's requirements"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# Not editable, and reinstalled: the example's type check reads this tree's package.
"${pip[@]}" --force-reinstall --no-deps ./clients/python
"${pip[@]}" "./clients/python[test]" -r examples/payments-python/requirements.txt
echo "==> examples/payments-python: its venv"
examples/payments-python/serve --install-only

apps=${CONFORMANCE_APPS:-}
if [[ -z $apps ]]; then
    apps=rust,python
    if [[ -x examples/payments-node/serve ]]; then
        apps+=,node
    else
        echo "==> examples/payments-node/serve is missing: the Node app is not run"
    fi
fi

echo "==> ruff, mypy --strict (conformance runner, Python example)"
for dir in conformance examples/payments-python; do
    (cd "$dir" && "$venv/bin/ruff" check . && "$venv/bin/ruff" format --check .)
done
(cd conformance && "$venv/bin/mypy" --strict runner)
(cd examples/payments-python && "$venv/bin/mypy" --strict payments_app tests)
echo "==> examples/payments-python unit tests"
(cd examples/payments-python && "$venv/bin/pytest" -q -p no:cacheprovider)

echo "==> conformance suite: $apps"
cd conformance
CONFORMANCE_APPS=$apps CONFORMANCE_REQUIRE=$apps "$venv/bin/pytest" -q -p no:cacheprovider -rxs "$@"
echo "==> conformance: done in $((SECONDS - started)) s"
