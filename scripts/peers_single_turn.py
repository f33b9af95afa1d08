#!/usr/bin/env python3
"""infkv-stream's single-turn needle questions answered by two peers on the very same prompts.

A single-turn prompt is a question's context (the stream up to it) followed by the question, in
one prefill; `infkv-stream --needle ... --export-questions Q.json` writes them as token ids
(version 2 of the needle protocol, docs/evaluation.md), with each question's candidate answers.

  openvino   OpenVINO GenAI's ContinuousBatchingPipeline (scripts/openvino_env.sh's Python) on the
             IR scripts/openvino_model.sh exports from the same weights (or a GGUF file, which it
             also reads): the full cache, and its cache eviction
             (CacheEvictionConfig) with max_cache_size = --budget in each --ov-modes mode
             (AGGREGATION:wWINDOW: SUM or NORM_SUM scores, SnapKV window of WINDOW prompt tokens,
             0: scores accumulated over the whole prompt). The prompt is prefilled in chunks of
             --block tokens (dynamic split-fuse). Greedy answers only (the pipeline returns no
             log-probabilities of given tokens). The cache's occupancy is read after every step:
             `peak` is the most KV the request held, `after` what it held at its last token.
  kvpress    kvpress's presses in transformers (scripts/python_env.sh's Python; the GGUF
             dequantized to f32): the prompt prefilled whole, then compressed to --budget slots
             (compression_ratio = 1 - budget / prompt tokens; kvpress's SnapKV, ChunkKV over SnapKV,
             KVzip), the answer decoded after it at the prompt's own positions. Forced choice (each
             candidate teacher-forced, its log-probability summed) and greedy. --question-later:
             the context alone prefilled and compressed, the question decoded after it.
  table      the markdown table of one or more JSONs written by the two (standard library only).

Both print progress on stderr and write one JSON (--out): settings, versions, one record per
(setting, question): the greedy answer and its grade (infkv-stream's: the answer begins with the
value as whole words, ignoring case), the forced-choice grade where there is one, the most KV
tokens held during the request, prefill and decode seconds.
  $(scripts/openvino_env.sh | tail -n1)/bin/python scripts/peers_single_turn.py openvino --questions Q.json \\
      --model "$(scripts/openvino_model.sh | tail -n1)" --budget 1024 --out ov.json
  $(scripts/python_env.sh | tail -n1)/bin/python scripts/peers_single_turn.py kvpress --questions Q.json \\
      --model "$(scripts/model.sh | tail -n1)" --budget 1024 --out kvpress.json
  python3 scripts/peers_single_turn.py table ov.json kvpress.json"""
import argparse
import importlib.metadata as md
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_summary import wilson  # noqa: E402  (standard library only)


def answer_matches(answer, value):
    """infkv-stream's greedy grade (tools/stream/needles.hpp answer_matches): after leading blanks
    the answer begins with `value` as whole words, ignoring case."""
    i = len(answer) - len(answer.lstrip())
    if not value or not answer[i:i + len(value)].lower() == value.lower():
        return False
    end = i + len(value)
    return not (end < len(answer) and answer[end].isalnum() and value[-1].isalnum())


