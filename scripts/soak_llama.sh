#!/usr/bin/env bash
# The llama.cpp soak: TOKENS (default 1M) of the KJV text through SmolLM2-135M with a cache
# bounded to 1024 + 128 cells, evicted by POLICY (default inf_mllm_bias) after every block
# (infkv-stream, THREADS threads, default 2), then scripts/soak_llama_report.sh: the check of
# scripts/stream_soak_check.py (cache, host copies and RSS flat after warm-up, time per block
# without a trend) and a plot of RSS, cached slots and time per block against tokens (gnuplot).
# Writes OUT_DIR/soak_llama.csv, .json, .txt, _check.json and .png (default bench/results/soak).
# About 2 hours per million tokens with 2 threads on an otherwise idle 2-core machine.
#   scripts/soak_llama.sh [TOKENS] [OUT_DIR] [POLICY] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-1000000}
out=${2:-bench/results/soak}
policy=${3:-inf_mllm_bias}
threads=${4:-2}
mkdir -p "$out"
source scripts/llama_env.sh
cmake --build --preset release --target infkv_stream
build/release/tools/infkv-stream --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
  --policy "$policy" --threads "$threads" --progress 100 --csv "$out/soak_llama.csv" --json "$out/soak_llama.json" \
  | tee "$out/soak_llama.txt"
exec scripts/soak_llama_report.sh "$out" "$policy" "$tokens" "$threads"
