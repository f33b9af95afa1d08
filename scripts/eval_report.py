#!/usr/bin/env python3
"""Writes the generated tables of docs/evaluation.md (or another DOC, e.g. docs/multimodal.md) from
the committed data they cite.

  scripts/eval_report.py [--check] [DOC (docs/evaluation.md)]

A generated table stands between the lines
    <!-- eval_report: GENERATOR DATA -->      and      <!-- /eval_report -->
where DATA is a CSV beside the document (e.g. evaluation/needles_v2_policies.csv) with its record
DATA.json (commit, program version, models and text with their SHA-256, protocol, command: what
scripts/eval_sweep.py writes). The script replaces what lies between the lines, table and the
provenance line under it, by what the data gives; --check only compares and fails naming the
tables that differ, so a table cannot drift from its data (a ctest runs it). The prose around the
tables is written for the committed data: rerun, then reread it.

Generators:
  needles_full      the full cache per model, --people and seed: forced choice and greedy
                    successes with their 95% Wilson intervals, and how many misses are bound to
                    another person's value of the kind
  needles_policies  per model, distance and policy, pooled over the seeds: forced-choice and
                    greedy successes, the share of the full cache's forced successes kept (when
                    the data has a full cache), each with a 95% Wilson interval, the per-seed
                    forced successes and the statement tokens still cached at the question
  ppl_slices        per model and policy, perplexity on disjoint slices of the text and its ratio
                    to StreamingLLM's on the same blocks, with the 95% t-interval over the
                    slices' tenths (batch means) and each slice's ratio
  trace_policies    infkv-compare's JSON (--json, with scripts/provenance.py's record): attention
                    mass kept and output error per policy and budget on the recorded trace
  video_memory      infkv-video's frame records (eval_sweep.py video): per policy, slots held,
                    K/V in use and RSS after 10, 50, 100, 200 frames
  video_facts       infkv-video's answers (DATA_answers.csv): per policy and further frames, the
                    facts' forced-choice and greedy successes with 95% Wilson intervals
  needles_cached    per model, pooled over the evicting policies: of the full cache's forced
                    successes (every question, without a full cache), those a policy keeps, by
                    the share of the statement it held (none, under half, half or more, all)
  targets           DATA is PPL.csv+NEEDLES.csv, a perplexity and a needle sweep: per model and
                    policy run in both, the perplexity ratio to StreamingLLM and the share of the
                    full cache's forced successes kept, each with its interval and whether it
                    meets its target (interval <= 1.01; >= 90%)
  kvpress_prefill   scripts/kvpress_side_by_side.py's JSON (bench/results/python): per press and
                    ratio, perplexity, NLL difference from the full cache (paired bootstrap
                    interval), needle successes (Wilson intervals)
  kvpress_decoding  its --decoding JSONs (A.json+B.json): per press, perplexity, NLL difference over
                    64-token blocks (bootstrap interval), slots at the end
  prefill_memory    scripts/prefill_memory.py's JSON: cache bytes and resident-set growth of plain
                    and block-wise prefill per prompt length
  peers_single_turn DATA is A.json+B.json+C.csv: scripts/peers_single_turn.py's JSONs (OpenVINO GenAI,
                    kvpress) beside infkv-stream's single-turn sweeps on the same questions: per
                    budget and setting, answers, the full cache's kept, KV held, tokens/s
  needles_archive   a needle sweep with an archive: per model, distance and policy, the statement
                    tokens cached before and after the recall, the recall's seconds per question
                    (mean and largest) and the largest share of the stream's own decoding so far
                    they cost, and the bytes held at the questions (archive pages + the cache's
                    slots in f16) as a share of every token's K and V in f16 (lowest and highest)
"""
import argparse
import csv
import difflib
import json
import math
import os
import random
import re
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_summary import batch_logs, rate, t_interval  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}
BEGIN = re.compile(r"^<!-- eval_report: (\S+) (\S+) -->$")
END = "<!-- /eval_report -->"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def load(doc_dir, data):
    """A CSV and its record DATA.json (scripts/eval_sweep.py), or a JSON result with its
    "provenance" (scripts/provenance.py). DATA#A,B keeps only the CSV rows of policies A and B, or
    the JSON records of settings A and B (a setting's blanks written as _)."""
    data, _, only = data.partition("#")
    rows, record = load_all(doc_dir, data)
    if not only:
        return rows, record
    keep = set(only.split(","))
    if isinstance(rows, dict):
        return dict(rows, records=[r for r in rows["records"] if r["setting"].replace(" ", "_") in keep]), record
    return [r for r in rows if r["policy"] in keep], record


def load_all(doc_dir, data):
    path = os.path.join(doc_dir, data)
    # eval_sweep's video answers (X_answers.csv) are recorded in the sweep's X.json
    record_path = path if data.endswith(".json") else os.path.splitext(path)[0].removesuffix("_answers") + ".json"
    for p in {path, record_path}:
        if not os.path.exists(p):
            sys.exit(f"eval_report: {data}: no {p} (a marker names data that is not committed)")
    with open(record_path) as f:
        record = json.load(f)
    if data.endswith(".json"):  # scripts/provenance.py's record, or the Python benchmarks' own fields
        return record, record.get("provenance", record)
    with open(path, newline="") as f:
        return list(csv.DictReader(f)), record


