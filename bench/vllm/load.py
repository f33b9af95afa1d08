"""A bounded load test of `vllm serve` with infkv's plugin (run by bench/vllm/load.sh; loopback only):
`clients` threads, each a multi-turn chat of `turns` turns whose history grows with every answer
until it reaches `history_chars` characters, after which the client drops its oldest exchanges, as
chat clients do to stay within a model's context (SmolLM2 has 8192 positions: a history that only
grows ends a 100-turn chat near turn 65); every request evicting (SnapKV, a budget of `budget`); the server's resident memory sampled every
second (with its child processes), every error kept. Writes JSON: per-turn latencies, RSS over time, errors, the plugin's peak
slots per request."""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def rss_mib(pid):
    """Resident memory of process `pid` and all its descendants (the server's engine core runs in a
    child process), MiB."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(x.split()[1]) for x in f if x.startswith("VmRSS:")), 0) / 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--history-chars", type=int, default=2400,
                    help="the most characters of history a client resends (oldest exchanges dropped first)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    load_start = os.getloadavg()
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stats = a.out + ".stats"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               INFKV_VLLM_STATS=stats)
    log = open(a.out + ".log", "w")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", a.model,
                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "8192",
                             "--enforce-eager", "--no-enable-prefix-caching", "--max-num-batched-tokens", "256",
                             "--max-num-seqs", str(a.clients),
                             "--worker-cls", "infkv.vllm.engine.InfkvCPUWorker",
                             "--scheduler-cls", "infkv.vllm.engine.InfkvScheduler",
                             "--logits-processors", "infkv.vllm.engine:InfkvSettings"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    while True:
        assert proc.poll() is None, "the server exited"
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(2)
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=1200)
    text = open(a.text).read()
    xargs = {"infkv_policy": "snapkv", "infkv_budget": a.budget, "infkv_block": 64, "infkv_window": 16}
    rss, errors, latencies, done = [], [], [], threading.Event()

    def sample():
        t0 = time.time()
        while not done.is_set():
            rss.append((round(time.time() - t0, 1), round(rss_mib(proc.pid), 1)))
            time.sleep(1)

    def chat(c):
        messages = [{"role": "user", "content": text[c * 50000: c * 50000 + 2000]}]
        for turn in range(a.turns):
            try:
                t = time.time()
                r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=a.max_tokens,
                                                   temperature=0.7, extra_body={"vllm_xargs": xargs})
                latencies.append((c, turn, round(time.time() - t, 3), r.usage.prompt_tokens))
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                messages.append({"role": "user", "content": text[c * 50000 + 2000 + turn * 400:
                                                                  c * 50000 + 2400 + turn * 400]})
                while sum(len(m["content"]) for m in messages) > a.history_chars and len(messages) > 2:
                    del messages[:2]  # the oldest exchange: the history still starts with a user turn
            except Exception as e:  # noqa: BLE001
                errors.append((c, turn, repr(e)))
                return

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.time()
    threads = [threading.Thread(target=chat, args=(c,)) for c in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    wall = time.time() - t0
    peaks = json.load(open(stats)) if os.path.exists(stats) else {}
    proc.terminate()
    proc.wait(timeout=60)
    json.dump({"protocol": vars(a), "load_average_start": load_start, "load_average_end": os.getloadavg(), "wall_s": round(wall, 1),
               "requests": len(latencies), "errors": errors, "latencies": latencies, "rss_mib": rss,
               "max_prompt_tokens": max((x[3] for x in latencies), default=0),
               "max_peak_slots": max((s["peak"] for s in peaks.values()), default=0),
               "max_held_blocks": max((s["held_blocks"] for s in peaks.values()), default=0)},
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
