#!/usr/bin/env bash
# Writes the Jargon File 4.4.7 (public domain; Debian's dict-jargon package) as plain text, the
# second long text of the real-model evaluation beside the KJV (scripts/kjv.sh): a lexicon of
# hacker slang, modern technical English where the KJV is early modern narrative. One entry per
# paragraph group: the headword, its pronunciation and part of speech, then its definition with
# the dictd indentation removed. Installs dict-jargon with apt-get when missing. Idempotent. The
# last line on stdout is the path of the text file.
#
# Environment: INFKV_CACHE (default ~/.cache/infkv).
set -euo pipefail

cache=${INFKV_CACHE:-$HOME/.cache/infkv}
out=$cache/text/jargon.txt
dict=/usr/share/dictd/jargon.dict.dz

if [ -s "$out" ]; then
  echo "$out"
  exit 0
fi

if [ ! -s "$dict" ]; then
  echo "infkv jargon: installing dict-jargon" >&2
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends dict-jargon >&2 ||
    { "${sudo[@]}" apt-get update >&2 &&
      "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends dict-jargon >&2; }
fi

mkdir -p "$cache/text"
tmp=$(mktemp "$cache/text/.jargon.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# The dictionary's first entries (00-database-*) describe the database, not the lexicon; the
# lexicon begins at its first entry, "(TM)". Leading indentation goes, runs of blank lines
# become one.
zcat "$dict" |
  awk 'started || /^\(TM\)$/ { started = 1; sub(/^ +/, ""); print }' |
  cat -s >"$tmp"
words=$(wc -w <"$tmp")
if [ "$words" -lt 150000 ]; then
  echo "infkv jargon: expected over 150000 words from dict-jargon, got $words" >&2
  exit 1
fi
mv "$tmp" "$out"
trap - EXIT
echo "$out"