def provenance(data, record):
    if "command" not in record and "program" in record:  # bench/results/python: the script's own fields
        versions = ", ".join(f"{k} {record[k]}" for k in ("kvpress", "torch", "transformers") if k in record)
        return ["", f"Data: [{data}]({data}): commit {record['commit'][:7]}, made by `{record['program']}`; model "
                    f"{record['model']}; {versions}."]
    if "models" not in record:  # a JSON result: its own provenance record
        return ["", f"Data: [{data}]({data}) with its provenance: commit {record['commit'][:7]}"
                    f"{' (uncommitted changes)' if record['dirty'] else ''}, made by `{record['command']}`."]
    models = ", ".join(f"{m['file']} (SHA-256 {m['sha256'][:12]})" for m in record["models"].values())
    source = "media" if "media" in record else "text"
    projectors = "".join(f"; projector {p['file']} (SHA-256 {p['sha256'][:12]})"
                         for p in record["protocol"].get("projectors", {}).values())
    rec = os.path.splitext(data)[0].removesuffix("_answers") + ".json"
    return [
        "",
        f"Data: [{data}]({data}) with [{rec}]({rec}): "
        f"commit {record['commit'][:7]}, {record['program']}"
        + (f", needle protocol {record['protocol']['needle_protocol']}" if "needle_protocol" in record["protocol"] else "")
        + f"; {models}{projectors}; {source} {record[source]['file']} (SHA-256 "
        f"{record[source]['sha256'][:12]}); made by `{record['command']}`.",
    ]


def bound(rows, r):
    """Whether a forced-choice miss chose another person's value of the same kind in the stream."""
    same = {o["needle"] for o in rows if o["model"] == r["model"] and o["people"] == r["people"]
            and o["seed"] == r["seed"] and o["policy"] == r["policy"] and o["stream"] == r["stream"]
            and o["kind"] == r["kind"] and o["person"] != r["person"]}
    return r["best_other"] in same


def needles_full(rows, record):
    groups = OrderedDict()
    for r in rows:
        if r["policy"] == "full":
            groups.setdefault((r["model"], r["people"], r["seed"]), []).append(r)
    out = []
    for (model, people, seed), g in groups.items():
        n = len(g)
        forced = sum(int(r["forced_success"]) for r in g)
        greedy = sum(int(r["success"]) for r in g)
        misses = [r for r in g if r["forced_success"] == "0"]
        name = MODEL_NAMES.get(model, model) + (f", `--people {people}`" if people != "3" else "")
        out.append([name, seed, rate(forced, n), rate(greedy, n),
                    f"{sum(bound(rows, r) for r in misses)}/{len(misses)}" if people != "1" else "-"])
    return table(["model", "seed", "forced choice (95% interval)", "greedy (95% interval)",
                  "misses bound to another person"], out)


def full_successes(rows):
    """The questions the full cache answers by forced choice, as (seed, trial, distance)."""
    return {(r["seed"], r["trial"], r["distance"]) for r in rows if r["policy"] == "full" and r["forced_success"] == "1"}


def statement_share(r):
    """The share of a needle's statement tokens still cached at its question."""
    return int(r["key_kept"]) / int(r["key_tokens"])


def needle_stats(rows):
    """Per model, per policy run on every seed (in the CSV's order): the questions, forced and
    greedy successes, the forced successes among the questions the full cache answers by forced
    choice and how many those are, the forced successes per seed, the mean share of the
    statement's tokens cached at the question."""
    out = OrderedDict()
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        seeds = sorted({int(r["seed"]) for r in mine})
        full_ok = full_successes(mine)
        out[model] = OrderedDict()
        for policy in OrderedDict.fromkeys(r["policy"] for r in mine):
            g = [r for r in mine if r["policy"] == policy]
            by_seed = {s: [r for r in g if int(r["seed"]) == s] for s in seeds}
            if any(not v for v in by_seed.values()):
                continue  # a policy not yet run on every seed is left out of the pooled table
            kept = [r for r in g if (r["seed"], r["trial"], r["distance"]) in full_ok]
            out[model][policy] = {
                "n": len(g), "forced": sum(int(r["forced_success"]) for r in g),
                "greedy": sum(int(r["success"]) for r in g),
                "kept": sum(int(r["forced_success"]) for r in kept), "kept_of": len(kept),
                "per_seed": [sum(int(r["forced_success"]) for r in by_seed[s]) for s in seeds],
                "cached": sum(statement_share(r) for r in g) / len(g)}
    return out


def needles_policies(rows, record):
    """Per model and distance (needle_stats): one table of every policy run on every seed. Without
    a full cache in the data (a distance beyond a model's trained context) the column of the full
    cache's forced successes is left out."""
    out_lines = []
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        for distance in sorted({int(r["distance"]) for r in rows if r["model"] == model}):
            mine = [r for r in rows if r["model"] == model and int(r["distance"]) == distance]
            stats = needle_stats(mine)[model]
            has_full = "full" in stats
            body = [[f"`{policy}`", rate(v["forced"], v["n"]), rate(v["greedy"], v["n"])] +
                    ([rate(v["kept"], v["kept_of"]) if policy != "full" else "-"] if has_full else []) +
                    [", ".join(str(x) for x in v["per_seed"]), f"{100 * v['cached']:.0f}%"]
                    for policy, v in stats.items()]
            body.sort(key=lambda b: (b[0] != "`full`", -int(b[1].split("/")[0])))
            seeds = sorted({int(r["seed"]) for r in mine})
            first = [r for r in mine if r["policy"] == next(iter(stats))]
            per_seed = len([r for r in first if int(r["seed"]) == seeds[0]])
            # a guess uniform over the kind's candidates ranks the true value first with 1 / candidates
            chance = sum(1 / int(r["candidates"]) for r in first)
            contiguous = seeds == list(range(seeds[0], seeds[-1] + 1))
            which = (f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}" if contiguous
                     else "seeds " + ", ".join(str(x) for x in seeds))
            out_lines += [f"**{MODEL_NAMES.get(model, model)}**, {which} "
                          f"({per_seed} questions per seed, distance {distance}; a uniform guess among the "
                          f"candidates would be chosen right in {chance:.1f} of the {len(first)} questions"
                          f"{'' if has_full else '; the full cache was not run'}):", ""]
            out_lines += table(["policy", "forced choice", "greedy"] +
                               (["of the full cache's forced successes"] if has_full else []) +
                               ["forced, per seed", "statement tokens cached"], body)
            out_lines.append("")
    return out_lines[:-1]


