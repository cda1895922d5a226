#!/usr/bin/env bash
# The Python peer benchmark (bench/python-peers/bench.py): a venv under
# ${CARGO_TARGET_DIR:-target}/py-peers-venv with the pinned requirements and
# the idem package, the module ($IDEM_MODULE, else built), then the run.
# PEERS_REQUESTS (2000 per phase), PEERS_ROUNDS (2), PEERS_CONCURRENCY (32).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/common.sh
ensure_packages python3:python3 redis-server:redis-server
if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    IDEM_MODULE=$(build_module)
fi
export IDEM_MODULE
venv=${CARGO_TARGET_DIR:-$PWD/target}/py-peers-venv
if [[ ! -x $venv/bin/python ]]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" -r bench/python-peers/requirements.txt
"${pip[@]}" --force-reinstall --no-deps ./clients/python
exec "$venv/bin/python" bench/python-peers/bench.py
