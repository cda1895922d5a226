#!/usr/bin/env bash
# Prints every field of the module's `INFO idem` of each Redis node given as
# Prometheus text, for node_exporter's textfile collector (or any scraper of
# files): counters as idem_module_<field>_total, gauges as
# idem_module_<field> (mirror_oldest_pending_ms in seconds, as
# idem_module_mirror_oldest_pending_seconds), labelled node="host:port/db" as the writer labels its
# series, so the two can be joined. A stock redis_exporter does not export a
# module's INFO fields (it keeps the fields it knows). Usage:
#   REDIS_URL_FILE=/run/secrets/idem-redis-urls info-idem-textfile.sh > idem.prom
#   info-idem-textfile.sh redis://[user@]host:port[/db]... > idem.prom
# (write to a temporary file and rename it into the collector's directory).
# A password is best kept off the command line: in the comma-separated URLs
# of REDIS_URL_FILE, or in REDISCLI_AUTH. It is handed to redis-cli through
# REDISCLI_AUTH, never printed. rediss:// URLs use TLS, with REDIS_CA_CERT,
# REDIS_CLIENT_CERT and REDIS_CLIENT_KEY when set (docs/security.md).
# Exits non-zero when a node does not answer or has no idem section.
set -euo pipefail

# The INFO idem fields that are gauges (src/info.rs); the others are counters.
GAUGES=" mirror_pending mirror_oldest_pending_ms waiters effects_consumed "

if ((! $#)) && [[ -n ${REDIS_URL_FILE:-} ]]; then
    IFS=',' read -r -a urls < <(tr -d '\n' <"$REDIS_URL_FILE") || true
    set -- "${urls[@]}"
fi
(($#)) || { echo "usage: $0 REDIS_URL... (or REDIS_URL_FILE=FILE $0)" >&2; exit 2; }
for url in "$@"; do
    scheme=${url%%://*}
    rest=${url#*://}
    hostpart=${rest##*@}
    # The password leaves the URL: redis-cli gets it through REDISCLI_AUTH
    # (not its argv), and messages name the node by host:port/db only.
    password=${REDISCLI_AUTH:-}
    user=
    if [[ $rest == *@* ]]; then
        userinfo=${rest%@*}
        user=${userinfo%%:*}
        [[ $userinfo == *:* ]] && password=${userinfo#*:}
    fi
    target="$scheme://${user:+$user@}$hostpart"
    [[ $hostpart == */* ]] || hostpart="$hostpart/0"
    tls=()
    if [[ $scheme == rediss ]]; then
        tls=(--tls)
        [[ -n ${REDIS_CA_CERT:-} ]] && tls+=(--cacert "$REDIS_CA_CERT")
        [[ -n ${REDIS_CLIENT_CERT:-} ]] && tls+=(--cert "$REDIS_CLIENT_CERT" --key "$REDIS_CLIENT_KEY")
    fi
    info=$(REDISCLI_AUTH=$password redis-cli -u "$target" "${tls[@]}" --no-auth-warning INFO idem | tr -d '\r') ||
        { echo "$hostpart: INFO idem failed" >&2; exit 1; }
    grep -q '^idem_' <<<"$info" || { echo "$hostpart: no INFO idem section (is the module loaded?)" >&2; exit 1; }
    sed -n 's/^idem_\([a-z_]*\):\([0-9]*\)$/\1 \2/p' <<<"$info" | while read -r field value; do
        printf '%s %s %s\n' "$field" "$hostpart" "$value"
    done
done | sort -s -k1,1 | awk -v gauges="$GAUGES" '
    {
        gauge = index(gauges, " " $1 " ") > 0
        field = $1
        value = $3
        if (field ~ /_ms$/) {
            sub(/_ms$/, "_seconds", field)
            value = sprintf("%.3f", $3 / 1000)
        }
        name = "idem_module_" field (gauge ? "" : "_total")
        if (name != last) {
            kind = gauge ? "gauge" : "counter"
            print "# HELP " name " INFO idem field idem_" $1 " of the node."
            print "# TYPE " name " " kind
            last = name
        }
        printf "%s{node=\"%s\"} %s\n", name, $2, value
    }'
