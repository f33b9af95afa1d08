"""`vllm serve` (vLLM's own OpenAI-compatible server) with infkv's plugin, driven by the real
`openai` client over loopback: concurrent streamed chats with long histories, each request
within its budget + one chunk (read back from the plugin's per-request stats); a client that
disconnects mid-stream; a malformed per-request setting answered with HTTP 400 naming the field;
and the server still serving afterwards. Prefix caching is on (vLLM's default). Needs vLLM
(scripts/vllm_test.sh)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/vllm_test.sh runs this in its environment")
openai = pytest.importorskip("openai")

MODEL = os.environ.get("INFKV_VLLM_MODEL")
TEXT = os.environ.get("INFKV_TEXT")
CHUNK = 256


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not MODEL or not TEXT:
        pytest.skip("INFKV_VLLM_MODEL and INFKV_TEXT are unset: scripts/vllm_test.sh sets them")
    port, work = free_port(), tmp_path_factory.mktemp("serve")
    stats = work / "stats.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               INFKV_VLLM_STATS=str(stats))
    log = open(work / "server.log", "w")
    # `vllm serve`, vLLM's own CLI, from the environment's scripts (scripts/vllm_env.sh).
    cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", MODEL, "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
           "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8",
           "--worker-cls", "infkv.vllm.engine.InfkvCPUWorker", "--scheduler-cls", "infkv.vllm.engine.InfkvScheduler",
           "--logits-processors", "infkv.vllm.engine:InfkvSettings"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, open(work / "server.log").read()[-4000:]
        try:
            if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        assert time.time() < deadline, "vllm serve did not come up in 300 s"
        time.sleep(2)
    yield {"client": openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=600), "stats": stats,
           "log": work / "server.log", "proc": proc}
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def history(offset, chars):
    text = open(TEXT).read()
    return [{"role": "user", "content": "Read this and answer briefly.\n" + text[offset:offset + chars]},
            {"role": "assistant", "content": "I have read it."},
            {"role": "user", "content": "Who is speaking in the last verse?"}]


def stream_chat(client, messages, xargs, max_tokens=32, stop_after=None):
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"vllm_xargs": xargs})
    text, chunks = "", 0
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            text += event.choices[0].delta.content
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            stream.close()  # the client goes away mid-stream
            break
    return text


def test_concurrent_streamed_chats_stay_within_budget_and_bad_settings_get_400(server):
    client = server["client"]
    budget, block = 256, 64
    xargs = [{"infkv_policy": p, "infkv_budget": budget, "infkv_block": block, "infkv_window": 16}
             for p in ("snapkv", "keydiff", "streaming_llm", "inf_mllm_bias")]
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = stream_chat(client, history(4000 * i, 6000), xargs[i])
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(len(results[i]) > 0 for i in range(4))
    stats = json.loads(server["stats"].read_text())
    evicting = [s for s in stats.values() if s["evictions"] > 0]
    assert len(evicting) >= 4
    for s in evicting:
        assert s["peak"] <= s["budget"] + max(s["block"], CHUNK)
        assert s["held_blocks"] <= -(-s["kept"] // 128) + 1

    # A client that disconnects mid-stream, then a request that must still be served.
    stream_chat(client, history(1000, 3000), xargs[0], max_tokens=64, stop_after=3)
    assert len(stream_chat(client, history(2000, 3000), xargs[1])) > 0

    # Malformed settings: 400 naming the field; the server keeps serving.
    for bad, field in (({"infkv_policy": "nope"}, "infkv_policy"), ({"infkv_policy": "snapkv", "infkv_budget": -5},
                                                                      "infkv_budget"),
                       ({"infkv_budgte": 3}, "infkv_budgte")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=history(0, 200), max_tokens=4,
                                           extra_body={"vllm_xargs": bad})
        assert field in str(e.value)
    assert len(stream_chat(client, history(3000, 2000), xargs[2])) > 0
    assert server["proc"].poll() is None
