#!/usr/bin/env bash
# Performance inside the engine (docs/performance.md): SmolLM2-135M on the KJV text, budget 1024,
# block 128, THREADS threads (default 1). Writes JSON under OUT_DIR (default bench/results/engine),
# then scripts/perf_report.py regenerates docs/performance.md and its plots from them.
#   stream.json        infkv-stream over TOKENS (default 30000) tokens: llama.cpp's context shift,
#                      streaming_llm (no capture), inf_mllm_bias, h2o: perplexity, tok/s, time split
#   decode.json        single-token decode speed, full cache after 2K..HISTORY (default 16384)
#                      tokens of history, against bounded caches
#   prefill_*.json     one prefill per process: plain at 4K and 16K, budgeted block-wise at 4K, 16K, 64K
# About 50 minutes on one core of an idle 2-core machine. Steps whose JSON exists are kept
# (delete the file to rerun one).
#   scripts/perf.sh [OUT_DIR] [THREADS] [TOKENS] [HISTORY]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/engine}
threads=${2:-1}
tokens=${3:-30000}
history=${4:-16384}
mkdir -p "$out"
scripts/setup.sh
prefix=$(scripts/llama_cpp.sh | tail -1)
model=$(scripts/model.sh | tail -1)
text=$(scripts/kjv.sh | tail -1)
cmake --preset release -DINFKV_WITH_LLAMA_CPP=ON -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build --preset release --target infkv_stream infkv_engine_bench >&2
bin=build/release/examples
step() {  # step NAME COMMAND...: runs COMMAND unless OUT_DIR/NAME.json exists
  local name=$1; shift
  if [[ -s "$out/$name.json" ]]; then echo "perf: $out/$name.json exists, kept" >&2; return; fi
  echo "perf: $name (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  "$@" --json "$out/$name.json.tmp" | tee "$out/$name.txt"
  mv "$out/$name.json.tmp" "$out/$name.json"
}
step stream "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
  --policy context_shift,streaming_llm,inf_mllm_bias,h2o --threads "$threads" --progress 50
hist=2048; list=
while (( hist <= history )); do list=${list:+$list,}$hist; hist=$((hist * 2)); done
step decode "$bin/infkv-engine-bench" decode --model "$model" --text "$text" --history "$list" --threads "$threads" \
  --policy context_shift,streaming_llm,inf_mllm_bias,h2o
for n in 4096 16384; do
  step "prefill_plain_$n" "$bin/infkv-engine-bench" prefill --model "$model" --text "$text" --tokens $n --mode plain --threads "$threads"
done
for n in 4096 16384 65536; do
  step "prefill_budgeted_$n" "$bin/infkv-engine-bench" prefill --model "$model" --text "$text" --tokens $n --mode budgeted \
    --policy snapkv --block 512 --threads "$threads"
done
python3 scripts/perf_report.py "$out" docs/performance.md
