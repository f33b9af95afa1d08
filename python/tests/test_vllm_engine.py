"""infkv's vLLM plugin on a real model (SmolLM2-135M, converted by scripts/vllm_model.sh) in vLLM's
CPU engine: with budgets larger than the prompt, outputs equal plain vLLM's token for token; with
StreamingLLM (sinks + recent) they equal a reference computed outside vLLM (transformers, eager
attention masked to exactly the slots infkv keeps, evicted at the same steps); every evicting
request stays within budget + one chunk and holds no more blocks than its kept slots need plus
one; bad per-request settings are refused naming the field; with prefix caching on, an evicting
request neither reads a cached prefix nor offers its blocks as one, while plain requests share as
in vLLM. Needs vLLM (scripts/vllm_test.sh)."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/vllm_test.sh runs this in its environment")

MODEL = os.environ.get("INFKV_VLLM_MODEL")
TEXT = os.environ.get("INFKV_TEXT")
CHUNK = 64  # max_num_batched_tokens: vLLM's chunked prefill gives the blocks

ENGINE = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
model, chunk, plugin, requests = sys.argv[1], int(sys.argv[2]), sys.argv[3] != "0", json.loads(sys.stdin.read())
extra = dict(worker_cls="infkv.vllm.engine.InfkvCPUWorker", scheduler_cls="infkv.vllm.engine.InfkvScheduler") if plugin else {}
llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=sys.argv[3] == "2",
          max_num_batched_tokens=chunk, max_num_seqs=4, gpu_memory_utilization=0.5, seed=0, **extra)
out = []
for r in requests:  # one request at a time: chunks of exactly `chunk` prompt tokens
    sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0, extra_args=r.get("xargs"))
    before = set()
    if plugin:
        from infkv.vllm.engine import channel
        before = set(channel.stats)
    o = llm.generate([{"prompt_token_ids": r["ids"]}], sp, use_tqdm=False)[0]
    stats = [v for k, v in channel.stats.items() if k not in before] if plugin else []
    out.append({"ids": list(o.outputs[0].token_ids), "stats": stats[0] if stats else None,
                "cached": o.num_cached_tokens})
print("RESULT " + json.dumps(out))
"""


def start_engine(requests, mode):
    """Runs ENGINE in its own process: mode "0" plain vLLM, "1" with the plugin, "2" the plugin
    with prefix caching on."""
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.run([sys.executable, "-c", ENGINE, MODEL, str(CHUNK), mode],
                          input=json.dumps(requests), capture_output=True, text=True, env=env, timeout=900,
                          cwd=os.path.dirname(MODEL))  # not python/: the installed package is the one imported


def run_engine(requests, plugin):
    p = start_engine(requests, "1" if plugin else "0")
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-4000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def prompts():
    if not MODEL or not TEXT:
        pytest.skip("INFKV_VLLM_MODEL and INFKV_TEXT are unset: scripts/vllm_test.sh sets them")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    text = open(TEXT).read()
    return [tok(text[a:a + 2400]).input_ids[:n] for a, n in ((0, 300), (5000, 420), (20000, 257))]