def needles_cached(rows, record):
    """Per model, pooled over the evicting policies and seeds: of the questions the full cache
    answers by forced choice (every question where the data has no full cache), how many each
    policy answers too, by how much of the needle's statement it still held at the question (none,
    under half, half or more, all of its tokens)."""
    bins = ["none", "under half", "half or more", "all"]
    body = []
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        full_ok = full_successes(mine)
        has_full = any(r["policy"] == "full" for r in mine)
        got = {b: [0, 0] for b in bins}
        for r in mine:
            if r["policy"] == "full" or (has_full and (r["seed"], r["trial"], r["distance"]) not in full_ok):
                continue
            share = statement_share(r)
            b = bins[0] if share == 0 else bins[3] if share == 1 else bins[1] if share < 0.5 else bins[2]
            got[b][0] += int(r["forced_success"])
            got[b][1] += 1
        policies = len({r["policy"] for r in mine} - {"full"})
        body.append([f"{MODEL_NAMES.get(model, model)} ({policies} policies"
                     f"{'' if has_full else ', every question: no full cache'})"] +
                    [rate(*got[b]) if got[b][1] else "-" for b in bins])
    return table(["model"] + [f"statement cached: {b}" for b in bins], body)


def ppl_stats(rows, reference="streaming_llm", warmup=1152, batches=10):
    """Per model, per policy run on every slice: perplexity over every slice, and its ratio to the
    reference's on the same blocks after warm-up (blocks ending more than `warmup` tokens into the
    slice), over all slices, with the 95% t-interval over the slices' tenths (each slice cut into
    `batches` contiguous batches: batch_logs), and each slice's own ratio (the reference: its
    perplexity only)."""
    out = OrderedDict()
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        skips = sorted({int(r["skip"]) for r in mine})
        runs = OrderedDict()
        for r in mine:
            nll = math.log(float(r["block_ppl"])) * int(r["scored"])
            runs.setdefault(r["policy"], {}).setdefault(int(r["skip"]), {})[int(r["tokens"])] = (nll, int(r["scored"]))
        ref = runs[reference]
        out[model] = OrderedDict()
        for policy, by_skip in runs.items():
            if sorted(by_skip) != skips:
                continue  # not yet run on every slice
            logs, a, b, n, per_slice, all_nll, all_n = [], [], [], [], [], 0.0, 0
            for k in skips:
                blocks = by_skip[k]
                all_nll += sum(v[0] for v in blocks.values())
                all_n += sum(v[1] for v in blocks.values())
                common = [t for t in sorted(ref[k]) if t - k > warmup and t in blocks and blocks[t][1] == ref[k][t][1]]
                sa, sb, sn = ([blocks[t][0] for t in common], [ref[k][t][0] for t in common],
                              [blocks[t][1] for t in common])
                a += sa
                b += sb
                n += sn
                logs += batch_logs(sa, sb, sn, batches)
                per_slice.append(math.exp((sum(sa) - sum(sb)) / sum(sn)))
            v = {"ppl": math.exp(all_nll / all_n)}
            if policy != reference:
                v.update(ratio=math.exp((sum(a) - sum(b)) / sum(n)), interval=t_interval(logs), per_slice=per_slice)
            out[model][policy] = v
    return out


def ppl_slices(rows, record, reference="streaming_llm"):
    """Per model and policy (ppl_stats): perplexity over every slice, the ratio to the reference's
    with its 95% interval, each slice's ratio."""
    out_lines = []
    for model, stats in ppl_stats(rows, reference).items():
        body = []
        for policy, v in stats.items():
            row = [f"`{policy}`", f"{v['ppl']:.3f}"]
            if "ratio" not in v:
                row += ["1", "-", "-"]
            else:
                row += [f"{v['ratio']:.4f}", f"{v['interval'][0]:.4f}-{v['interval'][1]:.4f}",
                        ", ".join(f"{x:.3f}" for x in v["per_slice"])]
            body.append(row)
        body.sort(key=lambda r: float(r[2]))
        skips = sorted({int(r["skip"]) for r in rows if r["model"] == model})
        tokens = record["protocol"].get("tokens")
        out_lines += [f"**{MODEL_NAMES.get(model, model)}**, {len(skips)} slices of {tokens} tokens starting at token "
                      f"{', '.join(f'{k:,}' for k in skips)}:", ""]
        out_lines += table(["policy", "PPL", f"vs {reference}", "95% interval", "per slice"], body)
        out_lines.append("")
    return out_lines[:-1]


