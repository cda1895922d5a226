#!/usr/bin/env bash
# The operations kit in deploy/: promtool checks the Prometheus rules and
# runs their unit tests, then deploy/check_series.py validates the Grafana
# dashboard's JSON and holds every query (dashboard and rules) to the series
# the code exports. promtool comes from Debian's `prometheus` package: when
# it is not on PATH, the package is fetched with apt and only its promtool
# unpacked under target/ (installing it would start a Prometheus server).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

ensure_packages python3:python3 /usr/lib/python3/dist-packages/yaml:python3-yaml

promtool=$(command -v promtool || true)
if [[ -z $promtool ]]; then
    dir=${CARGO_TARGET_DIR:-$PWD/target}/promtool
    promtool=$dir/root/usr/bin/promtool
    if [[ ! -x $promtool ]]; then
        echo "==> fetching Debian's prometheus package for promtool"
        mkdir -p "$dir"
        (cd "$dir" && { apt-get download prometheus >/dev/null 2>&1 ||
            { apt-get update -qq && apt-get download prometheus >/dev/null; }; })
        dpkg-deb -x "$dir"/prometheus_*.deb "$dir/root"
        rm -f "$dir"/prometheus_*.deb
    fi
fi
"$promtool" --version 2>&1 | head -n1

echo "==> promtool check rules"
"$promtool" check rules deploy/prometheus/idem-rules.yml
echo "==> promtool test rules"
"$promtool" test rules deploy/prometheus/tests/*.test.yml
echo "==> dashboard and queries against the exported series"
python3 deploy/check_series.py

echo "==> INFO idem as Prometheus text (deploy/info-idem-textfile.sh)"
ensure_packages redis-server:redis-server redis-cli:redis-tools
if [[ -z ${IDEM_MODULE:-} ]]; then
    ensure_base_packages
    IDEM_MODULE=$(build_module)
fi
work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
start_redis() { # start_redis PORT [ARGS...]: a throwaway redis-server, its pid recorded
    local port=$1
    shift
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
        --dbfilename "dump-$port.rdb" "$@" >"$work/redis-$port.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do redis-cli -p "$port" PING >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "redis-server on $port did not start:" >&2
    cat "$work/redis-$port.log" >&2
    return 1
}
with_module=$(free_port)
start_redis "$with_module" --loadmodule "$IDEM_MODULE"
redis-cli -p "$with_module" IDEM.BEGIN order-1 fp 60 >/dev/null
redis-cli -p "$with_module" IDEM.BEGIN order-1 fp 60 >/dev/null
deploy/info-idem-textfile.sh "redis://127.0.0.1:$with_module" >"$work/idem.prom"
"$promtool" check metrics <"$work/idem.prom"
for sample in "idem_module_new_total{node=\"127.0.0.1:$with_module/0\"} 1" \
    "idem_module_in_flight_total{node=\"127.0.0.1:$with_module/0\"} 1" \
    "idem_module_mirror_pending{node=\"127.0.0.1:$with_module/0\"} 0"; do
    grep -qxF "$sample" "$work/idem.prom" || { echo "missing: $sample" >&2; cat "$work/idem.prom" >&2; exit 1; }
done
without_module=$(free_port)
start_redis "$without_module"
if deploy/info-idem-textfile.sh "redis://127.0.0.1:$without_module" >/dev/null 2>"$work/err"; then
    echo "info-idem-textfile.sh accepted a node without the module" >&2
    exit 1
fi
grep -q "no INFO idem section" "$work/err"
echo "INFO idem: $(grep -vc '^#' "$work/idem.prom") samples, promtool-clean; a node without the module refused"
