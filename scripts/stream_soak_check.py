#!/usr/bin/env python3
"""Checks an infkv-stream CSV for a soak: after the warm-up, the cache (slots, llama.cpp's K/V
state, the session's host copies) must stay constant, the process RSS must not grow by more
than --tolerance, and the time per block must not trend up (median of the last tenth of the
blocks within --time-ratio of the first tenth's). `full` and `recompute` runs are skipped. Prints one line per policy and, with --json,
writes the figures. Exit status 1 when a policy fails.

Usage: stream_soak_check.py CSV [--warmup 0.05] [--tolerance 0.05] [--time-ratio 2.0] [--json OUT]
       stream_soak_check.py --self-test   (a flat synthetic stream passes; growth in each column fails)"""
import argparse
import csv
import json
import statistics
import sys


def check(rows, warmup, tolerance, time_ratio):
    """Figures and problems of one policy's blocks (rows in block order)."""
    n = len(rows)
    start = max(1, int(n * warmup))
    # The warm-up also lasts until the cache is first full (the first eviction).
    first_evict = next((i for i, r in enumerate(rows) if int(r["evicted"]) > 0), n)
    start = max(start, first_evict + 1)
    if n - start < 20:
        return None, [f"only {n - start} blocks after the warm-up: stream longer"]
    steady = rows[start:]
    problems = []
    for col in ("slots", "slots_peak", "kv_state_bytes", "host_bytes"):
        vals = {int(r[col]) for r in steady[:-1]}  # the last block may be a partial one
        if len(vals) != 1:
            problems.append(f"{col} not constant after warm-up: {min(vals)}..{max(vals)}")
    rss0 = int(steady[0]["rss_bytes"])
    rss_max = max(int(r["rss_bytes"]) for r in steady)
    if rss_max > rss0 * (1 + tolerance):
        problems.append(f"RSS grew from {rss0 / 2**20:.1f} to {rss_max / 2**20:.1f} MiB (> {tolerance:.0%})")
    tenth = max(1, len(steady) // 10)
    t_first = statistics.median(float(r["seconds"]) for r in steady[:tenth])
    t_last = statistics.median(float(r["seconds"]) for r in steady[-tenth:])
    if t_last > t_first * time_ratio:
        problems.append(f"time per block rose from {t_first * 1e3:.0f} to {t_last * 1e3:.0f} ms (median of a tenth)")
    figures = {
        "blocks": n,
        "tokens": int(rows[-1]["tokens"]),
        "warmup_blocks": start,
        "slots": int(steady[0]["slots"]),
        "slots_peak": int(steady[0]["slots_peak"]),
        "kv_state_mib": int(steady[0]["kv_state_bytes"]) / 2**20,
        "host_mib": int(steady[0]["host_bytes"]) / 2**20,
        "rss_after_warmup_mib": rss0 / 2**20,
        "rss_max_mib": rss_max / 2**20,
        "block_ms_first_tenth": t_first * 1e3,
        "block_ms_last_tenth": t_last * 1e3,
        "ppl": float(rows[-1]["running_ppl"]),
    }
    return figures, problems


def self_test():
    """A flat synthetic stream passes; each kind of growth fails."""
    def stream(rss_growth=0, host_growth=0, time_growth=1.0, slots_jump=False):
        rows = []
        for b in range(400):
            full = b >= 9
            rows.append({"policy": "p", "tokens": str((b + 1) * 128), "evicted": "128" if full else "0",
                         "slots": str(1024 if full else (b + 1) * 128),
                         "slots_peak": str(1152 if full else (b + 1) * 128) if not (slots_jump and b == 300) else "1153",
                         "kv_state_bytes": "1000", "host_bytes": str(500 + (host_growth * b if full else 0)),
                         "rss_bytes": str(2**28 + rss_growth * b), "seconds": str(1.0 + (time_growth - 1.0) * b / 400),
                         "running_ppl": "10"})
        return rows
    cases = [("flat", stream(), True), ("RSS +10%", stream(rss_growth=2**28 // 4000), False),
             ("host copies grow", stream(host_growth=8), False), ("time x3", stream(time_growth=3.0), False),
             ("one block over the peak", stream(slots_jump=True), False)]
    bad = 0
    for name, rows, want in cases:
        _, problems = check(rows, 0.05, 0.05, 2.0)
        if (not problems) != want:
            print(f"self-test FAIL: {name}: problems {problems}, expected {'none' if want else 'some'}")
            bad += 1
    print(f"self-test: {len(cases) - bad} of {len(cases)} cases as expected")
    return 1 if bad else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--time-ratio", type=float, default=2.0)
    p.add_argument("--json")
    a = p.parse_args()
    by_policy = {}
    with open(a.csv, newline="") as f:
        for r in csv.DictReader(f):
            by_policy.setdefault(r["policy"], []).append(r)
    if not by_policy:
        print(f"stream_soak_check: {a.csv} has no blocks")
        return 1
    out, bad = {}, 0
    for policy, rows in by_policy.items():
        if policy in ("full", "recompute"):  # no bounded streaming cache to soak
            continue
        figures, problems = check(rows, a.warmup, a.tolerance, a.time_ratio)
        out[policy] = {"figures": figures, "problems": problems}
        if figures:
            print(f"{policy}: {figures['tokens']} tokens, {figures['blocks']} blocks; after warm-up: slots "
                  f"{figures['slots']} (peak {figures['slots_peak']}), K/V {figures['kv_state_mib']:.2f} MiB, "
                  f"host copies {figures['host_mib']:.2f} MiB, RSS {figures['rss_after_warmup_mib']:.1f} -> max "
                  f"{figures['rss_max_mib']:.1f} MiB, block {figures['block_ms_first_tenth']:.0f} -> "
                  f"{figures['block_ms_last_tenth']:.0f} ms (median of the first / last tenth), ppl {figures['ppl']:.3f}")
        for pr in problems:
            print(f"FAIL {policy}: {pr}")
        bad += bool(problems)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
