#!/usr/bin/env python3
"""Plots each policy's perplexity relative to a reference policy on the same blocks.

infkv-stream's per-block CSVs (several policies, concatenated) follow the text's difficulty: every
policy dips and peaks at the same places, and the differences between the leading policies vanish
under the lines. This divides them out: for every block both a policy and the reference predicted
(same last token, same count), the ratio of their block perplexities, smoothed as a moving average
of the log ratio over --smooth blocks, against the tokens streamed. 1.0 is the reference; 1.02 is
2% worse on those blocks. Prints each policy's ratio over all matched blocks (exp of the mean log
ratio, weighted by tokens). Writes a PNG with gnuplot.

    scripts/relative_plot.py ppl.csv --reference streaming_llm --out rel.png   # infkv-stream --csv files
"""
import argparse
import math
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="infkv-stream --csv output(s), concatenated")
    ap.add_argument("--reference", default="streaming_llm", help="policy the others are divided by")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--smooth", type=int, default=16, help="blocks in the moving average (log domain)")
    ap.add_argument("--title", default="", help="plot title")
    ap.add_argument("--exclude", action="append", default=[], help="policy to leave out (repeatable)")
    a = ap.parse_args()
    if a.smooth < 1:
        ap.error(f"--smooth = {a.smooth}: must be >= 1")

    with open(a.csv, newline="") as f:
        import csv
        rows = [r for r in csv.DictReader(f) if r["policy"] != "policy"]
    blocks = OrderedDict()  # policy -> {(tokens, scored): block_ppl}
    for r in rows:
        blocks.setdefault(r["policy"], {})[(int(r["tokens"]), int(r["scored"]))] = float(r["block_ppl"])
    if a.reference not in blocks:
        sys.exit(f"relative_plot: --reference = {a.reference}: not in {a.csv} (policies: {', '.join(blocks)})")
    ref = blocks[a.reference]
    series = OrderedDict()
    for name, b in blocks.items():
        if name == a.reference or name in a.exclude:
            continue
        keys = sorted(k for k in b if k in ref and k[1] > 0)
        if len(keys) < 2:
            continue
        logs = [math.log(b[k] / ref[k]) for k in keys]
        total = sum(l * k[1] for l, k in zip(logs, keys)) / sum(k[1] for k in keys)
        print(f"{name:<20} {len(keys):6d} blocks  ratio {math.exp(total):.4f}")
        pts, start = [], 0  # the moving average restarts where the matched blocks jump (slices)
        for i, k in enumerate(keys):
            if i > 0 and k[0] - keys[i - 1][0] > 2 * (k[1] + 1):
                start = i
                pts.append(None)
            lo = max(start, i - a.smooth + 1)
            pts.append((k[0] / 1000.0, math.exp(sum(logs[lo:i + 1]) / (i + 1 - lo))))
        series[name] = pts
    if not series:
        sys.exit(f"relative_plot: no policy shares blocks with {a.reference}")

    with tempfile.TemporaryDirectory() as tmp:
        plots = []
        for i, (name, pts) in enumerate(series.items()):
            path = os.path.join(tmp, f"{i}.dat")
            with open(path, "w") as f:
                f.writelines("\n" if p is None else f"{p[0]} {p[1]}\n" for p in pts)
            plots.append(f"'{path}' using 1:2 with lines lt {i + 1} title '{name}'")
        title = a.title or f"perplexity relative to {a.reference} on the same blocks (moving average over {a.smooth} blocks)"
        script = f"""
set terminal pngcairo size 1280,720 noenhanced font ",12"
set output '{a.out}'
set key outside right top box
set grid
set title '{title}'
set xlabel 'tokens streamed (thousands)'
set ylabel 'block perplexity / {a.reference}'
array colours[12] = ['#e41a1c', '#377eb8', '#4daf4a', '#984ea3', '#ff7f00', '#a65628', '#f781bf', '#17becf', '#999999', '#bcbd22', '#1f3a93', '#000000']
do for [i = 1:12] {{ dash = i > 6 ? 2 : 1; set linetype i linecolor rgb colours[i] linewidth 2 dashtype dash }}
set arrow from graph 0, first 1 to graph 1, first 1 nohead lc rgb '#000000' lw 1
plot {', '.join(plots)}
"""
        try:
            subprocess.run(["gnuplot"], input=script, text=True, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"relative_plot: --out = {a.out}: gnuplot failed ({e}); install gnuplot-nox")
    return 0


if __name__ == "__main__":
    sys.exit(main())
