#!/usr/bin/env bash
# Cleanup at scale, both layouts of idempotency_keys side by side: loads ROWS
# rows (default 10 million, generated in Postgres with generate_series, not
# through Redis) into a throwaway database per layout, half of them expired
# (spread over the 5 days before today, the rest over the 5 days after),
# runs `idem-writer cleanup --once`, and prints the cleanup's time and WAL
# volume (pg_current_wal_lsn before/after: the WAL of every database on the
# server, so run it when nothing else writes), and table + index size after
# cleanup (unpartitioned: also after a plain VACUUM, which cleanup needs).
# Env: ROWS (10000000), BODY_BYTES (128), DATABASE_URL (an admin URL on the
# server, default postgres://postgres@127.0.0.1:5432/postgres).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${ROWS:-10000000}
BODY_BYTES=${BODY_BYTES:-128}
ADMIN_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
cargo build --release -q -p idem-writer
WRITER=${CARGO_TARGET_DIR:-target}/release/idem-writer

base=${ADMIN_URL%/*}
# run_layout runs in a subshell; $$ stays this script's pid there.
cleanup_dbs() {
  for db in $(psql -X -qAt "$ADMIN_URL" -c \
      "SELECT datname FROM pg_database WHERE datname LIKE 'idem_bench_part_%_$$'"); do
    psql -q "$ADMIN_URL" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
  done
}
trap cleanup_dbs EXIT

sql() { psql -X -qAt -v ON_ERROR_STOP=1 "$1" -c "$2"; }
now_s() { date +%s.%N; }

# One layout: create, migrate, load, checkpoint, clean up, measure.
# Prints "layout seconds wal_bytes size_after [vacuum_seconds vacuum_wal size_after_vacuum]".
run_layout() {
  local layout=$1 db="idem_bench_part_${1}_$$"
  sql "$ADMIN_URL" "CREATE DATABASE $db" >/dev/null
  local url="$base/$db"
  "$WRITER" migrate --layout "$layout" --database-url "$url" >/dev/null 2>&1
  if [ "$layout" = partitioned ]; then
    # Past days: the partitions the writer would have created for them.
    sql "$url" "DO \$\$ DECLARE d date; BEGIN
      FOR d IN SELECT (now() AT TIME ZONE 'UTC')::date - k FROM generate_series(1, 5) AS k LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS idempotency_keys_p%s PARTITION OF idempotency_keys
                        FOR VALUES FROM (%L) TO (%L)', to_char(d, 'YYYYMMDD'),
                       d::timestamp AT TIME ZONE 'UTC', (d + 1)::timestamp AT TIME ZONE 'UTC');
      END LOOP; END \$\$"
  fi
  local t0=$(now_s)
  # Row i expires at a pseudo-random moment: even i in the 5 days before today's
  # start (expired), odd i in the 5 days after tomorrow's start (live).
  sql "$url" "SET TIME ZONE 'UTC';
    INSERT INTO idempotency_keys (key, fingerprint, response_body, response_status, status,
        expires_at, response_headers, token, created_at, completed_at)
    SELECT 'bench:' || md5(i::text), md5(i::text) || md5((-i)::text),
           convert_to(repeat('x', $BODY_BYTES), 'UTF8'), 201, 'completed',
           CASE WHEN i % 2 = 0
                THEN date_trunc('day', now()) - make_interval(secs => (i::int8 * 7919) % 432000 + 1)
                ELSE date_trunc('day', now()) + interval '1 day' + make_interval(secs => (i::int8 * 7919) % 432000)
           END,
           ARRAY[convert_to('content-type', 'UTF8'), convert_to('application/json', 'UTF8')],
           1700000000000000 + i, now(), now()
    FROM generate_series(1, $ROWS) AS i" >/dev/null
  sql "$url" "VACUUM ANALYZE idempotency_keys" >/dev/null
  local load=$(echo "$(now_s) - $t0" | bc)
  local before_size=$(size_of "$url")
  sql "$url" "CHECKPOINT" >/dev/null
  local lsn0=$(sql "$url" "SELECT pg_current_wal_lsn()")
  t0=$(now_s)
  local out=$("$WRITER" cleanup --once --database-url "$url" 2>/dev/null)
  local secs=$(echo "$(now_s) - $t0" | bc)
  local wal=$(sql "$url" "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn0')")
  local after=$(size_of "$url")
  local left=$(sql "$url" "SELECT count(*) FROM idempotency_keys")
  printf '%-14s load %6.1f s (%s MB)  cleanup: %s\n' "$layout" "$load" "$before_size" "$out" >&2
  local line="$layout $secs $wal $after $left"
  if [ "$layout" = unpartitioned ]; then
    lsn0=$(sql "$url" "SELECT pg_current_wal_lsn()")
    t0=$(now_s)
    sql "$url" "VACUUM idempotency_keys" >/dev/null
    local vsecs=$(echo "$(now_s) - $t0" | bc)
    local vwal=$(sql "$url" "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn0')")
    line="$line $vsecs $vwal $(size_of "$url")"
  fi
  sql "$ADMIN_URL" "DROP DATABASE $db" >/dev/null
  echo "$line"
}

# Table + indexes (+ TOAST) of idempotency_keys and all its partitions, in MB.
size_of() {
  sql "$1" "SELECT round(sum(pg_total_relation_size(r)) / 1048576.0)
            FROM (SELECT relid FROM pg_partition_tree('idempotency_keys')
                  UNION SELECT 'idempotency_keys'::regclass) AS t(r)"
}

echo "== partitioned vs unpartitioned cleanup: $ROWS rows (${BODY_BYTES}-byte bodies), half expired =="
read -r _ u_secs u_wal u_size u_left u_vsecs u_vwal u_vsize < <(run_layout unpartitioned)
read -r _ p_secs p_wal p_size p_left < <(run_layout partitioned)
mb() { echo "$(( $1 / 1048576 ))"; }
printf '%-44s %16s %16s\n' "" unpartitioned partitioned
printf '%-44s %14.1f s %14.2f s\n' "cleanup time" "$u_secs" "$p_secs"
printf '%-44s %13s MB %13s MB\n' "WAL written by cleanup" "$(mb "${u_wal%.*}")" "$(mb "${p_wal%.*}")"
printf '%-44s %13s MB %13s MB\n' "table + indexes after cleanup" "$u_size" "$p_size"
printf '%-44s %13.1f s %16s\n' "VACUUM after cleanup (unpartitioned)" "$u_vsecs" "-"
printf '%-44s %13s MB %16s\n' "WAL written by that VACUUM" "$(mb "${u_vwal%.*}")" "-"
printf '%-44s %13s MB %13s MB\n' "table + indexes after VACUUM" "$u_vsize" "$p_size"
printf '%-44s %16s %16s\n' "rows left" "$u_left" "$p_left"
