#!/usr/bin/env bash
# The llama.cpp soak: TOKENS (default 1M) of the KJV text through SmolLM2-135M with a cache
# bounded to 1024 + 128 cells, evicted by POLICY (default inf_mllm_bias) after every block
# (infkv-stream, THREADS threads, default 2), then the check of scripts/stream_soak_check.py
# (cache, host copies and RSS flat after warm-up, time per block without a trend) and a plot of
# RSS, cached slots and time per block against tokens (gnuplot). Writes OUT_DIR/soak_llama.csv,
# .json, .txt, _check.json and .png (default bench/results/soak). About 2 hours per million
# tokens with 2 threads on a 2-core machine.
#   scripts/soak_llama.sh [TOKENS] [OUT_DIR] [POLICY] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-1000000}
out=${2:-bench/results/soak}
policy=${3:-inf_mllm_bias}
threads=${4:-2}
mkdir -p "$out"
scripts/setup.sh
prefix=$(scripts/llama_cpp.sh | tail -1)
model=$(scripts/model.sh | tail -1)
text=$(scripts/kjv.sh | tail -1)
cmake --preset release -DINFKV_WITH_LLAMA_CPP=ON -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build --preset release --target infkv_stream
build/release/examples/infkv-stream --model "$model" --text "$text" --tokens "$tokens" --budget 1024 --block 128 \
  --policy "$policy" --threads "$threads" --progress 100 --csv "$out/soak_llama.csv" --json "$out/soak_llama.json" \
  | tee "$out/soak_llama.txt"
status=0
python3 scripts/stream_soak_check.py "$out/soak_llama.csv" --json "$out/soak_llama_check.json" \
  | tee -a "$out/soak_llama.txt" || status=$?
gnuplot <<GP
set datafile separator ','
set terminal pngcairo size 1000,900 font ',10' noenhanced
set output '$out/soak_llama.png'
set multiplot layout 3,1 title "infkv-stream soak: $policy, SmolLM2-135M on KJV, $tokens tokens, cache 1024 + block 128, $threads threads"
set key off
set ylabel 'process RSS (MiB)'
set yrange [0:*]
plot '$out/soak_llama.csv' using (\$3/1e6):(\$14/1048576) with lines
set key bottom right
set ylabel 'cached tokens'
set yrange [0:1300]
plot '$out/soak_llama.csv' using (\$3/1e6):8 with lines title 'after decoding the block', \
     '' using (\$3/1e6):9 with lines title 'after the eviction'
set ylabel 'seconds per block of 128'
set xlabel 'tokens streamed (millions)'
set yrange [0:*]
plot '$out/soak_llama.csv' using (\$3/1e6):15 with points pt 7 ps 0.15 title 'one block', \
     '' using (\$3/1e6):15 smooth bezier with lines lw 2 title 'smoothed'
unset multiplot
GP
echo "soak: $out/soak_llama.png"
exit $status
