#!/usr/bin/env bash
# The soak: TOKENS (default 10M) synthetic tokens through the core for every evicting policy
# (infkv-soak), then a plot of RSS and eviction time against tokens (gnuplot). Writes OUT_DIR/soak.csv,
# soak.json and soak.png (default bench/results/soak). Run on an idle machine: a few minutes per
# million tokens over all policies on one core.
#   scripts/soak.sh [TOKENS] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens=${1:-10000000}
out=${2:-bench/results/soak}
mkdir -p "$out"
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target infkv_soak
build/release/tools/infkv-soak --tokens "$tokens" --csv "$out/soak.csv" --json "$out/soak.json" --sample-every 256 | tee "$out/soak.txt"
policies=$(tail -n +2 "$out/soak.csv" | cut -d, -f1 | uniq | tr '\n' ' ')
gnuplot <<GP
set datafile separator ','
set terminal pngcairo size 1000,800 font ',10' noenhanced
set output '$out/soak.png'
set multiplot layout 2,1 title "infkv-soak: $tokens tokens, budget 1024, block 128, 2 KV heads x 3, d 64, f16 (one process, policies in turn)"
set key outside right
set ylabel 'process RSS (MiB)'
set yrange [0:*]
plot for [p in "$policies"] '$out/soak.csv' using (\$2/1e6):(strcol(1) eq p ? \$4/1048576 : 1/0) with lines title p
set ylabel 'eviction time (us, one sample)'
set xlabel 'tokens streamed (millions)'
set logscale y
set yrange [*:*]
plot for [p in "$policies"] '$out/soak.csv' using (\$2/1e6):(strcol(1) eq p ? \$5 : 1/0) with lines title p
unset multiplot
GP
echo "soak: $out/soak.png"
