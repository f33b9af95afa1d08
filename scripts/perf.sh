#!/usr/bin/env bash
# Performance inside the engine and of the CPU kernels (docs/performance.md). SmolLM2-135M on the
# KJV text, budget 1024, block 128, THREADS threads (default 1) per llama.cpp run. JSON (and the
# console output as .txt) under OUT_DIR (default bench/results/perf), then scripts/perf_report.py
# regenerates docs/performance.md and its plots from them:
#   stream.json        infkv-stream over TOKENS (default 30000) tokens: llama.cpp's context shift,
#                      streaming_llm (no capture), inf_mllm_bias, h2o: perplexity, tok/s, time split
#   stream_768.json    streaming_llm with budget 768 (the context shift's mean occupancy)
#   observe_{1,2,3}.json  the price of observing: infkv-stream over TOKENS tokens, streaming_llm,
#                      inf_mllm_bias, snapkv, keydiff and h2o, three runs (the order turned each time)
#   keys_copy.json, keys_auto.json   6000 tokens with the session's key copies, then with llama.cpp's cache
#   loop_{1,2,3}.json  the decode loop: single-token decodes evicting when full, 4 policies, three runs
#   apart_{1,2,3}_POLICY.json  the same loop, one process per policy and run
#   interleave_{1,2,3}.json  the price of observing with the policies taking turns block by block
#                      (infkv-stream --interleave): streaming_llm, inf_mllm_bias, keydiff
#   interleave_gather_{1,2,3}.json  the same with --gather-cells (the cells moved together after each eviction);
#                      interleave_plain_1.json the same without, on the same machine
#   placement_{1,2}.json  a block's llama_decode into freed cells lying together (StreamingLLM's ring)
#                      against scattered ones (a scoring policy's), no session, flash attention on
#                      and off, contexts taking turns block by block; two seeds
#   memory_gather_4k.json  the session's bytes with --gather-cells (its move buffer counted), 4000 tokens
#   memory_2k.json     the session's bytes against the KV at 2K tokens, every window policy (at 30K:
#                      observe_*.json; at 64K: prefill_budgeted_65536.json)
#   decode.json        single-token decode speed, full cache after 2K..HISTORY (default 16384)
#                      tokens of history, against bounded caches
#   prefill_*.json     one prefill per process: plain at 2K, 4K, 8K and 16K, budgeted block-wise
#                      at 2K, 4K, 8K, 16K and 64K tokens (time, KV bytes, the session's bytes, peak RSS)
#   kernels_o2.json, kernels_o3.json   infkv_bench built at -O2 and at -O3 (-march=x86-64-v3)
# Every JSON gets a "provenance" record (scripts/provenance.py: commit, uncommitted changes, the
# command). About 70 minutes on an idle 2-core machine (PARALLEL=1: the stream run beside the others,
# one core each, about 40). Steps whose JSON exists are kept (delete the file to rerun one).
#   scripts/perf.sh [OUT_DIR] [THREADS] [TOKENS] [HISTORY]
#   ONLY="observe memory" scripts/perf.sh   only those steps (observe, interleave, interleave_gather, keys, loop, apart, placement, memory,
#                                           stream, engine, kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/perf}
threads=${2:-1}
tokens=${3:-30000}
history=${4:-16384}
mkdir -p "$out"
source scripts/llama_env.sh
cmake --build --preset release --target infkv_stream infkv_engine_bench >&2
bin=build/release/tools
step() {  # step NAME COMMAND...: runs COMMAND (which writes NAME.json.tmp) unless OUT_DIR/NAME.json exists
  local name=$1; shift
  if [[ -s "$out/$name.json" ]]; then echo "perf: $out/$name.json exists, kept" >&2; return; fi
  echo "perf: $name (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  "$@" | tee "$out/$name.txt"
  python3 scripts/provenance.py "$out/$name.json.tmp" "$*"
  mv "$out/$name.json.tmp" "$out/$name.json"
}
stream() {
  step stream "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
    --policy context_shift,streaming_llm,inf_mllm_bias,h2o --threads "$threads" --progress 50 --json "$out/stream.json.tmp"
  # streaming_llm with the context shift's mean cache occupancy (budget 768 + 128: about 830 tokens)
  step stream_768 "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 768 --block 128 \
    --policy streaming_llm --threads "$threads" --progress 50 --json "$out/stream_768.json.tmp"
}
observe() {  # alone on the machine: the overheads are ratios of seconds within each run
  local orders=(streaming_llm,inf_mllm_bias,snapkv,keydiff,h2o h2o,keydiff,snapkv,inf_mllm_bias,streaming_llm
                snapkv,streaming_llm,h2o,keydiff,inf_mllm_bias)
  for i in 1 2 3; do
    step "observe_$i" "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
      --policy "${orders[$((i - 1))]}" --threads "$threads" --progress 50 --json "$out/observe_$i.json.tmp"
  done
}
keys() {  # where the keys come from, side by side (alone on the machine)
  for k in copy auto; do
    step "keys_$k" "$bin/infkv-stream" --model "$model" --text "$text" --tokens 6000 --budget 1024 --block 128 \
      --policy inf_mllm_bias,snapkv,keydiff --keys $k --threads "$threads" --json "$out/keys_$k.json.tmp"
  done
}
loop() {  # the decode loop: single-token decodes, evicting when the cache is full (alone on the machine)
  for i in 1 2 3; do
    step "loop_$i" "$bin/infkv-engine-bench" decode --model "$model" --text "$text" --history 256 --gen 8 --warm 2048 \
      --bounded-gen 512 --policy streaming_llm,inf_mllm_bias,snapkv,keydiff --threads "$threads" --json "$out/loop_$i.json.tmp"
  done
}
interleave() {  # the price of observing again, the policies taking turns block by block in one process (alone on the machine)
  for i in 1 2 3; do
    step "interleave_$i" "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
      --policy streaming_llm,inf_mllm_bias,keydiff --interleave --threads "$threads" --progress 50 \
      --json "$out/interleave_$i.json.tmp"
  done
}
interleave_gather() {  # the same with the cells moved together after each eviction (--gather-cells; alone on the machine)
  step interleave_plain_1 "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 \
    --block 128 --policy streaming_llm,inf_mllm_bias,keydiff --interleave --threads "$threads" --progress 50 \
    --json "$out/interleave_plain_1.json.tmp"  # the baseline on the gathered runs' machine
  for i in 1 2 3; do
    step "interleave_gather_$i" "$bin/infkv-stream" --model "$model" --text "$text" --tokens "$tokens" --budget 1024 \
      --block 128 --policy streaming_llm,inf_mllm_bias,keydiff --interleave --gather-cells --threads "$threads" \
      --progress 50 --json "$out/interleave_gather_$i.json.tmp"
  done
}
apart() {  # the decode loop again, one process per policy and run (the order turned): no in-process order effect
  local orders=("streaming_llm keydiff snapkv inf_mllm_bias" "inf_mllm_bias snapkv keydiff streaming_llm"
                "keydiff streaming_llm inf_mllm_bias snapkv") p
  for i in 1 2 3; do
    for p in ${orders[$((i - 1))]}; do
      step "apart_${i}_$p" "$bin/infkv-engine-bench" decode --model "$model" --text "$text" --history 256 --gen 8 \
        --warm 2048 --bounded-gen 512 --policy "$p" --threads "$threads" --json "$out/apart_${i}_$p.json.tmp"
    done
  done
}
placement() {  # where the freed cells lie, the same decode otherwise (alone on the machine)
  for i in 1 2; do
    step "placement_$i" "$bin/infkv-engine-bench" placement --model "$model" --text "$text" --budget 1024 --block 128 \
      --rounds 40 --seed $i --threads "$threads" --json "$out/placement_$i.json.tmp"
  done
}
memory() {  # bytes only (timings beside other work are not read)
  step memory_2k "$bin/infkv-stream" --model "$model" --text "$text" --tokens 2048 --budget 1024 --block 128 \
    --policy inf_mllm_bias,snapkv,keydiff,tova,expected_attention --threads "$threads" --json "$out/memory_2k.json.tmp"
  step memory_gather_4k "$bin/infkv-stream" --model "$model" --text "$text" --tokens 4000 --budget 1024 --block 128 \
    --policy inf_mllm_bias,keydiff --gather-cells --threads "$threads" --json "$out/memory_gather_4k.json.tmp"
}
engine() {
  local hist=2048 list=
  while (( hist <= history )); do list=${list:+$list,}$hist; hist=$((hist * 2)); done
  step decode "$bin/infkv-engine-bench" decode --model "$model" --text "$text" --history "$list" --threads "$threads" \
    --policy context_shift,streaming_llm,inf_mllm_bias,h2o --json "$out/decode.json.tmp"
  for n in 2048 4096 8192 16384; do
    step "prefill_plain_$n" "$bin/infkv-engine-bench" prefill --model "$model" --text "$text" --tokens $n --mode plain \
      --threads "$threads" --json "$out/prefill_plain_$n.json.tmp"
  done
  for n in 2048 4096 8192 16384 65536; do
    step "prefill_budgeted_$n" "$bin/infkv-engine-bench" prefill --model "$model" --text "$text" --tokens $n \
      --mode budgeted --policy snapkv --block 512 --threads "$threads" --json "$out/prefill_budgeted_$n.json.tmp"
  done
  step prefill_budgeted_b128_2048 "$bin/infkv-engine-bench" prefill --model "$model" --text "$text" --tokens 2048 \
    --mode budgeted --policy snapkv --block 128 --threads "$threads" --json "$out/prefill_budgeted_b128_2048.json.tmp"
}
kernels() {
  for o in 2 3; do  # the kernels as a user compiling at -O2 or -O3 gets them
    cmake -S . -B "build/bench-o$o" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O$o -DNDEBUG" \
      -DINFKV_ARCH_FLAGS=-march=x86-64-v3 -DINFKV_BUILD_TESTS=OFF -DINFKV_BUILD_EXAMPLES=OFF -DINFKV_BUILD_TOOLS=OFF \
      -DINFKV_BUILD_BENCH=ON -DINFKV_WITH_LLAMA_CPP=OFF -DINFKV_WITH_CUDA=OFF >/dev/null
    cmake --build "build/bench-o$o" --target infkv_bench >&2
  done
  local filter='BM_peak|BM_memcpy|BM_window_attention|BM_keydiff|BM_compact|BM_rerotate'
  for o in 3 2; do  # alone on the machine: the kernels are measured against ceilings of the same run
    step "kernels_o$o" "build/bench-o$o/bench/infkv_bench" "--benchmark_filter=$filter" --benchmark_min_time=0.2 \
      --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      "--benchmark_out=$out/kernels_o$o.json.tmp" --benchmark_out_format=json
  done
}
if [[ -n "${ONLY:-}" ]]; then
  for f in $ONLY; do "$f"; done
  python3 scripts/perf_report.py "$out" docs/performance.md
  exit 0
fi
observe
keys
loop
apart
placement
if [[ "${PARALLEL:-0}" == 1 ]]; then
  stream & pid=$!
  memory & pid2=$!
  engine
  wait $pid $pid2
else
  stream
  memory
  engine
fi
kernels
python3 scripts/perf_report.py "$out" docs/performance.md
