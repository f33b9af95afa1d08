#!/usr/bin/env bash
# The report of scripts/soak_llama.sh from OUT_DIR/soak_llama.csv: scripts/stream_soak_check.py
# (appended to soak_llama.txt, figures in soak_llama_check.json; its exit status is this script's)
# and the plot soak_llama.png (gnuplot: RSS, cached tokens, block perplexity, block time). POLICY, TOKENS and THREADS only label the plot.
#   scripts/soak_llama_report.sh OUT_DIR POLICY TOKENS THREADS
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1 policy=$2 tokens=$3 threads=$4
status=0
python3 scripts/stream_soak_check.py "$out/soak_llama.csv" --json "$out/soak_llama_check.json" \
  | tee -a "$out/soak_llama.txt" || status=$?
gnuplot <<GP
set datafile separator ','
set terminal pngcairo size 1000,1200 font ',10' noenhanced
set output '$out/soak_llama.png'
set multiplot layout 4,1 title "infkv-stream soak: $policy, SmolLM2-135M on KJV, $tokens tokens, cache 1024 + block 128, $threads threads"
set key off
set ylabel 'process RSS (MiB)'
set yrange [0:*]
plot '$out/soak_llama.csv' using (\$3/1e6):(\$14/1048576) with lines
set key bottom right
set ylabel 'cached tokens'
set yrange [0:1300]
plot '$out/soak_llama.csv' using (\$3/1e6):8 with lines title 'after decoding the block', \
     '' using (\$3/1e6):9 with lines title 'after the eviction'
set key top left
set ylabel 'perplexity of the block'
set logscale y
set yrange [*:*]
plot '$out/soak_llama.csv' using (\$3/1e6):5 with points pt 7 ps 0.15 title 'one block', \
     '' using (\$3/1e6):5 smooth bezier with lines lw 2 title 'smoothed'
unset logscale y
set key top right
set ylabel 'seconds per block of 128'
set xlabel 'tokens streamed (millions)'
set yrange [0:*]
plot '$out/soak_llama.csv' using (\$3/1e6):15 with points pt 7 ps 0.15 title 'one block', \
     '' using (\$3/1e6):15 smooth bezier with lines lw 2 title 'smoothed'
unset multiplot
GP
echo "soak: $out/soak_llama.png"
exit $status