def streaming_reference(ids, budget, sinks, block, max_tokens):
    """Greedy decoding in transformers where every step attends to exactly the slots infkv's
    StreamingLLM keeps: vLLM's steps (prompt chunks of CHUNK, then one token), an eviction after a
    prompt chunk that leaves more than budget slots or a step that leaves budget + block (the sinks
    and the latest budget - sinks kept)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").eval()
    cache, kept, pos, out = DynamicCache(), [], 0, []
    steps = [ids[i:i + CHUNK] for i in range(0, len(ids), CHUNK)]
    with torch.no_grad():
        while len(out) < max_tokens:
            step = steps.pop(0) if steps else [out[-1]]
            q = len(step)
            mask = torch.full((1, 1, q, pos + q), float("-inf"))
            for i in range(q):
                mask[0, 0, i, kept] = 0.0
                mask[0, 0, i, pos:pos + i + 1] = 0.0
            logits = model(input_ids=torch.tensor([step]), position_ids=torch.arange(pos, pos + q)[None],
                           past_key_values=cache, attention_mask=mask, use_cache=True).logits
            kept += list(range(pos, pos + q))
            pos += q
            if len(kept) >= budget + block or (q > 1 and len(kept) > budget):
                kept = kept[:sinks] + kept[len(kept) - (budget - sinks):]
            if not steps:
                out.append(int(logits[0, -1].argmax()))
    return out


def test_plugin_equals_plain_vllm_when_nothing_is_evicted_and_streaming_llm_equals_its_reference(prompts):
    big = {"infkv_policy": "snapkv", "infkv_budget": 1024, "infkv_window": 8}
    stream = {"infkv_policy": "streaming_llm", "infkv_budget": 96, "infkv_sinks": 4, "infkv_block": 32}
    plain = run_engine([{"ids": p, "max_tokens": 24} for p in prompts], plugin=False)
    requests = [{"ids": p, "max_tokens": 24, "xargs": big} for p in prompts]
    requests += [{"ids": p, "max_tokens": 24, "xargs": stream} for p in prompts[:2]]
    got = run_engine(requests, plugin=True)
    for a, b in zip(plain, got[:3]):
        assert a["ids"] == b["ids"]  # token for token
        assert b["stats"]["evictions"] == 0
    for p, g in zip(prompts[:2], got[3:]):
        s = g["stats"]
        assert s["evictions"] >= 2 and s["evicted"] > 0
        assert s["peak"] <= 96 + max(32, CHUNK)  # budget + one chunk
        assert s["held_blocks"] <= -(-s["kept"] // 128) + 1
        assert g["ids"] == streaming_reference(p, 96, 4, 32, 24)


def test_bad_settings_name_the_field():
    from infkv.vllm.settings import parse

    with pytest.raises(ValueError, match=r"infkv_policy = 'nope'"):
        parse({"infkv_policy": "nope"})
    with pytest.raises(ValueError, match=r"infkv_budget = -3"):
        parse({"infkv_policy": "keydiff", "infkv_budget": -3})
    with pytest.raises(ValueError, match=r"infkv_budgte = 5: unknown field"):
        parse({"infkv_budgte": 5})
    with pytest.raises(ValueError, match=r"infkv_budget = 10: must hold the protected slots"):
        parse({"infkv_policy": "snapkv", "infkv_budget": 10, "infkv_window": 32})
    assert parse({"infkv_policy": "keydiff", "infkv_budget": "256"}).budget == 256
    assert not parse({}).evicts


def test_prefix_caching_shares_no_block_with_an_evicting_request(prompts):
    """Prefix caching on (vLLM's blocks of 128 tokens): a plain request hits the prefix an earlier
    plain one cached; an evicting request with that same prompt reads none of it (so it never
    writes a shared block) and still equals the reference; a plain request with the prompt an
    evicting request just ran finds nothing cached (the evicting request's rewritten blocks are
    never offered), and a second one hits what the first cached."""
    stream = {"infkv_policy": "streaming_llm", "infkv_budget": 96, "infkv_sinks": 4, "infkv_block": 32}
    a, b = prompts[0], prompts[1]
    p = start_engine([{"ids": a, "max_tokens": 4}, {"ids": a, "max_tokens": 4},
                      {"ids": a, "max_tokens": 24, "xargs": stream},
                      {"ids": b, "max_tokens": 24, "xargs": stream},
                      {"ids": b, "max_tokens": 4}, {"ids": b, "max_tokens": 4}], "2")
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr[-4000:]
    got = json.loads(line[-1][len("RESULT "):])
    assert got[0]["cached"] == 0 and got[1]["cached"] == 256  # prefix caching is on: two full blocks of a
    for g, ids in ((got[2], a), (got[3], b)):
        assert g["cached"] == 0  # the evicting request read no cached block
        assert g["stats"]["evictions"] >= 2
        assert g["ids"] == streaming_reference(ids, 96, 4, 32, 24)
    assert got[4]["cached"] == 0  # nothing of b was offered after the evicting request rewrote its blocks
    assert got[5]["cached"] == 384 and got[5]["ids"] == got[4]["ids"]  # b's three full blocks, from got[4]
