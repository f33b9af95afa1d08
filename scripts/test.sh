#!/usr/bin/env bash
# Runs every test: the Release build (vectorised paths) and the ASan + UBSan build (portable
# paths). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)
for preset in release sanitize; do
  echo "== infkv tests: $preset ==" >&2
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs"
done
