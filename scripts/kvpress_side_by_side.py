#!/usr/bin/env python3
"""kvpress's presses and infkv's policies side by side on one model and the same prompts:
SmolLM2-135M-Instruct in transformers (f32, CPU, sdpa, loaded from the GGUF of scripts/model.sh),
contexts of --context tokens of the King James text (scripts/kjv.sh) at --samples offsets.

Each context is prefilled once with the full cache; every press then compresses the same
per-layer keys, values and hidden states (what kvpress's forward hook would hand it: a press
never changes the prefill's own attention), at compression ratios 0.25 / 0.5 / 0.75 (kvpress's
meaning: the share evicted). Measured on the compressed cache:
  perplexity: of the next --continuation tokens of the text (teacher-forced, positions continued;
    the first continuation token, predicted by the uncompressed prefill, left out);
  needle: a statement "The secret number of NAME is DDDD." planted at a random depth of a second
    context of the same length, then the question "What is the secret number of NAME? The secret
    number of NAME is"; forced choice (the true number's log-probability ranks first among 10
    four-digit numbers) and greedy (the first number in 6 greedy tokens is the true one).
With --decoding: decoding at a fixed budget instead, each press inside kvpress's DecodingPress
(target --target slots, compressing every --interval steps): --prefix tokens prefilled, then the
next --continuation tokens of the text fed one at a time (teacher-forced), the NLL of each recorded.
Prints one JSON record: per (press, ratio) the per-sample NLL and needle outcomes, with means, a
bootstrap 95% interval of the mean NLL over samples and Wilson intervals of the success rates.
Run with the Python environment of scripts/python_env.sh, the package installed
(scripts/python_test.sh installs it):
  $(scripts/python_env.sh)/bin/python scripts/kvpress_side_by_side.py --model M --text T > out.json
  python3 scripts/kvpress_side_by_side.py --table out.json   # its markdown table (scripts/eval_report.py)"""
import argparse
import contextlib
import importlib.metadata as md
import json
import math
import os
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import eval_report  # noqa: E402  (the tables and their statistics; standard library only)
from eval_report import bootstrap_mean  # noqa: E402
from eval_summary import wilson  # noqa: E402

if "--table" not in sys.argv:  # the table needs only the JSON
    import torch
    import transformers
    from kvpress import (DecodingPress, ExpectedAttentionPress, KeyDiffPress, KnormPress, SnapKVPress,
                         StreamingLLMPress, TOVAPress)
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import infkv
    from infkv.kvpress import InfkvPress, _hooks

NAMES = ["Marta", "Tobias", "Ingrid", "Nadia", "Oskar", "Lucia", "Henrik", "Amara", "Felix", "Greta", "Ravi",
         "Sofia", "Emil", "Yara", "Pavel", "Ines"]


def presses():
    """(name, factory(ratio)) of every press compared; None is the full cache."""
    bias = infkv.attention_bias(beta=8.0, unit=infkv.age_unit.ranks)
    return [
        ("kvpress streaming_llm", lambda r: StreamingLLMPress(compression_ratio=r, n_sink=4)),
        ("kvpress snapkv", lambda r: SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)),
        ("kvpress tova", lambda r: TOVAPress(compression_ratio=r)),
        ("kvpress keydiff", lambda r: KeyDiffPress(compression_ratio=r)),
        ("kvpress knorm", lambda r: KnormPress(compression_ratio=r)),
        ("kvpress expected_attention", lambda r: ExpectedAttentionPress(compression_ratio=r)),
        ("infkv streaming_llm", lambda r: InfkvPress(policy=infkv.streaming_llm(), compression_ratio=r, sinks=4)),
        ("infkv snapkv", lambda r: InfkvPress(policy=infkv.snapkv(window=64, kernel=5), compression_ratio=r)),
        ("infkv keydiff max5", lambda r: InfkvPress(policy=infkv.keydiff(pool=infkv.pooling.max, kernel=5),
                                                    compression_ratio=r)),
        ("infkv expected_attention w64", lambda r: InfkvPress(policy=infkv.expected_attention(window=64),
                                                              compression_ratio=r)),
        ("infkv inf_mllm", lambda r: InfkvPress(policy=infkv.inf_mllm(window=64, kernel=5), compression_ratio=r,
                                                sinks=4)),
        ("infkv inf_mllm_bias", lambda r: InfkvPress(policy=infkv.inf_mllm(window=64, kernel=5, bias=bias),
                                                     compression_ratio=r, sinks=4)),
    ]


