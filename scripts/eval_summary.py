#!/usr/bin/env python3
"""Summarises infkv-stream per-block CSVs (several policies, concatenated) as the markdown table of
docs/evaluation.md: perplexity over all blocks, over the first and last 10% of the blocks after
warm-up, and, where a reference policy (default: recompute, the sliding window with recompute) ran
on slices of the same text, each policy's perplexity on exactly the reference's blocks divided by
the reference's.

    scripts/eval_summary.py docs/evaluation/kjv200k.csv [--reference recompute] [--warmup 1152]
"""
import argparse
import csv
import math
import sys
from collections import OrderedDict


def ppl(rows):
    nll = sum(float(r["nll"]) for r in rows)
    n = sum(int(r["scored"]) for r in rows)
    return math.exp(nll / n) if n else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="infkv-stream --csv output(s), concatenated (one header or many)")
    ap.add_argument("--reference", default="recompute", help="policy whose blocks define the matched slices")
    ap.add_argument("--warmup", type=int, default=1152,
                    help="blocks ending at or before this many tokens after a stream's start are warm-up")
    a = ap.parse_args()

    runs = OrderedDict()
    with open(a.csv, newline="") as f:
        for r in csv.DictReader(f):
            if r["policy"] == "policy":
                continue  # a repeated header
            # infkv-stream writes block_ppl = exp(nll / scored); recover nll per block.
            r["nll"] = math.log(float(r["block_ppl"])) * int(r["scored"]) if int(r["scored"]) else 0.0
            runs.setdefault(r["policy"], []).append(r)

    # Slices of the reference: runs of consecutive blocks (a slice starts where block 0 restarts;
    # its first block predicts all its tokens but the first). Warm-up blocks are left out.
    ref_slices = []
    for r in runs.get(a.reference, []):
        if r["block"] == "0" or not ref_slices:
            ref_slices.append((int(r["tokens"]) - int(r["scored"]) - 1, []))
        ref_slices[-1][1].append(r)
    ref_slices = [[r for r in rows if int(r["tokens"]) - start > a.warmup] for start, rows in ref_slices]
    ref_slices = [s for s in ref_slices if s]

    head = "| policy | tokens | PPL | early PPL | late PPL | late / early |"
    sep = "|---|---|---|---|---|---|"
    for s in ref_slices:
        lo = int(s[0]["tokens"]) - int(s[0]["scored"])
        head += f" vs {a.reference}, tokens {lo / 1000:.1f}K-{int(s[-1]['tokens']) / 1000:.1f}K |"
        sep += "---|"
    print(head)
    print(sep)
    for name, rows in runs.items():
        warm = [r for r in rows if int(r["tokens"]) > a.warmup]
        tenth = max(1, len(warm) // 10)
        early, late = ppl(warm[:tenth]), ppl(warm[-tenth:])
        line = f"| {name} | {rows[-1]['tokens']} | {ppl(rows):.3f} | {early:.3f} | {late:.3f} | {late / early:.2f} |"
        by_tokens = {r["tokens"]: r for r in rows}
        for s in ref_slices:
            mine = [by_tokens.get(r["tokens"]) for r in s]
            if any(m is None for m in mine):
                line += " |"
            else:
                line += f" {ppl(mine) / ppl(s):.3f} |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
