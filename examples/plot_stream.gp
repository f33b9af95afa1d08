# Plots infkv-stream's per-block CSV: perplexity over the last blocks (a moving average in the log
# domain, column window_ppl) against the tokens streamed, one line per policy. infkv-stream --plot
# runs this same script; by hand:
#   gnuplot -e "csv='stream.csv'; out='stream.png'" examples/plot_stream.gp
# Optional variables: policies (space-separated; default: every policy in the CSV, in order),
# title, budget (draws the first eviction point).
if (!exists("csv")) csv = 'stream.csv'
if (!exists("out")) out = 'stream.png'
if (!exists("title")) title = 'infkv-stream: perplexity while streaming'
if (!exists("policies")) policies = system("awk -F, 'NR > 1 && !seen[$1]++ { printf \"%s \", $1 }' '" . csv . "'")

set terminal pngcairo size 1280,720 noenhanced font ",12"
set output out
set datafile separator comma
set key outside right top box
set grid
set title title
set xlabel 'tokens streamed'
set ylabel 'perplexity (moving average over blocks, log scale)'
set logscale y
set format x '%.0s%c'
set mxtics 5
if (exists("budget") && budget > 0) set arrow from budget, graph 0 to budget, graph 1 nohead dashtype 2 lc rgb '#888888'
if (exists("budget") && budget > 0) set label 'budget' at budget, graph 0.97 offset 0.5, 0 tc rgb '#666666'

plot for [p in policies] csv using (strcol(1) eq p ? column('tokens') : NaN):(column('window_ppl')) \
     with lines linewidth 2 title p