def capture(model, ids):
    """One full-cache prefill; per layer what a press's compress() receives."""
    cache, layers = DynamicCache(), {}

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        kw = {k: kwargs[k] for k in ("cache_position", "position_embeddings", "hidden_states")}
        layers[module.layer_idx] = (module, kw, layer.keys.clone(), layer.values.clone())
        return output

    with torch.no_grad(), _hooks(model, hook):
        out = model(ids, past_key_values=cache)
    return [layers[i] for i in range(len(layers))], out.logits[0, -1]


def compressed_cache(model, layers, press):
    cache = DynamicCache()
    if press is not None:
        press.post_init_from_model(model)
    for i, (module, kw, keys, values) in enumerate(layers):
        if press is not None:
            keys, values = press.compress(module, kw["hidden_states"], keys, values, None, kw)
        cache.update(keys, values, i)
    return cache


def nll(model, cache, cont, start):
    with torch.no_grad():
        logits = model(cont, past_key_values=cache,
                       position_ids=torch.arange(start, start + cont.shape[1]).unsqueeze(0)).logits[0]
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return float(-lp.gather(1, cont[0, 1:, None]).mean())


def needle_outcome(model, tok, cache, start, question, value, others):
    """Forced choice among value and others, and greedy exact match, on `cache` after `question`."""
    with torch.no_grad():
        q = model(question, past_key_values=cache,
                  position_ids=torch.arange(start, start + question.shape[1]).unsqueeze(0)).logits[0, -1]
        base, pos = cache.get_seq_length(), start + question.shape[1]
        scores = []
        for cand in [value] + others:
            c = tok(" " + cand, add_special_tokens=False, return_tensors="pt").input_ids
            lp = float(torch.log_softmax(q.double(), -1)[c[0, 0]])
            if c.shape[1] > 1:
                logits = model(c[:, :-1], past_key_values=cache,
                               position_ids=torch.arange(pos, pos + c.shape[1] - 1).unsqueeze(0)).logits[0]
                lp += float(torch.log_softmax(logits.double(), -1).gather(1, c[0, 1:, None]).sum())
                cache.crop(base)
            scores.append(lp)
        out, nxt = [], q.argmax()
        for i in range(6):
            out.append(int(nxt))
            nxt = model(nxt.view(1, 1), past_key_values=cache,
                        position_ids=torch.tensor([[pos + i]])).logits[0, -1].argmax()
        cache.crop(base)
    text = tok.decode(out)
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return {"forced": scores[0] > max(scores[1:]), "greedy": bool(digits) and digits[0] == value, "answer": text}


def decoding_nll(model, ids, prefix, press, target, interval):
    """Per-token NLL of ids[prefix:], fed one token at a time after a plain prefill of ids[:prefix],
    `press` (None: the full cache) inside kvpress's DecodingPress."""
    cache, out = DynamicCache(), []
    ctx = (DecodingPress(base_press=press, compression_interval=interval, target_size=target)(model)
           if press is not None else contextlib.nullcontext())
    with torch.no_grad(), ctx:
        logits = model(ids[:, :prefix], past_key_values=cache).logits[0, -1]
        for i in range(prefix, ids.shape[1]):
            out.append(float(-torch.log_softmax(logits.double(), -1)[ids[0, i]]))
            logits = model(ids[:, i:i + 1], past_key_values=cache, position_ids=torch.tensor([[i]])).logits[0, -1]
    return out, cache.get_seq_length()


def decoding_main(a, model, ids, commit):
    span = a.prefix + a.continuation
    stride = (ids.shape[1] - span) // a.samples
    configs = [("full", None)] + [(n, f) for n, f in presses() if not a.only or n in a.only.split(",")]
    res = {n: {"press": n, "nll": [], "final_slots": []} for n, _ in configs}
    t0 = time.time()
    for s in range(a.samples):
        seq = ids[:, s * stride:s * stride + span]
        for n, f in configs:
            nll, slots = decoding_nll(model, seq, a.prefix, f and f(0.0), a.target, a.interval)
            res[n]["nll"].append(nll)
            res[n]["final_slots"].append(slots)
        print(f"sample {s + 1}/{a.samples} done, {time.time() - t0:.0f} s", file=sys.stderr)
    for r in res.values():
        flat = [x for seq in r["nll"] for x in seq]
        r["nll_mean"] = sum(flat) / len(flat)
        r["ppl_mean_nll"] = math.exp(r["nll_mean"])
        blocks = [sum(seq[i:i + 64]) / len(seq[i:i + 64]) for seq in r["nll"] for i in range(0, len(seq), 64)]
        r["nll_ci95"] = bootstrap_mean(blocks)  # over blocks of 64 tokens
    print(json.dumps({
        "program": "scripts/kvpress_side_by_side.py --decoding", "commit": commit, "model": os.path.basename(a.model),
        "prefix": a.prefix, "continuation": a.continuation, "target": a.target, "interval": a.interval,
        "samples": a.samples, "kvpress": md.version("kvpress"), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "seconds": time.time() - t0,
        "protocol": "teacher-forced decoding; interval = bootstrap over 64-token blocks of all samples",
        "results": res}, indent=1))