def targets(data, records, ppl_bound=1.01, kept_share=0.9):
    """A perplexity sweep and a needle sweep (DATA: PPL.csv+NEEDLES.csv) side by side, per model
    and policy run in both: the perplexity ratio to StreamingLLM with its interval, and the share
    of the full cache's forced successes kept with its Wilson interval, each against its target
    (the ratio's interval at most `ppl_bound`; at least `kept_share` of the full cache's)."""
    ppl, needles = ppl_stats(data[0]), needle_stats(data[1])
    out_lines = []
    for model in ppl:
        body = []
        for policy, v in ppl[model].items():
            k = needles.get(model, {}).get(policy)
            if "ratio" not in v or k is None:
                continue
            lo, hi = v["interval"]
            body.append([f"`{policy}`", f"{v['ratio']:.4f} ({lo:.4f}-{hi:.4f})", "met" if hi <= ppl_bound else "not met",
                         rate(k["kept"], k["kept_of"]), "met" if k["kept"] >= kept_share * k["kept_of"] else "not met",
                         f"{100 * k['cached']:.0f}%"])
        full = needles[model].get("full")
        out_lines += [f"**{MODEL_NAMES.get(model, model)}** (the full cache answers {full['forced']} of {full['n']} "
                      f"questions by forced choice):" if full else f"**{MODEL_NAMES.get(model, model)}**:", ""]
        out_lines += table(["policy", "PPL vs streaming_llm (95% interval)", f"interval <= {ppl_bound}",
                            "of the full cache's forced successes", f">= {kept_share:.0%}", "statement tokens cached"],
                           body)
        out_lines.append("")
    return out_lines[:-1]


def trace_policies(j, record):
    """infkv-compare's JSON: per policy and budget, the attention mass kept and the output error,
    mean over the recorded layers and evictions; the best of each column in bold."""
    budgets = sorted({r["budget"] for r in j["results"]})
    cell = {(r["policy"], r["budget"]): (r["mass_kept"]["mean"], r["output_rel_error"]["mean"]) for r in j["results"]}
    policies = list(OrderedDict.fromkeys(r["policy"] for r in j["results"]))
    best = {b: (max(cell[p, b][0] for p in policies), min(cell[p, b][1] for p in policies)) for b in budgets}

    def show(v, top):
        return f"**{v:.3f}**" if f"{v:.3f}" == f"{top:.3f}" else f"{v:.3f}"
    head = ["policy"] + [f"{b}: {w}" for b in budgets for w in ("mass", "err")]
    return table(head, [[f"`{p}`"] + [show(cell[p, b][i], best[b][i]) for b in budgets for i in (0, 1)] for p in policies])


def video_memory(rows, record, at=(10, 50, 100, 200)):
    """infkv-video's frame records of the first seed: per policy, the cache's slots, llama.cpp's K/V
    of the cells in use and the process RSS after `at` frames, and the most slots held."""
    seed = min(r["seed"] for r in rows)
    mine = [r for r in rows if r["seed"] == seed]
    policies = list(OrderedDict.fromkeys(r["policy"] for r in mine))

    def cells(policy, col, scale=1.0, fmt="{:.0f}"):
        got = {int(r["frame"]): r for r in mine if r["policy"] == policy}
        return " / ".join(fmt.format(int(got[f][col]) / scale) if f in got else "-" for f in at)
    inputs = {int(r["frame"]): r["input"] for r in mine}
    body = [[f"`{p}`", cells(p, "held"), max(int(r["peak"]) for r in mine if r["policy"] == p),
             cells(p, "kv_state_bytes", 1 << 20, "{:.1f}"), cells(p, "rss_bytes", 1 << 20)] for p in policies]
    frames = " / ".join(str(f) for f in at)
    return [f"Tokens streamed after {frames} frames: {' / '.join(inputs.get(f, '-') for f in at)} (seed {seed}).", ""] + \
        table(["policy", f"slots held after {frames} frames", "most slots held",
               "K/V in use, MiB", "process RSS, MiB"], body)


def video_facts(rows, record):
    """infkv-video's answers (DATA_answers.csv beside DATA.csv), pooled over the seeds: per policy
    and number of further frames, forced-choice and greedy successes, the share of the full
    cache's forced successes kept (95% Wilson intervals), and the facts' statements still cached."""
    seeds = sorted({int(r["seed"]) for r in rows})
    full_ok = {(r["seed"], r["after"], r["fact"]) for r in rows if r["policy"] == "full" and r["forced_success"] == "1"}
    body = []
    for policy in OrderedDict.fromkeys(r["policy"] for r in rows):
        for after in sorted({int(r["after"]) for r in rows}):
            g = [r for r in rows if r["policy"] == policy and int(r["after"]) == after]
            if {int(r["seed"]) for r in g} != set(seeds):
                continue  # a policy not yet run on every seed is left out of the pooled table
            kept = [r for r in g if (r["seed"], r["after"], r["fact"]) in full_ok]
            whole = sum(r["statement_cached"] == r["statement_tokens"] for r in g)
            body.append([f"`{policy}`", after, rate(sum(int(r["forced_success"]) for r in g), len(g)),
                         rate(sum(int(r["forced_success"]) for r in kept), len(kept)) if policy != "full" else "-",
                         rate(sum(int(r["greedy_success"]) for r in g), len(g)), f"{whole}/{len(g)}"])
    n = len([r for r in rows if r["policy"] == body[0][0].strip("`") and int(r["after"]) == body[0][1]])
    which = f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    return [f"{which}, {n} questions per policy and distance; a uniform guess among the 8 candidates of a fact "
            f"would be right in {n / 8:.1f} of them.", ""] + \
        table(["policy", "further frames", "forced choice", "of the full cache's forced successes", "greedy",
               "statements cached whole"], body)


