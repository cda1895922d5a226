#!/usr/bin/env bash
# Builds the book (docs/, mdBook) and checks it: fails on a missing
# {{#include}} (file or anchor), on anything mdBook reports as a warning or
# error, on a broken link or #anchor between the book's pages (Debian's
# linkchecker on the built HTML), and on a README link to no file.
# Installs what it needs: mdBook, pinned, with cargo into a cache outside
# the clone (IDEM_TOOLS, default ~/.cache/idem/tools; about 3 minutes once
# per machine), and linkchecker with apt. The book is left in target/book.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source scripts/lib/common.sh

MDBOOK_VERSION=0.5.4
TOOLS=${IDEM_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/idem/tools}
MDBOOK=$TOOLS/mdbook-$MDBOOK_VERSION/bin/mdbook

ensure_packages linkchecker:linkchecker

if [[ ! -x $MDBOOK ]] || [[ $("$MDBOOK" --version) != "mdbook v$MDBOOK_VERSION" ]]; then
  echo "==> installing mdbook $MDBOOK_VERSION into $TOOLS (once per machine)"
  build=$(mktemp -d)
  start=$SECONDS
  # Without the serve and watch features: no web server or file watcher to
  # compile, which halves the install.
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --quiet \
    --no-default-features --features search \
    --root "$TOOLS/mdbook-$MDBOOK_VERSION" --target-dir "$build"
  rm -rf "$build"
  echo "==> mdbook installed in $((SECONDS - start)) s"
fi

# Every {{#include FILE:ANCHOR}} names a file that exists and an anchor it
# marks: mdBook only logs a missing file, and includes nothing for a
# missing anchor.
fail=0
while IFS= read -r hit; do
  md=${hit%%:*}
  spec=${hit#*\{\{#include }
  spec=${spec%%\}\}*}
  file=${spec%%:*}
  anchor=""
  [[ $spec == *:* ]] && anchor=${spec#*:}
  path=$(dirname "$md")/$file
  if [[ ! -f $path ]]; then
    echo "$md: {{#include $spec}}: no file $path" >&2
    fail=1
  elif [[ -n $anchor && ! $anchor =~ ^[0-9] ]] &&
    ! { grep -q "ANCHOR: *$anchor\b" "$path" && grep -q "ANCHOR_END: *$anchor\b" "$path"; }; then
    echo "$md: {{#include $spec}}: $path has no ANCHOR/ANCHOR_END $anchor" >&2
    fail=1
  fi
done < <(grep -rHo '{{#include [^}]*}}' --include='*.md' docs)
# The README is read on its own, outside the book: each of its relative
# links names a file of the repository.
while IFS= read -r target; do
  target=${target%%#*}
  [[ -z $target || $target == *://* || -e $target ]] && continue
  echo "README.md: a link to $target, which does not exist" >&2
  fail=1
done < <(grep -o '\]([^)]*)' README.md | sed 's/^](//; s/)$//')
((fail == 0)) || exit 1

# Built outside the clone so that linkchecker, which drops root for
# `nobody`, can read it wherever the clone is.
out=$(mktemp -d /tmp/idem-book.XXXXXX)
trap 'rm -rf "$out"' EXIT
chmod 755 "$out"
log=$out/mdbook.log
if ! "$MDBOOK" build docs --dest-dir "$out/book" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
if grep -E '(^| )(WARN|ERROR) ' "$log" >&2; then
  echo "mdbook reported the problems above" >&2
  exit 1
fi
chmod -R a+rX "$out"

# Links and #anchors between the book's pages. Links that leave the book
# (into the repository, by a page included from outside docs/) are not
# the book's to check; external URLs are not checked at all. print.html
# repeats every chapter (checking it too took 28 s instead of 6 s).
config=$out/linkcheckerrc
printf '[AnchorCheck]\n' >"$config"
if ! linkchecker --config="$config" --no-status --no-robots \
  --ignore-url="^file://(?!$out/book/)" --ignore-url='/print\.html' \
  "$out/book/index.html" >"$out/links.txt" 2>&1; then
  sed -n '/^URL/,$p' "$out/links.txt" >&2
  echo "broken links in the book (above)" >&2
  exit 1
fi
tail -n 2 "$out/links.txt" | head -n 1

mkdir -p "${CARGO_TARGET_DIR:-$ROOT/target}"
rm -rf "${CARGO_TARGET_DIR:-$ROOT/target}/book"
cp -r "$out/book" "${CARGO_TARGET_DIR:-$ROOT/target}/book"
echo "docs: the book builds, every include resolves, no broken link (${CARGO_TARGET_DIR:-target}/book)"
