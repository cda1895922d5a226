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