def bootstrap_mean(xs, reps=2000, seed=0):
    """The 95% percentile-bootstrap interval of the mean of xs (a fixed seed: the table is
    reproducible)."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(reps))
    return [means[int(0.025 * reps)], means[int(0.975 * reps) - 1]]


def kvpress_prefill(j, record):
    """scripts/kvpress_side_by_side.py's JSON: per press and compression ratio the perplexity (exp
    of the mean NLL over the samples), the mean NLL difference from the full cache on the same
    samples with its paired bootstrap 95% interval, and the needle's forced-choice and greedy
    successes with their 95% Wilson intervals."""
    ratios, res = j["ratios"], j["results"]
    full = res["full"]
    n = len(full["forced"])
    head = ["press"] + [x for r in ratios for x in (f"{1 - r:.0%} kept: PPL (dNLL vs full [95%])",
                                                    "needle forced, greedy")]
    body = [["full cache", f"{full['ppl_mean_nll']:.3f}", f"{rate(sum(full['forced']), n)}, "
             f"{rate(sum(full['greedy']), n)}"] + [""] * (2 * len(ratios) - 2)]

    def cells(r):
        dd = [a - b for a, b in zip(r["nll"], full["nll"])]
        lo, hi = bootstrap_mean(dd)
        return [f"{r['ppl_mean_nll']:.3f} ({sum(dd) / len(dd):+.3f} [{lo:+.3f}, {hi:+.3f}])",
                f"{rate(sum(r['forced']), n)}, {rate(sum(r['greedy']), n)}"]

    for press in dict.fromkeys(r["press"] for k, r in res.items() if k != "full"):
        body.append([press] + [c for r in ratios for c in cells(res[f"{press} @ {r}"])])
    return table(head, body)


def kvpress_decoding(js, records):
    """scripts/kvpress_side_by_side.py --decoding's JSONs (DATA: A.json+B.json, the presses of B
    after A's; the full cache of the first): per press the perplexity, the NLL difference from
    the full cache over the same 64-token blocks with its bootstrap 95% interval, and the slots
    held at the end."""
    results = OrderedDict()
    for x in js:
        results.update((k, v) for k, v in x["results"].items() if k not in results)
    j = js[0]
    full = results["full"]

    def blocks(r):
        return [sum(q[i:i + 64]) / len(q[i:i + 64]) for q in r["nll"] for i in range(0, len(q), 64)]

    body = []
    for name, r in results.items():
        dd = [a - b for a, b in zip(blocks(r), blocks(full))]
        lo, hi = bootstrap_mean(dd)
        body.append([name, f"{r['ppl_mean_nll']:.3f}", "" if name == "full" else
                     f"{sum(dd) / len(dd):+.3f} [{lo:+.3f}, {hi:+.3f}]", ", ".join(map(str, r["final_slots"]))])
    return table([f"press (DecodingPress, target {j['target']}, interval {j['interval']})", "PPL",
                  "dNLL vs full [95%]", "slots at the end"], body)


def prefill_memory(j, record):
    """scripts/prefill_memory.py's JSON: per prompt length the plain prefill's cache bytes and
    resident-set growth beside block-wise prefill's peak and final cache bytes and its growth."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    runs = {(r["mode"], r["tokens"]): r for r in j["runs"]}
    body = []
    for tokens in sorted({t for _, t in runs}):
        p, b = runs.get(("plain", tokens)), runs.get(("blockwise", tokens))
        body.append([f"{tokens:,}"] + ([mib(p["kv_bytes_peak"]), mib(p["rss_growth_peak_bytes"])] if p else
                                       ["not run", "not run"]) +
                    ([mib(b["kv_bytes_peak"]), mib(b["kv_bytes_end"]), mib(b["rss_growth_peak_bytes"])] if b else
                     ["not run"] * 3))
    return table(["tokens", "plain: KV", "plain: RSS growth", "block-wise: peak KV", "block-wise: KV after",
                  "block-wise: RSS growth"], body)


def needles_archive(rows, record):
    """What recall did and cost, per model, distance and policy run with an archive (the rows carry
    key_recalled, recall_seconds, decode_seconds, archive_bytes, cache_bytes and full_bytes)."""
    body = []
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        for distance in sorted({int(r["distance"]) for r in rows if r["model"] == model}):
            mine = [r for r in rows if r["model"] == model and int(r["distance"]) == distance]
            for policy in OrderedDict.fromkeys(r["policy"] for r in mine):
                g = [r for r in mine if r["policy"] == policy and int(r["archive_bytes"]) > 0]
                if not g:
                    continue
                secs = [float(r["recall_seconds"]) for r in g]
                cost = [float(r["recall_seconds"]) / float(r["decode_seconds"]) for r in g]
                held = [(int(r["archive_bytes"]) + int(r["cache_bytes"])) / int(r["full_bytes"]) for r in g]
                body.append([MODEL_NAMES.get(model, model), distance, f"`{policy}`", len(g),
                             f"{100 * sum(statement_share(r) for r in g) / len(g):.0f}%",
                             f"{100 * sum(int(r['key_recalled']) / int(r['key_tokens']) for r in g) / len(g):.0f}%",
                             f"{sum(secs) / len(secs):.2f} / {max(secs):.2f}", f"{100 * max(cost):.1f}%",
                             f"{100 * min(held):.1f}-{100 * max(held):.1f}%"])
    return table(["model", "distance", "policy", "questions", "statement cached before recall", "after recall",
                  "recall s, mean / max", "recall / stream decoding so far, max",
                  "archive + cache / full f16 K and V"], body)


