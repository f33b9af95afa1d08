#!/usr/bin/env bash
# Builds infkv and runs its main job, infkv-compare, on the built-in workload. Extra arguments
# go to infkv-compare (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target infkv_compare >&2
exec build/release/tools/infkv-compare "$@"
