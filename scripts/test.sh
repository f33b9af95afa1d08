#!/usr/bin/env bash
# Runs every test: the Release build (vectorised paths, llama.cpp adapter and a short real-model
# streaming run included) and the ASan + UBSan build (portable paths). Installs what it needs
# first; llama.cpp is built once into ~/.cache/infkv (about 6 minutes on 2 cores), the model and
# text are fetched once, and all are reused afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)
llama_prefix=$(scripts/llama_cpp.sh | tail -n 1)
scripts/model.sh >/dev/null   # the real model and text of the infkv-stream smoke test
scripts/kjv.sh >/dev/null
for preset in release sanitize; do
  echo "== infkv tests: $preset ==" >&2
  extra=()
  [ "$preset" = release ] && extra=(-DINFKV_WITH_LLAMA_CPP=ON "-DCMAKE_PREFIX_PATH=$llama_prefix")
  cmake --preset "$preset" "${extra[@]}" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  ctest --preset "$preset" -j "$jobs"
done