def needles_pairs(rows, record):
    """Reading against finding: per model, the first policy of the data (A) beside each other one
    (B) on the questions where both held the asked statement whole when asking (after any recall:
    key_recalled = key_tokens), split by which of the two answer it by forced choice, with each
    one's misses there that chose another person's value of the same kind (bound)."""
    body = []
    for model in OrderedDict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        policies = list(OrderedDict.fromkeys(r["policy"] for r in mine))
        at = {(r["policy"], r["seed"], r["trial"], r["distance"]): r for r in mine}
        for b in policies[1:]:
            both = [(at[(policies[0], *k)], at[(b, *k)]) for p, *k in at if p == b and (policies[0], *k) in at]
            both = [(x, y) for x, y in both if all(r["key_recalled"] == r["key_tokens"] for r in (x, y))]
            ok = lambda r: r["forced_success"] == "1"
            count = lambda f: sum(1 for x, y in both if f(x, y))
            bound_a = sum(bound(mine, x) for x, _ in both if not ok(x))
            bound_b = sum(bound(mine, y) for _, y in both if not ok(y))
            body.append([MODEL_NAMES.get(model, model), f"`{policies[0]}`", f"`{b}`", len(both),
                         count(lambda x, y: ok(x) and ok(y)), count(lambda x, y: ok(x) and not ok(y)),
                         count(lambda x, y: ok(y) and not ok(x)), count(lambda x, y: not ok(x) and not ok(y)),
                         f"{bound_a}/{count(lambda x, y: not ok(x))}, {bound_b}/{count(lambda x, y: not ok(y))}"])
    return table(["model", "A", "B", "questions with the statement whole in both", "both answer", "only A",
                  "only B", "neither", "misses bound to another person: A, B"], body)


def needles_bytes(datas, records):
    """Equal bytes (DATA: eval_sweep.py CSVs, the first holding the f16 full cache): per model of
    the first CSV and policy, on the same questions, the forced-choice successes, those among the
    f16 full cache's, the statement tokens cached, and the K and V held when the question is asked
    (the cache's, in its type, plus an archive's), as a share of the f16 full cache's then: mean and
    range. Only the first CSV's full cache counts as `full`."""
    first = datas[0]
    rows = first + [r for d in datas[1:] for r in d if r["policy"] != "full"]
    body = []
    for model in OrderedDict.fromkeys(r["model"] for r in first):
        mine = [r for r in rows if r["model"] == model]
        ref = {(r["seed"], r["trial"], r["distance"]): int(r["cache_bytes"]) for r in mine if r["policy"] == "full"}
        mine = [r for r in mine if (r["seed"], r["trial"], r["distance"]) in ref]
        for policy, v in needle_stats(mine)[model].items():
            held = [(int(r["cache_bytes"]) + int(r["archive_bytes"])) / ref[(r["seed"], r["trial"], r["distance"])]
                    for r in mine if r["policy"] == policy]
            body.append([MODEL_NAMES.get(model, model), f"`{policy}`", rate(v["forced"], v["n"]),
                         rate(v["kept"], v["kept_of"]) if policy != "full" else "-", f"{100 * v['cached']:.0f}%",
                         f"{100 * sum(held) / len(held):.0f}% ({100 * min(held):.0f}-{100 * max(held):.0f}%)"])
    return table(["model", "policy", "forced choice", "of the f16 full cache's forced successes",
                  "statement tokens cached", "K and V held when asked, of the f16 full cache's: mean (range)"], body)


