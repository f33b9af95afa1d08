#!/usr/bin/env python3
"""Times kvpress's ExpectedAttentionPress.score() in kvpress's own pipeline: SmolLM2-135M in
transformers (f32, CPU, loaded from the GGUF that scripts/model.sh unpacks), the first TOKENS
tokens of a text, the press's default statistics (every query of the prompt after its n_sink
sinks), every layer's score() call timed, and apart the pre-RoPE query projection score() does
inside. Prints one JSON record (per-layer medians, their totals, the shapes). Run with the Python environment of scripts/python_env.sh:
  $(scripts/python_env.sh)/bin/python scripts/kvpress_expected.py --model M --text T --threads 1"""
import argparse
import importlib.metadata
import json
import os
import platform
import time

import torch
import transformers
from kvpress import ExpectedAttentionPress
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file (scripts/model.sh)")
    ap.add_argument("--text", required=True, help="text file (scripts/kjv.sh)")
    ap.add_argument("--tokens", type=int, default=1501)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="forward passes; the median per layer is reported")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    folder, name = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tok(open(a.text, encoding="utf-8").read()[: 40 * a.tokens], return_tensors="pt").input_ids[:, : a.tokens]
    if ids.shape[1] < a.tokens:
        raise SystemExit(f"--text has {ids.shape[1]} tokens, fewer than --tokens {a.tokens}")
    press = ExpectedAttentionPress(compression_ratio=0.5)
    # kvpress computes the pre-RoPE queries inside score() (q_proj on the hidden states, a GEMM
    # that infkv's caller has already done): timed apart, so both totals are reported.
    from kvpress.presses import expected_attention_press as eap
    calls, projections = [], []

    def timed(fn, sink):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sink.append(time.perf_counter() - t0)
            return out
        return wrapper

    press.score = timed(press.score, calls)
    eap.get_prerope_query_states = timed(eap.get_prerope_query_states, projections)
    runs, proj_runs = [], []
    with torch.no_grad():
        for _ in range(a.repeats):
            calls.clear(), projections.clear()
            with press(model):
                model(ids)
            runs.append(list(calls)), proj_runs.append(list(projections))

    def median_per_layer(rs):
        return [sorted(r[i] for r in rs)[len(rs) // 2] for i in range(len(rs[0]))]

    per_layer, proj_per_layer = median_per_layer(runs), median_per_layer(proj_runs)
    cfg = model.config
    print(json.dumps({
        "program": "scripts/kvpress_expected.py", "kvpress": importlib.metadata.version("kvpress"),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "model": os.path.basename(a.model), "tokens": a.tokens, "threads": a.threads, "repeats": a.repeats,
        "layers": len(per_layer), "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.hidden_size // cfg.num_attention_heads, "n_sink": press.n_sink,
        "score_seconds_per_layer_median": per_layer, "score_seconds_total": sum(per_layer),
        "query_projection_seconds_per_layer_median": proj_per_layer,
        "query_projection_seconds_total": sum(proj_per_layer),
        "score_without_projection_seconds_total": sum(per_layer) - sum(proj_per_layer)}, indent=1))


if __name__ == "__main__":
    main()
