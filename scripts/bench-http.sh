#!/usr/bin/env bash
# HTTP benchmark of the payments example: the same handler without the
# idempotency layer, with it (read-through off), with it and the Postgres
# fence, both again with read-through on, and replays, in one run, every
# request with a fresh key. Prints throughput ratios (the fence against the
# same layer without it, too), the added p50/p99 latency, and CPU per request
# of the server (its own runtime's threads), the load generator and Redis.
# Then the middleware's CPU per request in process, without HTTP (mw_cpu),
# against the code issue 12 measured (MW_BASELINE_REV, 6b1b6e3, built once
# in a worktree under target/baseline with bench/mw_cpu_baseline.rs as its
# mw_cpu), in time and in instructions (callgrind; MW_INSTRUCTIONS=0 skips).
#
# Uses $DATABASE_URL, else the local Postgres on 127.0.0.1:5432, else a
# throwaway one; the bench creates and drops its own database and starts its
# own Redis with the module on a free port.
# Settings: BENCH_SECONDS (2 per variant and round), BENCH_ROUNDS (5),
# BENCH_CONCURRENCY (32), BENCH_VARIANTS (a comma-separated subset);
# MW_ONLY=1 runs the in-process part only.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh
ensure_base_packages

ensure_database_url 54328

# The module alone (never linked against redis-rs), as test.sh builds it.
IDEM_MODULE=$(build_module)
export IDEM_MODULE
cargo build --release -q -p idem-example-payments --example http_bench
cargo build --release -q -p idem-client --example mw_cpu
if [[ ${MW_ONLY:-0} != 1 ]]; then
  echo "== HTTP middleware (issue 4) and the Postgres fence (issue 9) =="
  target/release/examples/http_bench
fi
baseline_rev=${MW_BASELINE_REV:-6b1b6e3}
baseline_dir=$PWD/target/baseline
baseline_bin=$baseline_dir/target/release/examples/mw_cpu
baseline_id="$baseline_rev $(sha256sum <bench/mw_cpu_baseline.rs | cut -c1-16)"
if ! git rev-parse -q --verify "$baseline_rev^{commit}" >/dev/null; then
  echo "bench-http: the baseline commit $baseline_rev is not in this checkout (a shallow clone?); fetch the history" >&2
  exit 1
fi
if [[ ! -x $baseline_bin || $(cat "$baseline_dir/id" 2>/dev/null) != "$baseline_id" ]]; then
  echo "building the baseline ($baseline_rev) in $baseline_dir/src"
  rm -rf "$baseline_dir"
  git worktree prune
  mkdir -p "$baseline_dir"
  git worktree add -q --detach "$baseline_dir/src" "$baseline_rev"
  mkdir -p "$baseline_dir/src/crates/idem-client/examples"
  cp bench/mw_cpu_baseline.rs "$baseline_dir/src/crates/idem-client/examples/mw_cpu.rs"
  (cd "$baseline_dir/src" && CARGO_TARGET_DIR=$baseline_dir/target \
    cargo build --release -q -p idem-client --example mw_cpu)
  echo "$baseline_id" >"$baseline_dir/id"
fi
current_bin=target/release/examples/mw_cpu