def peers_single_turn(datas, records):
    """The single-turn side by side (DATA: JSONs of scripts/peers_single_turn.py + infkv-stream
    CSVs of eval_sweep.py, SmolLM2 at distance 2048): per budget and engine setting the forced-choice
    and greedy successes, the share of the same engine's full-cache successes kept (forced choice;
    greedy where the engine gives no forced choice), the most KV tokens held while the prompt went
    in and what was held after it, prefill and decode tokens/s. infkv's evicting rows hold at most
    budget + block by construction (the runner checks it after every block); their prefill time
    includes the question's proxy decodes; the full cache's rows stream every question in one
    run, so their prefill rate is not given."""
    groups = OrderedDict()
    for d, rec in zip(datas, records):
        if isinstance(d, dict):
            for r in d["records"]:
                full = r["setting"].endswith(" full")  # the same whatever the budget
                groups.setdefault(("-" if full else str(d["budget"]), r["setting"]), []).append(dict(
                    key=(str(r["seed"]), str(r["trial"])), success=r["success"], forced=r.get("forced_success"),
                    peak=r["peak_tokens"], after=r["after_tokens"], tokens=r["prompt_tokens"],
                    prefill=r["prefill_s"], decoded=r["decoded"], decode=r["decode_s"]))
            continue
        settings = rec["protocol"]["settings"]
        for r in d:
            if r["model"] != "smollm2" or r["distance"] != "2048":
                continue
            opts = dict(o.split("=", 1) for o in r["policy"].split(":")[1:] if "=" in o)
            budget = int(opts.get("budget", settings["budget"]))
            at = int(r["key_at"]) + int(r["key_tokens"]) + int(r["distance"])
            full = r["policy"] == "full"
            held = int(r["cache_bytes"]) * at // int(r["full_bytes"])
            groups.setdefault(("-" if full else str(budget), f"infkv {r['policy']}"), []).append(dict(
                key=(r["seed"], r["trial"]), success=r["success"] == "1", forced=r["forced_success"] == "1",
                peak=int(r["prompt_tokens"]) if full else budget + settings["block"], after=held,
                tokens=int(r["prompt_tokens"]), prefill=None if full else float(r["decode_seconds"]),
                decoded=0, decode=0.0))
    for (b, setting), g in groups.items():  # a full cache run in several of the data: each question once
        if b == "-":
            first = {}
            for x in g:
                first.setdefault(x["key"], x)
            g[:] = first.values()
    fulls = {s.split()[0]: g for (b, s), g in groups.items() if s.split()[-1] == "full"}
    fulls["kvpress"] = fulls.get("transformers")  # kvpress's presses run in transformers
    body = []
    order = sorted(groups, key=lambda k: (k[0] != "-", -int(k[0]) if k[0] != "-" else 0, k[1].split()[-1] != "full"))
    for budget, setting in order:
        g = groups[(budget, setting)]
        n = len(g)
        has_forced = g[0]["forced"] is not None
        kept = "-"
        full = fulls.get(setting.split()[0])
        if full is not None and setting.split()[-1] != "full":
            field = "forced" if has_forced else "success"
            won = {x["key"] for x in full if x[field]}
            kept = rate(sum(1 for x in g if x["key"] in won and x[field]), len(won)) + ("" if has_forced else " (greedy)")
        pre = (f"{sum(x['tokens'] for x in g) / sum(x['prefill'] for x in g):.0f}" if g[0]["prefill"] is not None
               else "-")
        dec = f"{sum(x['decoded'] for x in g) / sum(x['decode'] for x in g):.1f}" if sum(x["decode"] for x in g) else "-"
        body.append([budget, f"`{setting}`", rate(sum(x["forced"] for x in g), n) if has_forced else "-",
                     rate(sum(x["success"] for x in g), n), kept, f"{max(x['peak'] for x in g):,}",
                     f"{sum(x['after'] for x in g) / n:,.0f}", pre, dec])
    return table(["budget", "engine and setting", "forced choice", "greedy", "of the full cache's successes",
                  "KV tokens held, most", "held after the prompt, mean", "prefill tok/s", "decode tok/s"], body)


GENERATORS = {"needles_full": needles_full, "needles_policies": needles_policies, "ppl_slices": ppl_slices,
              "trace_policies": trace_policies, "video_memory": video_memory, "video_facts": video_facts,
              "targets": targets, "needles_cached": needles_cached, "kvpress_prefill": kvpress_prefill,
              "kvpress_decoding": kvpress_decoding, "prefill_memory": prefill_memory,
              "needles_archive": needles_archive, "peers_single_turn": peers_single_turn,
              "needles_bytes": needles_bytes, "needles_pairs": needles_pairs}


def generate(doc_path):
    doc_dir = os.path.dirname(os.path.abspath(doc_path))
    with open(doc_path) as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            continue
        gen, data = m.group(1), m.group(2)
        if gen not in GENERATORS:
            sys.exit(f"eval_report: {doc_path}:{i}: unknown generator {gen!r} (known: {', '.join(GENERATORS)})")
        j = i
        while j < len(lines) and lines[j] != END:
            j += 1
        if j == len(lines):
            sys.exit(f"eval_report: {doc_path}:{i}: no {END} after the table of {gen} {data}")
        if "+" in data:  # several data files (targets): a list of each
            loaded = [load(doc_dir, d) for d in data.split("+")]
            out += GENERATORS[gen]([x[0] for x in loaded], [x[1] for x in loaded])
            for d, (_, record) in zip(data.split("+"), loaded):
                out += provenance(d.partition("#")[0], record)
        else:
            rows, record = load(doc_dir, data)
            out += GENERATORS[gen](rows, record) + provenance(data.partition("#")[0], record)
        i = j
    return lines, out


