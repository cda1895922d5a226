#!/usr/bin/env bash
# Compatibility matrix: builds other Redis and Valkey versions from Debian's
# source packages and runs the module's integration tests (tests/*.rs) against
# each, with IDEM_REDIS_SERVER pointing the test kit at the built binary.
#
#   scripts/compat.sh              every server in the matrix
#   scripts/compat.sh valkey-8.1   only the named ones (see SERVERS below)
#   scripts/compat.sh --build-only build (or reuse) the binaries, run nothing
#
# Sources come through apt with a private sources list and private state and
# cache dirs, so the machine's own apt setup is untouched. Built binaries are
# cached under .data/compat/<name>/ (gitignored); delete a folder to rebuild.
# Builds run `make -j2`, one server at a time. Results go to
# .data/compat/results.md as README-ready table rows. Not part of test.sh:
# a full run takes about half an hour on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/common.sh

# name | Debian source package/suite ('system': the machine's redis-server) | server binary
SERVERS=(
  "redis-7.0|system|redis-server"
  "redis-8.0|redis/trixie|redis-server"
  "valkey-8.1|valkey/trixie|valkey-server"
  "valkey-9|valkey/sid|valkey-server"
)
# Redis 7.2 and 7.4 have no Debian source package (Debian went from 7.0 in
# bookworm to 8.0 in trixie), so they are not in the matrix.

DATA=$PWD/.data/compat
APT=$DATA/apt
build_only=no
wanted=()
for a in "$@"; do
  case $a in
    --build-only) build_only=yes ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) wanted+=("$a") ;;
  esac
done

# apt with private state: only the listed deb-src suites, no system config.
papt() {
  local tool=$1; shift
  "$tool" -o Dir::Etc::sourcelist="$APT/sources.list" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$APT/lists" -o Dir::State::status=/dev/null \
    -o Dir::Cache="$APT/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User=root "$@"
}

# apt_setup: the private sources list, and its package lists (refreshed daily).
apt_setup() {
  [[ -n $(find "$APT/updated" -mmin -1440 2>/dev/null) ]] && return 0
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial"
  local key=/usr/share/keyrings/debian-archive-keyring.gpg s
  : >"$APT/sources.list"
  for s in "debian-security trixie-security" "debian trixie" "debian sid"; do
    echo "deb-src [signed-by=$key] http://deb.debian.org/${s% *} ${s#* } main" >>"$APT/sources.list"
  done
  echo "==> apt-get update (private lists in $APT)" >&2
  papt apt-get update -qq >&2
  touch "$APT/updated"
}

# fetch_source PKG/SUITE DIR: unpacks Debian's upstream (orig) tarball of the
# suite's version into DIR and prints the Debian version. The orig tarball is
# upstream's source as Debian ships it; Debian's own patches only adapt
# packaging (paths, system libraries) and are not needed for a test binary,
# and some mirrors lack the newest debian.tar of a security update.
fetch_source() {
  local spec=$1 dir=$2 version dl orig
  apt_setup
  dl=$(mktemp -d "$DATA/dl.XXXXXX")
  (cd "$dl" && papt apt-get source --download-only -qq "$spec" >&2) || true
  orig=$(ls "$dl"/*.orig.tar.* 2>/dev/null | head -n1 || true)
  if [[ -z $orig ]]; then
    rm -rf "$dl"
    return 1
  fi
  version=$(ls "$dl"/*.dsc 2>/dev/null | head -n1 | sed -E 's/.*_([^_]+)\.dsc$/\1/' || true)
  [[ -n $version ]] || version=$(basename "$orig" | sed -E 's/^[^_]+_(.+)\.orig\.tar\..*/\1/')
  rm -rf "$dir" && mkdir -p "$dir"
  tar -xf "$orig" -C "$dir" --strip-components=1
  rm -rf "$dl"
  echo "$version"
}

# ensure_server NAME SPEC BINARY: prints the path of a built server binary,
# building it once.
ensure_server() {
  local name=$1 spec=$2 bin=$3 out=$DATA/$1 src version
  if [[ $spec == system ]]; then
    command -v "$bin"
    return 0
  fi
  if [[ -x $out/$bin ]]; then
    echo "$out/$bin"
    return 0
  fi
  mkdir -p "$DATA"
  src=$DATA/build-$name
  echo "==> $name: fetching $spec" >&2
  if ! version=$(fetch_source "$spec" "$src"); then
    echo "==> $name: no source package $spec on the mirror" >&2
    return 1
  fi
  echo "==> $name: building $version (make -j2)" >&2
  if ! make -C "$src" -j2 BUILD_TLS=no >"$DATA/build-$name.log" 2>&1; then
    echo "==> $name: build failed, see $DATA/build-$name.log" >&2
    return 1
  fi
  mkdir -p "$out"
  cp "$src/src/$bin" "$out/$bin"
  echo "$version" >"$out/debian-version"
  rm -rf "$src"
  echo "$out/$bin"
}

server_version() {
  "$1" --version | sed -E 's/.* v=([^ ]+).*/\1/'
}

ensure_base_packages
echo "==> build the module and its integration tests (release)"
cargo build --release -p idem
export IDEM_MODULE=${CARGO_TARGET_DIR:-$PWD/target}/release/libidem.so
# The test binaries run directly, so cargo's lock is not held meanwhile.
mapfile -t test_bins < <(cargo test --release -p idem --tests --no-run 2>&1 |
  sed -nE 's/.*Executable tests\/[^ ]+ \((.+)\)$/\1/p')
((${#test_bins[@]})) || { echo "no test binaries found" >&2; exit 1; }

date=$(date -u +%F)
results=$DATA/results.md
mkdir -p "$DATA"
: >"$results"
status=0
for entry in "${SERVERS[@]}"; do
  IFS='|' read -r name spec bin <<<"$entry"
  if ((${#wanted[@]})) && [[ " ${wanted[*]} " != *" $name "* ]]; then continue; fi
  if ! path=$(ensure_server "$name" "$spec" "$bin"); then
    echo "| $name | - | not built (source package unavailable or build failed) | $date |" >>"$results"
    status=1
    continue
  fi
  version=$(server_version "$path")
  echo "==> $name: $path ($version)"
  [[ $build_only == yes ]] && continue
  log=$DATA/test-$name.log
  : >"$log"
  for t in "${test_bins[@]}"; do
    IDEM_REDIS_SERVER=$path "$t" >>"$log" 2>&1 || status=1
  done
  passed=$(awk '/^test result:/ { for (i = 1; i <= NF; i++) if ($(i+1) ~ /^passed/) s += $i } END { print s + 0 }' "$log")
  failed=$(awk '/^test result:/ { for (i = 1; i <= NF; i++) if ($(i+1) ~ /^failed/) s += $i } END { print s + 0 }' "$log")
  failing=$(grep -E '^    [a-z_:]+$' "$log" | sed 's/^ *//' | sort -u | paste -sd, - || true)
  echo "==> $name ($version): $passed passed, $failed failed ${failing:+($failing)}"
  echo "| ${bin%-server} $version | $spec | $passed passed, $failed failed${failing:+: $failing} | $date |" >>"$results"
done
echo "==> results ($results):"
cat "$results"
exit $status