echo "== Middleware CPU per request, in process, 2 workers (issue 12) =="
# MW_ROUNDS rounds alternating every mode; medians of the CPU per request.
# The layer's own figure is its mode's minus `bare` (the handler alone) of
# the same build. Target: half of the baseline's (the code the issue measured,
# run alternately with the current code).
rounds=${MW_ROUNDS:-5}
declare -A cpu
for ((round = 1; round <= rounds; round++)); do
  for spec in bare:pipe ping:pipe pipe:pipe replay:manager replay:pipe new:manager new:pipe \
    bare:baseline replay:baseline new:baseline; do
    mode=${spec%%:*} transport=${spec#*:} bin=$current_bin
    [[ $transport == baseline ]] && bin=$baseline_bin
    line=$(MW_MODE=$mode MW_TRANSPORT=$transport MW_THREADS=2 MW_REQUESTS=40000 \
      "$bin" | grep '^mode ')
    echo "round $round $transport: $line"
    value=$(sed -E 's/.* ([0-9.]+) us CPU\/request.*/\1/' <<<"$line")
    cpu[$spec]+="$value "
  done
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
bare=$(median "${cpu[bare:pipe]}") bare_baseline=$(median "${cpu[bare:baseline]}")
over() { awk -v a="$(median "$1")" -v b="${2:-$bare}" 'BEGIN {printf "%.1f", a - b}'; }
echo "medians over $rounds rounds, us of CPU per request over the bare handler ($bare us; the baseline's $bare_baseline us):"
echo "  round trip: redis-rs ConnectionManager $(over "${cpu[ping:pipe]}"), Pipe $(over "${cpu[pipe:pipe]}")"
for mode in replay new; do
  manager=$(over "${cpu[$mode:manager]}") pipe=$(over "${cpu[$mode:pipe]}")
  baseline=$(over "${cpu[$mode:baseline]}" "$bare_baseline")
  awk -v m="$mode" -v mg="$manager" -v p="$pipe" -v b="$baseline" 'BEGIN {
    printf "  %-6s baseline %5.1f us; now: ConnectionManager %5.1f us, Pipe %5.1f us: %.2fx of the baseline (target <= 0.5x)\n",
      m, b, mg, p, p / b }'
done

[[ ${MW_INSTRUCTIONS:-1} == 0 ]] && exit 0
echo "== Middleware instructions per request, in process (issue 12) =="
# callgrind, a current-thread runtime, MW_CG_REQUESTS requests after 2,000
# of warm-up (and one seeding request): the same count for the same binary
# whatever else the machine does. Under valgrind SHA-256 runs its portable
# code (about 3,400 instructions a block, a few hundred cycles with the
# CPU's SHA extensions), so the figures are given with and without it.
ensure_packages valgrind:valgrind callgrind_annotate:valgrind
cg_requests=${MW_CG_REQUESTS:-3000}
cg_dir=$(mktemp -d)
trap 'rm -rf "$cg_dir"' EXIT
# The bench's body is canonical JSON, which the fingerprint hashes as it
# is; `:unsorted` is the same body with its members in another order
# (MW_BODY), canonicalized the full way.
declare -A ir sha
for build in baseline current; do
  bin=$current_bin
  [[ $build == baseline ]] && bin=$baseline_bin
  for spec in bare new replay new:unsorted replay:unsorted; do
    mode=${spec%%:*} body=canonical
    [[ $spec == *:* ]] && body=${spec#*:}
    out=$cg_dir/$build-${spec/:/-}.out
    MW_MODE=$mode MW_BODY=$body MW_THREADS=0 MW_REQUESTS=$cg_requests \
      valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" >/dev/null 2>&1
    ir[$build:$spec]=$(awk '/^summary:/ {print $2}' "$out")
    sha[$build:$spec]=$(callgrind_annotate --inclusive=yes "$out" 2>/dev/null |
      awk '!found && /sha2::sha256::compress256 \[/ {gsub(",", "", $1); print $1; found = 1}')
  done
done
per=$((cg_requests + 2001))
for mode in replay new replay:unsorted new:unsorted; do
  awk -v m="$mode" -v n="$per" \
    -v b="${ir[baseline:$mode]}" -v bb="${ir[baseline:bare]}" -v bs="${sha[baseline:$mode]:-0}" \
    -v c="${ir[current:$mode]}" -v cb="${ir[current:bare]}" -v cs="${sha[current:$mode]:-0}" 'BEGIN {
    base = (b - bb) / n; now = (c - cb) / n
    base_nosha = (b - bs - bb) / n; now_nosha = (c - cs - cb) / n
    printf "  %-15s layer per request: baseline %6.0f, now %6.0f instructions: %.2fx; without SHA-256 %6.0f -> %6.0f: %.2fx (target <= 0.5x)\n",
      m, base, now, now / base, base_nosha, now_nosha, now_nosha / base_nosha }'
done
