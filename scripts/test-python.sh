#!/usr/bin/env bash
# The Python package (clients/python): makes a venv under target/py-venv,
# installs the package with its pinned test extras (pytest, ruff, mypy,
# starlette, httpx), then checks the sync modules generated from the asyncio
# ones are up to date (scripts/gen-python-sync.py --check) and runs ruff,
# mypy --strict and pytest against a
# redis-server with the module (on a free port the tests pick) and Postgres.
# Uses $IDEM_MODULE when set, else builds the module; $DATABASE_URL when set,
# else the local Postgres on 127.0.0.1:5432, else a throwaway cluster.
# Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

ensure_packages python3:python3 redis-server:redis-server psql:postgresql-client \
    "$(pg_bindir)/initdb:postgresql"
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    # Debian splits venv and ensurepip out of python3.
    ensure_packages /usr/share/doc/python3-venv:python3-venv
fi

if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    command -v cargo >/dev/null || { echo "cargo (Rust) is required to build the module" >&2; exit 1; }
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
ensure_database_url 54331

venv=${CARGO_TARGET_DIR:-$PWD/target}/py-venv
if [[ ! -x $venv/bin/python ]]; then
    echo "==> python venv in $venv"
    python3 -m venv "$venv"
fi
echo "==> pip install clients/python[test]"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
# Not editable: the tests run against the wheel, its shipped spec files included.
"$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./clients/python
"$venv/bin/python" -m pip install -q --disable-pip-version-check "./clients/python[test]"

echo "==> generated sync twins (scripts/gen-python-sync.py --check)"
"$venv/bin/python" scripts/gen-python-sync.py --check

cd clients/python
echo "==> ruff"
"$venv/bin/ruff" check src tests
"$venv/bin/ruff" format --check src tests
echo "==> mypy --strict"
"$venv/bin/mypy" --strict src
echo "==> pytest"
"$venv/bin/pytest" -q -p no:cacheprovider "$@"
