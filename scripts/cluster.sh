#!/usr/bin/env bash
# A local Redis Cluster with the idem module: 3 primaries + 3 replicas on
# ports $CLUSTER_PORT_BASE..+5 (7101-7106; bus ports +10000), AOF on, data and
# logs under $CLUSTER_DATA (.data/cluster). The module is $IDEM_MODULE, else
# target/release/libidem.so (built when missing).
#
#   scripts/cluster.sh start    start the nodes (creating the cluster the first time)
#   scripts/cluster.sh status   which nodes run, and the cluster's view of itself
#   scripts/cluster.sh stop     shut every node down (data kept)
#   scripts/cluster.sh purge    stop, then delete the data folder
#
# Then: redis-cli -c -p 7101 IDEM.BEGIN '{tenant-1}:K1' fp 60
#       idem-writer run --redis-cluster redis://127.0.0.1:7101 --database-url ...
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BASE=${CLUSTER_PORT_BASE:-7101}
DATA=${CLUSTER_DATA:-$ROOT/.data/cluster}
NODE_TIMEOUT=${CLUSTER_NODE_TIMEOUT:-2000}
MODULE=${IDEM_MODULE:-$ROOT/target/release/libidem.so}
PORTS=($(seq "$BASE" $((BASE + 5))))

die() { printf 'cluster.sh: %s\n' "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*"; }

(( BASE >= 1024 && BASE + 10005 <= 65535 )) || die "CLUSTER_PORT_BASE must be 1024..55530"
for port in "${PORTS[@]}"; do
  [[ $port == 6379 || $port == 6390 ]] && die "port $port is reserved; choose another CLUSTER_PORT_BASE"
done

cli() { redis-cli -h 127.0.0.1 -p "$1" "${@:2}"; }
running() { cli "$1" PING >/dev/null 2>&1; }

start() {
  command -v redis-server >/dev/null || die "redis-server is not installed"
  if [[ ! -f $MODULE ]]; then
    [[ -n ${IDEM_MODULE:-} ]] && die "IDEM_MODULE=$MODULE does not exist"
    say "building the module"
    cargo build --release -p idem
  fi
  local port fresh=0
  for port in "${PORTS[@]}"; do
    mkdir -p "$DATA/$port"
    [[ -f $DATA/$port/nodes.conf ]] || fresh=1
    if running "$port"; then
      echo "node $port already running"
      continue
    fi
    redis-server --port "$port" --bind 127.0.0.1 --daemonize yes \
      --dir "$DATA/$port" --logfile "$DATA/$port/redis.log" --pidfile "$DATA/$port/redis.pid" \
      --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout "$NODE_TIMEOUT" \
      --appendonly yes --save '' --loadmodule "$MODULE"
  done
  for port in "${PORTS[@]}"; do
    for _ in $(seq 100); do running "$port" && break; sleep 0.1; done
    running "$port" || die "node $port did not start; see $DATA/$port/redis.log"
  done
  if ((fresh)); then
    say "creating the cluster"
    redis-cli --cluster create $(printf '127.0.0.1:%s ' "${PORTS[@]}") \
      --cluster-replicas 1 --cluster-yes >"$DATA/create.log" ||
      die "redis-cli --cluster create failed; see $DATA/create.log"
  fi
  for _ in $(seq 300); do
    cluster_ok && break
    sleep 0.1
  done
  cluster_ok || die "the cluster did not reach cluster_state:ok; see $DATA/*/redis.log"
  say "cluster up: redis://127.0.0.1:$BASE (seed), nodes ${PORTS[0]}-${PORTS[5]}, data in $DATA"
}

cluster_ok() {
  local port
  for port in "${PORTS[@]}"; do
    cli "$port" CLUSTER INFO 2>/dev/null | grep -q '^cluster_state:ok' || return 1
  done
}

status() {
  local port up=0
  for port in "${PORTS[@]}"; do
    if running "$port"; then
      up=$((up + 1))
      printf 'node %s: %s\n' "$port" "$(cli "$port" ROLE | head -n1)"
    else
      printf 'node %s: down\n' "$port"
    fi
  done
  for port in "${PORTS[@]}"; do
    if running "$port"; then
      cli "$port" CLUSTER INFO | grep -E '^cluster_(state|known_nodes|size):' | tr -d '\r'
      cli "$port" CLUSTER NODES | awk '{print "  " $2, $3, $9, $10}'
      break
    fi
  done
  ((up == ${#PORTS[@]}))
}

stop() {
  local port pid
  for port in "${PORTS[@]}"; do
    running "$port" || continue
    pid=$(cat "$DATA/$port/redis.pid" 2>/dev/null || true)
    cli "$port" SHUTDOWN >/dev/null 2>&1 || true
    for _ in $(seq 100); do running "$port" || break; sleep 0.1; done
    running "$port" && die "node $port did not stop (pid ${pid:-unknown})"
  done
  say "cluster stopped (data kept in $DATA)"
}

case ${1:-} in
  start) start ;;
  status) status ;;
  stop) stop ;;
  purge) stop; rm -rf "$DATA"; say "removed $DATA" ;;
  *) die "usage: scripts/cluster.sh start|status|stop|purge" ;;
esac
