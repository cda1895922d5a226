# Shared by scripts/*.sh: installing what a fresh Debian machine lacks, and a
# throwaway PostgreSQL cluster. Source it; it defines functions only.

# ensure_packages CMD:PACKAGE... installs each PACKAGE whose CMD (a command or
# an absolute path) is missing, with one `apt-get update` before the first.
ensure_packages() {
  local missing=() pair cmd pkg
  for pair in "$@"; do
    cmd=${pair%%:*}; pkg=${pair#*:}
    if [[ $cmd == /* ]]; then [[ -e $cmd ]] && continue; else command -v "$cmd" >/dev/null 2>&1 && continue; fi
    missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  echo "==> installing ${missing[*]}"
  local sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

# build_module: builds the module on its own (`-p idem`) and prints the path
# of a copy of it. A workspace build unifies features, which would link
# idem-core's optional redis-rs into libidem.so; the module's own dependency
# graph has no redis-rs, and the gate below keeps it so. The copy survives
# later workspace builds (`cargo test --workspace` relinks libidem.so).
build_module() {
  local target=${CARGO_TARGET_DIR:-$PWD/target}
  local deps
  deps=$(cargo tree -p idem -e normal --prefix none) || return 1
  if grep -q '^redis v' <<<"$deps"; then
    echo "the module's dependency graph contains redis-rs" >&2
    return 1
  fi
  cargo build --release -q -p idem >&2
  mkdir -p "$target/release/module"
  # A new file renamed into place: a redis-server that loaded the previous
  # copy keeps its mapping (copying over it in place crashed such servers).
  cp "$target/release/libidem.so" "$target/release/module/libidem.so.$$"
  mv -f "$target/release/module/libidem.so.$$" "$target/release/module/libidem.so"
  echo "$target/release/module/libidem.so"
}

# The packages every script needs: Redis, the PostgreSQL server binaries
# (for throwaway clusters), libclang (the module's bindgen build), a C compiler.
ensure_base_packages() {
  ensure_packages redis-server:redis-server redis-cli:redis-tools redis-benchmark:redis-tools \
    psql:postgresql-client "$(pg_bindir)/initdb:postgresql" gcc:build-essential \
    /usr/lib/llvm-14/lib/libclang.so:libclang-dev
}

pg_bindir() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  echo "${d:-/usr/lib/postgresql/15/bin}"
}

# start_throwaway_postgres DIR PORT: initdb (once) and start a trust-auth
# cluster in DIR on 127.0.0.1:PORT, owned by the postgres user.
start_throwaway_postgres() {
  local dir=$1 port=$2 bin run=()
  bin=$(pg_bindir)
  [[ $(id -u) -eq 0 ]] && run=(runuser -u postgres --)
  mkdir -p "$dir"
  [[ $(id -u) -eq 0 ]] && chown postgres "$dir"
  if [[ ! -f $dir/PG_VERSION ]]; then
    "${run[@]}" "$bin/initdb" -D "$dir" -U postgres --auth=trust >/dev/null
  fi
  "${run[@]}" "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w \
    -o "-p $port -c listen_addresses=127.0.0.1 -k $dir" start >/dev/null
}

stop_throwaway_postgres() {
  local dir=$1 run=()
  [[ $(id -u) -eq 0 ]] && run=(runuser -u postgres --)
  "${run[@]}" "$(pg_bindir)/pg_ctl" -D "$dir" -m fast -w stop >/dev/null 2>&1 || true
}

# port_open PORT: true when something listens on 127.0.0.1:PORT.
port_open() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# free_port: prints a port nothing listens on, drawn at random below the
# kernel's ephemeral range (as the test kit's free_port does, so no client
# connection can take it before the server binds it); never 6379 or 6390.
free_port() {
  local low p
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || low=32768
  ((low > 11000)) || low=65536
  for _ in $(seq 200); do
    p=$((10000 + RANDOM % (low - 10000)))
    [[ $p == 6379 || $p == 6390 ]] && continue
    port_open "$p" || { echo "$p"; return 0; }
  done
  echo "free_port: no free port" >&2
  return 1
}

# ensure_database_url SPARE_PORT: exports DATABASE_URL: as given, else the
# local Postgres on 127.0.0.1:5432, else a throwaway cluster on SPARE_PORT,
# stopped and removed when the script exits.
ensure_database_url() {
  [[ -n ${DATABASE_URL:-} ]] && return 0
  if port_open 5432; then
    export DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres
    return 0
  fi
  IDEM_THROWAWAY_PG=$(mktemp -d /tmp/idem-pg.XXXXXX)
  start_throwaway_postgres "$IDEM_THROWAWAY_PG" "$1"
  trap 'stop_throwaway_postgres "$IDEM_THROWAWAY_PG"; rm -rf "$IDEM_THROWAWAY_PG"' EXIT
  export DATABASE_URL=postgres://postgres@127.0.0.1:$1/postgres
}

# ensure_nextest: cargo-nextest (scripts/test.sh runs the Rust tests with it),
# installed with cargo when missing: a pinned version, once per machine.
NEXTEST_VERSION=0.9.143
ensure_nextest() {
  cargo nextest --version >/dev/null 2>&1 && return 0
  echo "==> installing cargo-nextest $NEXTEST_VERSION (once per machine)"
  cargo install --locked --quiet "cargo-nextest@$NEXTEST_VERSION"
}