def table(path):
    """The markdown table of docs/evaluation.md (scripts/eval_report.py's generators, which also
    keep the document's copy equal to the JSON)."""
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    print("\n".join(eval_report.kvpress_decoding([d], [d]) if "target" in d else eval_report.kvpress_prefill(d, d)))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        return table(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file (scripts/model.sh)")
    ap.add_argument("--text", required=True, help="text file (scripts/kjv.sh)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--ratios", default="0.25,0.5,0.75")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated press names to run (default: all)")
    ap.add_argument("--decoding", action="store_true", help="decoding at a fixed budget (DecodingPress)")
    ap.add_argument("--prefix", type=int, default=256, help="--decoding: tokens prefilled before decoding")
    ap.add_argument("--target", type=int, default=256, help="--decoding: DecodingPress's target_size")
    ap.add_argument("--interval", type=int, default=128, help="--decoding: DecodingPress's compression_interval")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    transformers.utils.logging.set_verbosity_error()
    folder, name = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = open(a.text, encoding="utf-8").read()
    span = a.context + a.continuation
    ids = tok(text[: 5 * span * (2 * a.samples + 1)], return_tensors="pt").input_ids
    stride = (ids.shape[1] - span) // (2 * a.samples)
    rng = random.Random(a.seed)
    ratios = [float(r) for r in a.ratios.split(",")]
    configs = [("full", None, 0.0)] + [(n, f, r) for n, f in presses() for r in ratios
                                       if not a.only or n in a.only.split(",")]
    res = {n if f is None else f"{n} @ {r}": {"press": n, "ratio": r, "nll": [], "forced": [], "greedy": [],
                                              "answers": []} for n, f, r in configs}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    if a.decoding:
        return decoding_main(a, model, ids, commit)
    t0 = time.time()
    for s in range(a.samples):
        # perplexity: context and continuation from one offset
        o = 2 * s * stride
        ctx, cont = ids[:, o:o + a.context], ids[:, o + a.context:o + span]
        layers, _ = capture(model, ctx)
        for n, f, r in configs:
            key = n if f is None else f"{n} @ {r}"
            res[key]["nll"].append(nll(model, compressed_cache(model, layers, f and f(r)), cont, a.context))
        # needle: another offset, the statement at a random depth of the context
        o = (2 * s + 1) * stride
        who, value = rng.choice(NAMES), str(rng.randrange(1000, 10000))
        others = [str(v) for v in rng.sample(range(1000, 10000), 10) if str(v) != value][:9]
        stmt = tok(f"\nThe secret number of {who} is {value}.\n", add_special_tokens=False,
                   return_tensors="pt").input_ids
        depth = rng.randrange(int(0.1 * a.context), int(0.8 * a.context))
        body = ids[:, o:o + a.context - stmt.shape[1]]
        ctx = torch.cat([body[:, :depth], stmt, body[:, depth:]], dim=1)
        question = tok(f"\nWhat is the secret number of {who}? The secret number of {who} is",
                       add_special_tokens=False, return_tensors="pt").input_ids
        layers, _ = capture(model, ctx)
        for n, f, r in configs:
            key = n if f is None else f"{n} @ {r}"
            out = needle_outcome(model, tok, compressed_cache(model, layers, f and f(r)), ctx.shape[1], question,
                                 value, others)
            res[key]["forced"].append(out["forced"])
            res[key]["greedy"].append(out["greedy"])
            res[key]["answers"].append(out["answer"])
        print(f"sample {s + 1}/{a.samples} done, {time.time() - t0:.0f} s", file=sys.stderr)
    for r in res.values():
        r["nll_mean"] = sum(r["nll"]) / len(r["nll"])
        r["nll_ci95"] = bootstrap_mean(r["nll"])
        r["ppl_mean_nll"] = math.exp(r["nll_mean"])
        for k in ("forced", "greedy"):
            r[f"{k}_rate"] = sum(r[k]) / len(r[k])
            r[f"{k}_wilson95"] = wilson(sum(r[k]), len(r[k]))
    print(json.dumps({
        "program": "scripts/kvpress_side_by_side.py", "commit": commit, "model": os.path.basename(a.model),
        "context": a.context, "continuation": a.continuation, "samples": a.samples, "seed": a.seed,
        "ratios": ratios, "kvpress": md.version("kvpress"), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(), "seconds": time.time() - t0,
        "results": res}, indent=1))


if __name__ == "__main__":
    main()
