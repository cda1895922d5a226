#!/usr/bin/env bash
# A/B of the Python middleware's CPU per request without HTTP (asgi_cpu.py):
# ROUNDS (4) alternating processes, the package as checked out at REV (its
# clients/python/src and spec/, exported to a temporary directory and put
# first on PYTHONPATH) and this tree's, on one redis-server with the module
# (a free port, $IDEM_MODULE). The venv is bench/peers/run.sh's. Prints one
# JSON line per process. Usage: bench/peers/asgi_ab.sh REV [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/common.sh
rev=${1:?usage: asgi_ab.sh REV [REQUESTS]}
requests=${2:-2000}
python=${CARGO_TARGET_DIR:-$PWD/target}/peers-venv/bin/python
tmp=$(mktemp -d /tmp/idem-asgi-ab.XXXXXX)
port=$(free_port)
cp "${IDEM_MODULE:?set IDEM_MODULE}" "$tmp/libidem.so"
git archive "$rev" clients/python/src spec | tar -x -C "$tmp"
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" \
    --loadmodule "$tmp/libidem.so" >/dev/null &
rs=$!
trap 'kill $rs; rm -rf "$tmp"' EXIT
until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done
cpu=(); (( $(nproc) > 1 )) && cpu=(taskset -c 0)
for round in $(seq "${ROUNDS:-4}"); do
    for which in "$rev" HEAD+worktree; do
        path=(env); [[ $which == "$rev" ]] && path=(env "PYTHONPATH=$tmp/clients/python/src")
        redis-cli -p "$port" flushall >/dev/null
        out=$(cd bench/peers && "${path[@]}" REDIS_URL="redis://127.0.0.1:$port/" \
            "${cpu[@]}" "$python" -W ignore asgi_cpu.py --requests "$requests")
        echo "round $round $which $out"
    done
done