def load_questions(paths, limit):
    """The questions of every file (each with its file's seed), the first `limit` of each (0: all),
    and the files' settings."""
    if limit < 0:
        sys.exit(f"peers_single_turn: --limit = {limit}: must be >= 0")
    metas, out = [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            q = json.load(f)
        if "questions" not in q or "needle" not in q:
            sys.exit(f"peers_single_turn: --questions {path}: not infkv-stream --needle --export-questions output")
        metas.append({k: q[k] for k in ("needle", "text", "version", "model") if k in q})
        out += [dict(x, seed=q["needle"]["seed"]) for x in (q["questions"][:limit] if limit else q["questions"])]
    return metas, out


def record(setting, q, answer, forced, peak, after, prefill_s, decode_s, gen):
    r = {"setting": setting, "seed": q["seed"], "trial": q["trial"], "kind": q["kind"], "person": q["person"],
         "needle": q["needle"], "prompt_tokens": len(q["prompt"]) + len(q["question"]), "answer": answer,
         "success": answer_matches(answer, q["needle"]), "peak_tokens": peak, "after_tokens": after,
         "prefill_s": prefill_s, "decode_s": decode_s, "decoded": gen}
    if forced is not None:
        r["forced_success"], r["rank"] = forced
    return r


def forced_rank(logprobs, truth):
    return 1 + sum(1 for c, lp in enumerate(logprobs) if c != truth and lp >= logprobs[truth])


def run_openvino(a, questions):
    import numpy as np
    import openvino as ov
    import openvino_genai as g
    modes = [("full", None)] if a.full else []
    for m in filter(None, a.ov_modes.split(",")):
        agg, _, w = m.partition(":w")
        if agg not in ("SUM", "NORM_SUM") or not w.isdigit():
            sys.exit(f"peers_single_turn: --ov-modes: '{m}' must be SUM:wN or NORM_SUM:wN")
        modes.append((f"openvino {agg.lower()} w{w}", (agg, int(w))))
    longest = max(len(q["prompt"]) + len(q["question"]) for q in questions) + a.gen
    blocks = math.ceil(longest / 32) + 8  # 32 tokens per block on the CPU
    props = {"INFERENCE_NUM_THREADS": a.threads, "KV_CACHE_PRECISION": a.kv_precision,
             "INFERENCE_PRECISION_HINT": a.precision}
    out = []
    for name, mode in modes:
        sc = g.SchedulerConfig()
        sc.num_kv_blocks, sc.max_num_batched_tokens, sc.dynamic_split_fuse = blocks, a.block, True
        sc.enable_prefix_caching = False
        if mode:
            sc.use_cache_eviction = True
            sc.cache_eviction_config = g.CacheEvictionConfig(
                start_size=a.start, recent_size=a.recent, max_cache_size=a.budget,
                aggregation_mode=getattr(g.AggregationMode, mode[0]), snapkv_window_size=mode[1])
        pipe = g.ContinuousBatchingPipeline(a.model, sc, "CPU", props)
        decode = pipe.get_tokenizer().decode
        if os.path.isdir(a.model):  # an exported IR: its tokenizer.json (OpenVINO's converter fails on this one)
            from tokenizers import Tokenizer
            decode = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json")).decode
        gc = g.GenerationConfig()
        gc.max_new_tokens = a.gen
        for i, q in enumerate(questions):
            ids = q["prompt"] + q["question"]
            h = pipe.add_request(i, ov.Tensor(np.array([ids], dtype=np.int64)), gc)
            steps, usage = [], []
            while pipe.has_non_finished_requests():
                t0 = time.perf_counter()
                pipe.step()
                steps.append(time.perf_counter() - t0)
                usage.append(pipe.get_metrics().cache_usage)
            gen = list(h.read_all()[0].generated_ids)
            chunks = math.ceil(len(ids) / a.block)  # the steps that prefill; the last one yields the first token
            tokens = [u / 100 * blocks * 32 for u in usage]
            out.append(record(name if mode else "openvino full", q, decode(gen), None,
                              round(max(tokens)), round(tokens[-1]), sum(steps[:chunks]), sum(steps[chunks:]),
                              len(gen) - 1))
            r = out[-1]
            print(f"[{r['setting']}] {q['kind']} {q['person']} {q['needle']}: {r['answer']!r} "
                  f"{'ok' if r['success'] else 'miss'}, peak {r['peak_tokens']} tokens", file=sys.stderr)
    return out, {"openvino": ov.__version__, "openvino_genai": md.version("openvino-genai"), "properties": props,
                 "num_kv_blocks": blocks, "start_size": a.start, "recent_size": a.recent}


def run_kvpress(a, questions):
    import logging
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    import transformers
    from kvpress import ChunkKVPress, KVzipPress, SnapKVPress
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    torch.set_num_threads(a.threads)
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's warning that it costs 2-3 prefills: measured here
    folder, name = os.path.dirname(os.path.abspath(a.model)), os.path.basename(a.model)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # KVzip reads the tokenizer by the model's name_or_path for its repeat prompt: the raw-text
    # protocol has no chat template (KVzip's own fallback then: no prefix, a newline before the repeat)
    saved = os.path.join(os.path.expanduser(os.environ.get("INFKV_CACHE", "~/.cache/infkv")), "models",
                         name + "-tokenizer-raw")
    if not os.path.exists(os.path.join(saved, "tokenizer_config.json")):
        tok.chat_template = None
        tok.save_pretrained(saved)
    model.config.name_or_path = saved
    presses = {"kvpress snapkv": lambda r: SnapKVPress(compression_ratio=r, window_size=a.window, kernel_size=5),
               "kvpress chunkkv": lambda r: ChunkKVPress(press=SnapKVPress(compression_ratio=r, window_size=a.window,
                                                                           kernel_size=5), chunk_length=20),
               "kvpress kvzip": lambda r: KVzipPress(compression_ratio=r)}
    chosen = [p for p in a.presses.split(",") if p]
    for p in chosen:
        if p != "full" and f"kvpress {p}" not in presses:
            sys.exit(f"peers_single_turn: --presses: '{p}' is not one of full,{','.join(k[8:] for k in presses)}")
    out = []
    with torch.no_grad():
        for p in chosen:
            setting = ("transformers full" if p == "full" else f"kvpress {p}") + (
                ", question later" if a.question_later else "")
            for q in questions:
                # single turn: context and question in one prefill, compressed together; question
                # later: the context alone prefilled and compressed, the question decoded after it
                ids = torch.tensor([q["prompt"] + ([] if a.question_later else q["question"])])
                n = ids.shape[1]
                cache = DynamicCache()
                t0 = time.perf_counter()
                if p == "full":
                    hidden = model.model(input_ids=ids, past_key_values=cache).last_hidden_state
                else:
                    with presses[f"kvpress {p}"](1.0 - a.budget / n)(model):
                        hidden = model.model(input_ids=ids, past_key_values=cache).last_hidden_state
                prefill_s = time.perf_counter() - t0
                kept, peak = cache.get_seq_length(), n
                if a.question_later:
                    nq = len(q["question"])
                    hidden = model.model(input_ids=torch.tensor([q["question"]]), past_key_values=cache,
                                         position_ids=torch.arange(n, n + nq)[None]).last_hidden_state
                    n, kept = n + nq, kept + nq
                last = torch.log_softmax(model.lm_head(hidden[0, -1]).double(), -1)
                logprobs = []
                for c in q["choices"]:
                    lp = float(last[c[0]])
                    if len(c) > 1:
                        logits = model(torch.tensor([c[:-1]]), past_key_values=cache,
                                       position_ids=torch.arange(n, n + len(c) - 1)[None]).logits[0]
                        lp += float(torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c[1:])[:, None]).sum())
                        cache.crop(kept)
                    logprobs.append(lp)
                rank = forced_rank(logprobs, q["truth"])
                t0 = time.perf_counter()
                gen, nxt = [], int(last.argmax())
                for i in range(a.gen):
                    gen.append(nxt)
                    if i + 1 == a.gen or nxt == tok.eos_token_id:
                        break
                    nxt = int(model(torch.tensor([[nxt]]), past_key_values=cache,
                                    position_ids=torch.tensor([[n + i]])).logits[0, -1].argmax())
                decode_s = time.perf_counter() - t0
                out.append(record(setting, q, tok.decode(gen), (rank == 1, rank), peak, kept,
                                  prefill_s, decode_s, len(gen) - 1))
                r = out[-1]
                print(f"[{setting}] {q['kind']} {q['person']} {q['needle']}: rank {rank}, {r['answer']!r} "
                      f"{'ok' if r['success'] else 'miss'}, kept {kept} of {n}", file=sys.stderr)
    return out, {"kvpress": md.version("kvpress"), "transformers": md.version("transformers"),
                 "torch": md.version("torch"), "window": a.window}


