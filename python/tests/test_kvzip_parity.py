"""Context-reconstruction scores (KVzip) against kvpress's own KVzipPress on a real model:
SmolLM2-135M in transformers, the first 1,024 tokens of the King James text, reconstructed in two
chunks of 512 (the second with kvpress's "starting with" prompt). While kvpress's press runs its
reconstruction passes, a hook on every layer hands the same passes' queries and keys to
`infkv.reconstruction_scores` (the largest probability any query of a KV head's group gives each
key, over the sinks, the chunk and the reconstruction's own keys). Every score must equal kvpress's
to float32 rounding, and kvpress's rule applied to infkv's scores (the sinks kept, the lowest half
of all layers' and heads' pairs pruned) must prune the pairs kvpress prunes, except pairs tied at
its cut."""
import os

import numpy as np
import pytest
import torch

kvpress = pytest.importorskip("kvpress")
from kvpress import KVzipPress  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import infkv  # noqa: E402
from infkv.kvpress import _hooks, _queries  # noqa: E402

N = 1024
CHUNK = 512
RATIO = 0.5


@pytest.fixture(scope="module")
def kvzip_runs(smollm2, kjv_text, tmp_path_factory):
    model, tok = smollm2
    ids = tok(kjv_text[: 12 * N], return_tensors="pt").input_ids[:, :N]
    assert ids.shape[1] == N
    # KVzip reads the tokenizer by the model's name_or_path for its repeat prompt; raw text, no chat template
    saved = str(tmp_path_factory.mktemp("tokenizer"))
    raw = tok.__class__.from_pretrained(os.path.dirname(os.path.abspath(os.environ["INFKV_MODEL"])),
                                        gguf_file=os.path.basename(os.environ["INFKV_MODEL"]))
    raw.chat_template = None
    raw.save_pretrained(saved)
    old_name = model.config.name_or_path
    model.config.name_or_path = saved

    press = KVzipPress(compression_ratio=RATIO, chunk_size=CHUNK)
    cache = DynamicCache()
    n_layers = model.config.num_hidden_layers
    ours = np.full((n_layers, model.config.num_key_value_heads, N), np.nan, dtype=np.float32)
    seen = {"passes": 0}

    def hook(module, args, kwargs, output):  # registered before kvpress's: the cache still holds the pass's keys
        if press.end_idx == 0:
            return output  # the prefill
        layer = module.layer_idx
        hs = kwargs["hidden_states"]
        q_len = hs.shape[1]
        keys = cache.layers[layer].keys[0]  # [kv heads, context + pass, d]
        start, end, ctx = press.start_idx, press.end_idx, press.context_length
        sink = min(press.n_sink, start)
        sub = torch.cat([keys[:, :sink], keys[:, start:end], keys[:, -q_len:]], dim=1).float().contiguous()
        qpos = torch.arange(ctx, ctx + q_len)
        q = _queries(module, hs, qpos)[0].float().contiguous()  # [q heads, pass, d]
        key_pos = np.concatenate([np.arange(sink), np.arange(start, end), np.arange(ctx, ctx + q_len)]).astype(np.int64)
        lay = infkv.Layer(infkv.Tokens.from_arrays(key_pos), keys=sub.numpy(), queries=q.numpy(),
                          query_pos=qpos.numpy().astype(np.int64), layout="hnd")
        s = infkv.reconstruction_scores(lay)
        ours[layer][:, start:end] = s[:, sink:sink + end - start]
        seen["passes"] += layer == 0
        return output

    original = press.compress_post

    def spy(m):
        seen["scores"] = press.score_val[:, 0].float().clone().numpy()  # [layers, kv heads, N]
        original(m)
        seen["pruned"] = [tuple(t.numpy() for t in layer.self_attn.masked_key_indices) for layer in m.model.layers]

    press.compress_post = spy
    try:
        with torch.no_grad(), _hooks(model, hook), press(model):
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        model.config.name_or_path = old_name
        for layer in model.model.layers:  # kvpress's masks must not reach the other tests
            if hasattr(layer.self_attn, "masked_key_indices"):
                del layer.self_attn.masked_key_indices
    return ours, seen


def test_reconstruction_scores_equal_kvpress_kvzip(kvzip_runs):
    ours, seen = kvzip_runs
    assert seen["passes"] == N // CHUNK
    theirs = seen["scores"]
    assert not np.isnan(ours).any(), "a context slot was scored by no reconstruction pass"
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-6)
    assert (ours.max(axis=2) > 0.05).all(), "every head should attend clearly to some context pair"


def test_kvzip_rule_on_infkv_scores_prunes_what_kvpress_prunes(kvzip_runs):
    ours, seen = kvzip_runs
    n_layers, heads, n = ours.shape
    # kvpress's compress_post: sinks given the maximum + 1, the lowest RATIO of all pairs pruned
    s = ours.copy()
    s[..., :4] = s.max() + 1.0
    flat = s.reshape(-1)
    k = int(flat.size * RATIO)
    mine = set(np.argpartition(flat, k - 1)[:k].tolist())
    theirs = set()
    for layer, (_, head, slot) in enumerate(seen["pruned"]):
        theirs.update((layer * heads * n + head * n + slot).tolist())
    assert len(theirs) == k
    cut = float(np.sort(flat)[k - 1])
    differ = mine ^ theirs
    far = [i for i in differ if abs(float(flat[i]) - cut) > 1e-3 * cut]
    print(f"\nKVzip: {len(mine & theirs)} of {k} pruned pairs shared with kvpress; {len(differ)} differ, all "
          f"within 0.1% of the cut {cut:.6g}")
    assert not far, f"pairs pruned by one side only, not tied at the cut {cut}: {far[:8]}"
    assert len(differ) <= k // 1000
