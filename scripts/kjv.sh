#!/usr/bin/env bash
# Writes the King James Bible (public domain; Debian's bible-kjv package) as plain text for the
# real-model streaming evaluation (infkv-stream): one verse per line, references stripped, a blank
# line before each new book. Installs bible-kjv (and gnuplot-nox, which infkv-stream --plot uses)
# with apt-get when missing. Idempotent. The last line on stdout is the path of the text file.
#
# Environment: INFKV_CACHE (default ~/.cache/infkv).
set -euo pipefail

cache=${INFKV_CACHE:-$HOME/.cache/infkv}
out=$cache/text/kjv.txt

if [ -s "$out" ]; then
  echo "$out"
  exit 0
fi

need=()
command -v bible >/dev/null 2>&1 || need+=(bible-kjv)
command -v gnuplot >/dev/null 2>&1 || need+=(gnuplot-nox)
if [ ${#need[@]} -gt 0 ]; then
  echo "infkv kjv: installing ${need[*]}" >&2
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2 ||
    { "${sudo[@]}" apt-get update >&2 &&
      "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >&2; }
fi

mkdir -p "$cache/text"
tmp=$(mktemp "$cache/text/.kjv.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# `bible -f` turns pretty-printing off: one "Book<chapter>:<verse> text" line per verse. The range
# runs from the first verse to the last (31102 verses).
bible -f "Gen1:1-Rev22:21" </dev/null |
  awk '{
         ref = $1; book = ref; sub(/[0-9]+:[0-9]+$/, "", book)
         if (NR > 1 && book != last) print ""
         last = book
         sub(/^[^ ]+ /, "")
         print
       }' >"$tmp"
verses=$(grep -c . "$tmp")
if [ "$verses" -ne 31102 ]; then
  echo "infkv kjv: expected 31102 verses from bible-kjv, got $verses" >&2
  exit 1
fi
mv "$tmp" "$out"
trap - EXIT
echo "$out"