def self_test():
    """The statistics of needles_cached and targets on a small grid worked out by hand: a full cache
    answering 3 of 4 questions; policies A and B answering 2 of those 3 (one with the whole
    statement, one with 6 of its 10 tokens, missing the one with none) and the question the full
    cache misses (statement whole: 65% cached on average); A's perplexity 1.02 times StreamingLLM's
    in every block (ratio 1.02, interval 1.02-1.02: not met), B's 1.005 times (met). Returns the
    number of failures. Without the full cache's rows, needles_policies leaves its column out and
    needles_cached counts every question."""
    needles, blocks = [], []
    for trial, full_ok, a_ok, kept in [(1, 1, 1, 10), (2, 1, 0, 0), (3, 1, 1, 6), (4, 0, 1, 10)]:
        for policy, ok, k in (("full", full_ok, 10), ("A", a_ok, kept), ("B", a_ok, kept)):
            needles.append({"model": "m", "seed": "1", "trial": str(trial), "distance": "2048", "policy": policy,
                            "forced_success": str(ok), "success": str(ok), "key_kept": str(k), "key_tokens": "10",
                            "candidates": "8"})
    for t in range(128, 10001, 128):  # one slice; blocks past the 1,152-token warm-up are compared
        wobble = 1.0 + 0.01 * ((t // 128) % 3)  # the reference varies from block to block
        for policy, f in (("streaming_llm", 1.0), ("A", 1.02), ("B", 1.005)):
            blocks.append({"model": "m", "skip": "0", "tokens": str(t), "scored": "128", "policy": policy,
                           "block_ppl": str(10.0 * wobble * f)})
    got = {"targets": targets([blocks, needles], [{}, {}]), "needles_cached": needles_cached(needles, {}),
           "needles_policies": needles_policies([r for r in needles if r["policy"] != "full"], {}),
           "needles_cached, no full cache": needles_cached([r for r in needles if r["policy"] != "full"], {})}
    # equal bytes: the f16 full cache holds 1000 bytes at every question, a q4_0 one 281, A 250 plus
    # an archive of 50; a second file's full cache (answering nothing) is not the reference
    fulls = [r for r in needles if r["policy"] == "full"]
    first = ([dict(r, cache_bytes="1000", archive_bytes="0") for r in fulls] +
             [dict(r, policy="full:cache-type=q4_0", cache_bytes="281", archive_bytes="0") for r in fulls])
    second = ([dict(r, cache_bytes="250", archive_bytes="50") for r in needles if r["policy"] == "A"] +
              [dict(r, forced_success="0", cache_bytes="9", archive_bytes="0") for r in fulls])
    got["needles_bytes"] = needles_bytes([first, second], [{}, {}])
    # reading against finding: four people's colours in one stream; question 4 has B's statement
    # cut (5 of 10 tokens), so three count: both right; A right and B wrong (Anna's red for Ben,
    # bound); both wrong (A a colour the stream never states, B Anna's red for Cara, bound)
    pairs, people = [], [("Anna", "red"), ("Ben", "blue"), ("Cara", "green"), ("Dan", "pink")]
    for t, (a, b, kept) in enumerate([("1", "1", 10), ("1", "0", 10), ("0", "0", 10), ("1", "1", 5)]):
        for policy, ok, other, k in (("A", a, "violet", 10), ("B", b, "red", kept)):
            pairs.append({"model": "m", "people": "4", "seed": "1", "trial": str(t), "distance": "2048",
                          "policy": policy, "stream": "0", "kind": "colour", "person": people[t][0],
                          "needle": people[t][1], "forced_success": ok, "best_other": other,
                          "key_tokens": "10", "key_recalled": str(k)})
    got["needles_pairs"] = needles_pairs(pairs, {})
    want = {"targets": ["| `A` | 1.0200 (1.0200-1.0200) | not met | 2/3 (21-94%) | not met | 65% |",
                        "| `B` | 1.0050 (1.0050-1.0050) | met | 2/3 (21-94%) | not met | 65% |"],
            "needles_cached": ["| m (2 policies) | 0/2 (0-66%) | - | 2/2 (34-100%) | 2/2 (34-100%) |"],
            # without a full cache (beyond the trained context) its column is left out
            "needles_policies": ["| policy | forced choice | greedy | forced, per seed | statement tokens cached |",
                                 "| `A` | 3/4 (30-95%) | 3/4 (30-95%) | 3 | 65% |"],
            # and needles_cached counts every question, the one the full cache missed included
            "needles_cached, no full cache": ["| m (2 policies, every question: no full cache) | 0/2 (0-66%) | - | "
                                              "2/2 (34-100%) | 4/4 (51-100%) |"],
            "needles_bytes": ["| m | `full` | 3/4 (30-95%) | - | 100% | 100% (100-100%) |",
                              "| m | `full:cache-type=q4_0` | 3/4 (30-95%) | 3/3 (44-100%) | 100% | 28% (28-28%) |",
                              "| m | `A` | 3/4 (30-95%) | 2/3 (21-94%) | 65% | 30% (30-30%) |"],
            "needles_pairs": ["| m | `A` | `B` | 3 | 1 | 1 | 0 | 1 | 0/1, 2/2 |"]}
    bad = 0
    for name, lines in want.items():
        for line in lines:
            if line not in got[name]:
                print(f"eval_report self-test: {name}: no line {line!r} in:\n" + "\n".join(got[name]))
                bad += 1
    print("eval_report self-test: " + ("ok" if bad == 0 else f"{bad} failed"))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("doc", nargs="?", default=os.path.join(ROOT, "docs/evaluation.md"))
    ap.add_argument("--check", action="store_true", help="compare only; fail when a table differs from its data")
    ap.add_argument("--self-test", action="store_true", help="check the generators' statistics on a grid worked out by hand")
    a = ap.parse_args()
    if a.self_test:
        return 1 if self_test() else 0
    old, new = generate(a.doc)
    if old == new:
        print(f"eval_report: {a.doc}: every generated table matches its data")
        return 0
    if a.check:
        sys.stdout.writelines(difflib.unified_diff([l + "\n" for l in old], [l + "\n" for l in new],
                                                   a.doc, a.doc + " (from the data)"))
        print(f"eval_report: {a.doc}: tables differ from their data; run scripts/eval_report.py")
        return 1
    with open(a.doc, "w") as f:
        f.write("\n".join(new))
    print(f"eval_report: {a.doc}: tables written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
