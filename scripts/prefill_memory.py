#!/usr/bin/env python3
"""Peak memory of budgeted block-wise prefill in transformers (infkv.kvpress.prefill_blockwise)
against plain prefill (one forward pass into a DynamicCache), SmolLM2-135M (f32, CPU, sdpa) on the
King James text. Each (mode, tokens) runs in its own process, so its peak RSS (ru_maxrss) is its
own; the KV bytes are those of the cache's tensors (plain: after the pass; block-wise: the largest
sum over layers, measured after every layer), and the RSS growth is the largest resident set seen
during the prefill (sampled every 5 ms) minus the resident set before it (the model loaded). Prints one JSON record. Run with the Python
environment of scripts/python_env.sh, the package installed (scripts/python_test.sh installs it):
  $(scripts/python_env.sh)/bin/python scripts/prefill_memory.py --model M --text T"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The largest resident set seen while the block runs, sampled every 5 ms by a thread (torch
    releases the GIL in its kernels)."""

    def __enter__(self):
        import threading
        self.peak, self.stop = rss_now(), threading.Event()
        def sample():
            while not self.stop.wait(0.005):
                self.peak = max(self.peak, rss_now())
        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_now())


def one(a):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import infkv
    from infkv.kvpress import cache_bytes, prefill_blockwise

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    folder, name = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = open(a.text, encoding="utf-8").read()
    ids = tok(text[: 6 * a.tokens], return_tensors="pt").input_ids[:, : a.tokens]
    if ids.shape[1] < a.tokens:
        raise SystemExit(f"--text has {ids.shape[1]} tokens, fewer than {a.tokens}")
    import gc
    gc.collect()
    base_rss = rss_now()
    t0 = time.perf_counter()
    with torch.no_grad(), RssPeak() as rss:
        if a.mode == "plain":
            cache = DynamicCache()
            model.model(input_ids=ids, past_key_values=cache)
            kv = cache_bytes(cache)
            peak_kv, kept = kv, cache.layers[0].keys.shape[2]
        else:
            cache, _, stats = prefill_blockwise(model, ids, infkv.snapkv(window=32), capacity=a.capacity,
                                                block=a.block, sinks=4, threads=a.threads)
            kv, peak_kv, kept = stats.final_kv_bytes, stats.peak_kv_bytes, stats.kept[0]
    seconds = time.perf_counter() - t0
    print(json.dumps({"mode": a.mode, "tokens": a.tokens, "seconds": seconds, "kv_bytes_end": kv,
                      "kv_bytes_peak": peak_kv, "kept_per_layer": kept,
                      "rss_before_bytes": base_rss, "rss_growth_peak_bytes": rss.peak - base_rss,
                      "rss_process_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file (scripts/model.sh)")
    ap.add_argument("--text", required=True, help="text file (scripts/kjv.sh)")
    ap.add_argument("--tokens", default="4096,8192,16384,32768")
    ap.add_argument("--plain-max", type=int, default=8192, help="longest prompt prefilled plainly (its attention "
                    "is quadratic: 16K takes minutes on 2 cores)")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", choices=["plain", "blockwise"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:
        a.tokens = int(a.tokens)
        return one(a)
    runs = []
    for n in map(int, a.tokens.split(",")):
        for mode in ("plain", "blockwise"):
            if mode == "plain" and n > a.plain_max:
                continue
            out = subprocess.run([sys.executable, __file__, "--model", a.model, "--text", a.text, "--tokens", str(n),
                                  "--mode", mode, "--capacity", str(a.capacity), "--block", str(a.block),
                                  "--threads", str(a.threads)], check=True, capture_output=True, text=True,
                                 env=dict(os.environ, TQDM_DISABLE="1"))
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), file=sys.stderr)
    import importlib.metadata as md
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(json.dumps({
        "program": "scripts/prefill_memory.py", "commit": commit, "model": os.path.basename(a.model),
        "policy": "snapkv(window=32), sinks 4", "capacity": a.capacity, "block": a.block, "threads": a.threads,
        "torch": torch.__version__, "transformers": md.version("transformers"), "python": platform.python_version(),
        "protocol": "one process per (mode, tokens); f32 weights and cache; KV bytes from the cache tensors; "
                    "RSS growth = largest resident set during the prefill (5 ms samples) minus the one before it; "
                    "process peak = ru_maxrss (the model's load included)",
        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