def table(paths):
    rows = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        for r in d["records"]:
            rows.setdefault((d["budget"], r["setting"]), []).append(r)
    print("| budget | setting | questions | greedy | forced choice | KV tokens held, most (mean) | "
          "after the prompt (mean) | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (budget, setting), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        n = len(rs)

        def rate(k):
            lo, hi = wilson(k, n)
            return f"{k}/{n} ({100 * lo:.0f}-{100 * hi:.0f}%)"
        forced = rate(sum(r["forced_success"] for r in rs)) if "forced_success" in rs[0] else "-"
        pre = sum(r["prompt_tokens"] for r in rs) / sum(r["prefill_s"] for r in rs)
        dec = sum(r["decoded"] for r in rs) / max(1e-9, sum(r["decode_s"] for r in rs))
        print(f"| {budget} | {setting} | {n} | {rate(sum(r['success'] for r in rs))} | {forced} | "
              f"{max(r['peak_tokens'] for r in rs)} ({sum(r['peak_tokens'] for r in rs) / n:.0f}) | "
              f"{sum(r['after_tokens'] for r in rs) / n:.0f} | {pre:.0f} | {dec:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("openvino", "kvpress"):
        s = sub.add_parser(name)
        s.add_argument("--questions", required=True, nargs="+", help="infkv-stream --export-questions JSONs")
        s.add_argument("--model", required=True, help="the GGUF file infkv-stream read (openvino: or the exported IR)")
        s.add_argument("--budget", type=int, default=1024, help="KV slots kept (max_cache_size / kept slots)")
        s.add_argument("--gen", type=int, default=8, help="greedy answer tokens (infkv-stream's --gen)")
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--limit", type=int, default=0, help="only the first N questions (0: all)")
        s.add_argument("--out", required=True)
    ov = sub.choices["openvino"]
    ov.add_argument("--no-full", dest="full", action="store_false", help="only the eviction modes")
    ov.add_argument("--ov-modes", default="NORM_SUM:w8,SUM:w8,SUM:w32,SUM:w0", help="eviction modes (see above)")
    ov.add_argument("--start", type=int, default=32, help="CacheEvictionConfig start_size (a multiple of 32)")
    ov.add_argument("--recent", type=int, default=32, help="CacheEvictionConfig recent_size (a multiple of 32; infkv's recent: 32)")
    ov.add_argument("--block", type=int, default=128, help="prompt tokens per step (max_num_batched_tokens)")
    ov.add_argument("--kv-precision", default="f16", help="the CPU plugin's KV_CACHE_PRECISION (its default: u8)")
    ov.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT (its default here: bf16)")
    kp = sub.choices["kvpress"]
    kp.add_argument("--presses", default="full,snapkv,chunkkv,kvzip")
    kp.add_argument("--window", type=int, default=32, help="SnapKV's window (infkv's snapkv: 32)")
    kp.add_argument("--question-later", action="store_true",
                    help="compress the context alone, then decode the question after it (the question unknown "
                         "to the press, as in infkv's streaming setting)")
    t = sub.add_parser("table")
    t.add_argument("json", nargs="+")
    a = ap.parse_args()
    if a.cmd == "table":
        return table(a.json)
    if a.budget < 1:
        sys.exit(f"peers_single_turn: --budget = {a.budget}: must be >= 1")
    metas, questions = load_questions(a.questions, a.limit)
    shortest = min(len(q["prompt"]) + len(q["question"]) for q in questions)
    if a.budget >= shortest:
        sys.exit(f"peers_single_turn: --budget = {a.budget}: the shortest prompt has {shortest} tokens, nothing to evict")
    records, versions = (run_openvino if a.cmd == "openvino" else run_kvpress)(a, questions)
    res = {"engine": a.cmd, "budget": a.budget, "gen": a.gen, "threads": a.threads, "model": os.path.basename(a.model),
           "questions_from": metas,
           "versions": versions, "python": platform.python_version(), "records": records}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
