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
set xlabel 'tokens streamed (thousands)'
set ylabel 'perplexity (moving average over blocks, log scale)'
set logscale y
set format x '%g'
set mxtics 5
if (exists("budget") && budget > 0) set arrow from budget / 1000.0, graph 0 to budget / 1000.0, graph 1 nohead dashtype 2 lc rgb '#888888'
if (exists("budget") && budget > 0) set label 'budget' at budget / 1000.0, graph 0.97 offset 0.5, 0 tc rgb '#666666'

# Twelve distinct colours; policies past the sixth are dashed, so that no two lines look alike.
array colours[12] = ['#000000', '#e41a1c', '#377eb8', '#4daf4a', '#984ea3', '#ff7f00', \
                     '#a65628', '#f781bf', '#17becf', '#999999', '#bcbd22', '#1f3a93']
do for [i = 1:12] { dash = i > 6 ? 2 : 1; set linetype i linecolor rgb colours[i] linewidth 2 dashtype dash }

plot for [i = 1:words(policies)] csv \
     using (strcol(1) eq word(policies, i) ? column('tokens') / 1000.0 : NaN):(column('window_ppl')) \
     with lines linetype i title word(policies, i)
