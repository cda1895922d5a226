#!/usr/bin/env bash
# python_micro.py for the package at REV (exported with spec/ to a temporary
# directory, first on PYTHONPATH) and this tree's, alternating ROUNDS (3)
# times, on CPU 0 when there are 2. Usage: bench/peers/python_micro_ab.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: python_micro_ab.sh REV}
python=${CARGO_TARGET_DIR:-$PWD/target}/peers-venv/bin/python
tmp=$(mktemp -d /tmp/idem-micro-ab.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
git archive "$rev" clients/python/src spec | tar -x -C "$tmp"
cpu=(); (( $(nproc) > 1 )) && cpu=(taskset -c 0)
for round in $(seq "${ROUNDS:-3}"); do
    echo "round $round $rev $(PYTHONPATH=$tmp/clients/python/src "${cpu[@]}" "$python" bench/peers/python_micro.py)"
    echo "round $round worktree $("${cpu[@]}" "$python" bench/peers/python_micro.py)"
done
