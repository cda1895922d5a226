#!/usr/bin/env bash
# The peer benchmark (bench/peers/peers.py): installs wrk (Debian) and what
# the Python and Node apps need (a venv under ${CARGO_TARGET_DIR:-target}/
# peers-venv with bench/python-peers' pinned requirements and this tree's
# clients/python; npm ci of clients/node and bench/node-peers), the module
# ($IDEM_MODULE, else built), then runs the driver. Arguments go to it:
# --seconds 4 --rounds 5 --connections 32 --languages python,node --no-probes.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/common.sh
ensure_packages wrk:wrk taskset:util-linux python3:python3 node:nodejs npm:npm \
    redis-server:redis-server
if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
venv=${CARGO_TARGET_DIR:-$PWD/target}/peers-venv
if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# The pinned set, but for its idem-client line: this tree's package instead.
"${pip[@]}" -r <(grep -v '^idem-client' bench/python-peers/requirements.txt)
"${pip[@]}" --force-reinstall --no-deps ./clients/python
(cd clients/node && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build)
(cd bench/node-peers && npm ci --no-audit --no-fund --loglevel=error)
exec "$venv/bin/python" bench/peers/peers.py "$@"
