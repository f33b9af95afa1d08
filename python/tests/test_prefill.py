"""Budgeted block-wise prefill in transformers and InfkvPress inside kvpress's DecodingPress, on
SmolLM2-135M and the King James text."""
import numpy as np
import pytest
import torch

pytest.importorskip("kvpress")
from kvpress import DecodingPress  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import infkv  # noqa: E402
from infkv.kvpress import InfkvPress, block_bounds, prefill_blockwise  # noqa: E402


@pytest.fixture(scope="module")
def ids(smollm2, kjv_text):
    _, tok = smollm2
    return tok(kjv_text[:8000], return_tensors="pt").input_ids[:, :1200]


def slot_bytes(model):
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def test_block_bounds_follow_segments():
    assert block_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    seg = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3]
    # whole segments, at most a block each; a segment longer than a block is a block alone
    assert block_bounds(11, 4, seg) == [(0, 3), (3, 5), (5, 10), (10, 11)]
    assert block_bounds(11, 6, seg) == [(0, 5), (5, 11)]
    with pytest.raises(ValueError, match="segments: must be non-decreasing"):
        block_bounds(3, 2, [1, 0, 0])
    with pytest.raises(ValueError, match="block = 0"):
        block_bounds(3, 0)


def test_without_eviction_blocks_give_the_full_prefill(smollm2, ids):
    """A capacity above the prompt evicts nothing: block by block must then equal one forward pass
    (positions and the causal mask carried across blocks)."""
    model, _ = smollm2
    with torch.no_grad():
        full = model(ids, past_key_values=DynamicCache()).logits[0, -1]
        cache, _, stats = prefill_blockwise(model, ids[:, :-1], infkv.snapkv(window=32), capacity=4096, block=300)
        last = model(ids[:, -1:], past_key_values=cache,
                     position_ids=torch.tensor([[ids.shape[1] - 1]])).logits[0, -1]
    assert stats.blocks == 4 and stats.kept == [ids.shape[1] - 1] * model.config.num_hidden_layers
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", [infkv.snapkv(window=32), infkv.keydiff(), infkv.streaming_llm(),
                                    infkv.inf_mllm(window=32, bias=infkv.attention_bias(beta=1.0)),
                                    infkv.expected_attention(window=32)])
def test_peak_kv_stays_at_budget_plus_one_block(smollm2, ids, policy):
    model, _ = smollm2
    cap, block = 256, 128
    cache, press, stats = prefill_blockwise(model, ids, policy, capacity=cap, block=block, sinks=4)
    layers = model.config.num_hidden_layers
    assert stats.kept == [cap] * layers
    assert stats.final_kv_bytes == cap * slot_bytes(model)
    # before a layer's eviction it holds cap + one block, every other layer at most cap
    assert stats.peak_kv_bytes <= (cap + block / layers) * slot_bytes(model)
    heads = model.config.num_key_value_heads
    for layer in range(layers):
        pos, nxt = press.positions[layer]
        assert nxt == ids.shape[1] and pos.shape == (1, heads, cap)
        assert torch.all(pos[..., 1:] > pos[..., :-1])  # each head's slots in time order
        assert torch.equal(pos[..., :4], torch.arange(4).expand(1, heads, 4))  # sinks kept
    # layer 0's keys depend only on each token and its position: every kept key must be the one the
    # full prefill computed at the position the press recorded for it, in every head
    with torch.no_grad():
        full = DynamicCache()
        model.model(input_ids=ids, past_key_values=full)
    pos = press.positions[0][0][0]  # (heads, cap)
    want = full.layers[0].keys[0].gather(1, pos.unsqueeze(-1).expand(-1, -1, full.layers[0].keys.shape[-1]))
    torch.testing.assert_close(cache.layers[0].keys[0], want, rtol=1e-4, atol=1e-4)
    # the model decodes on from the bounded cache
    with torch.no_grad():
        out = model(ids[:, -1:], past_key_values=cache, position_ids=torch.tensor([[ids.shape[1]]])).logits
    assert torch.isfinite(out).all()


def test_budget_below_the_protected_tokens_is_refused(smollm2, ids):
    model, _ = smollm2
    with pytest.raises(ValueError, match=r"budget.capacity = 16: cannot hold its protected tokens"):
        prefill_blockwise(model, ids, infkv.snapkv(window=32), capacity=16, block=64)


def test_decoding_press_keeps_the_cache_bounded(smollm2, ids):
    model, _ = smollm2
    press = DecodingPress(base_press=InfkvPress(policy=infkv.snapkv(window=16)), compression_interval=8,
                          target_size=96)
    cache = DynamicCache()
    sizes = []
    with torch.no_grad(), press(model):
        out = model(ids[:, :200], past_key_values=cache)
        token = out.logits[0, -1].argmax().view(1, 1)
        for i in range(40):
            out = model(token, past_key_values=cache, position_ids=torch.tensor([[200 + i]]))
            token = out.logits[0, -1].argmax().view(1, 1)
            sizes.append(cache.get_seq_length())
    assert sizes[7] == 96  # the 8th decoded token triggers the first compression of the 208 slots
    assert max(sizes[8:]) <= 96 + 8 and sizes[-1] in range(96, 105)
    pos, nxt = press.base_press.positions[0]
    assert nxt == 240 and torch.all(pos[..., -1] == 239) and torch.all(pos[..., 1:] > pos[..., :-1])


@pytest.fixture(scope="module")
def question(smollm2):
    _, tok = smollm2
    return tok("\nQuestion: What did Moses say unto the people?\nMoses said", return_tensors="pt",
               add_special_tokens=False).input_ids


def test_proxy_queries_are_the_question_after_the_context(smollm2, ids, question):
    """after_cache, one block: every layer and head keeps what infkv.select keeps for the question's queries as
    one forward over the context and the question computes them (transformers' own q_proj and
    rotary, at the positions after the context), which differs from what the context's own window
    keeps."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, _ = smollm2
    n, cap, policy = 600, 256, infkv.snapkv(window=16)
    q = question.shape[1]
    lm = model.model
    hidden = {}

    def grab(module, args, kwargs, output):
        hidden[module.layer_idx] = kwargs["hidden_states"]
        return output

    handles = [layer.self_attn.register_forward_hook(grab, with_kwargs=True) for layer in lm.layers]
    try:
        with torch.no_grad():
            full = DynamicCache()
            lm(input_ids=torch.cat([ids[:, :n], question], dim=1), past_key_values=full)
    finally:
        for h in handles:
            h.remove()
    cache, press, _ = prefill_blockwise(model, ids[:, :n], policy, capacity=cap, block=n, question_ids=question,
                                        proxy="after_cache")
    _, plain, _ = prefill_blockwise(model, ids[:, :n], policy, capacity=cap, block=n)
    bud = infkv.budget(capacity=cap)
    differs = 0
    for layer, block in enumerate(lm.layers):
        attn = block.self_attn
        d = attn.head_dim
        qs = attn.q_proj(hidden[layer][:, n:]).view(1, q, -1, d).transpose(1, 2)
        cos, sin = lm.rotary_emb(qs, torch.arange(n, n + q).unsqueeze(0))
        qs, _ = apply_rotary_pos_emb(qs, qs, cos, sin)
        w = min(16, q)
        keys = full.layers[layer].keys[0, :, :n]
        want = infkv.select(policy, bud, infkv.Layer(
            infkv.tokens(torch.arange(n)), keys=keys.detach(), queries=qs[0, :, -w:].detach().contiguous(),
            query_pos=np.arange(n + q - w, n + q), scale=float(attn.scaling), layout="hnd"))
        got = press.positions[layer][0][0]  # (KV heads, kept): SnapKV keeps per head
        for h in range(got.shape[0]):
            assert sorted(got[h].tolist()) == sorted(want.unit(h).tolist()), f"layer {layer}, head {h}"
        differs += not torch.equal(got, plain.positions[layer][0][0])
    assert differs > 0


@pytest.mark.parametrize("proxy", ["alone", "after_cache"])
def test_prefill_with_a_question_stays_bounded(smollm2, ids, question, proxy):
    model, _ = smollm2
    cap, block, layers = 256, 128, model.config.num_hidden_layers
    policy = infkv.inf_mllm(window=32, bias=infkv.attention_bias(beta=1.0))
    cache, press, stats = prefill_blockwise(model, ids, policy, capacity=cap, block=block, sinks=4,
                                            question_ids=question, proxy=proxy)
    _, plain, _ = prefill_blockwise(model, ids, policy, capacity=cap, block=block, sinks=4)
    assert stats.kept == [cap] * layers and press.question is None
    extra = block / layers if proxy == "alone" else block + question.shape[1]
    assert stats.peak_kv_bytes <= (cap + extra) * slot_bytes(model)
    assert any(not torch.equal(press.positions[i][0], plain.positions[i][0]) for i in range(layers))
    with torch.no_grad():  # the question then decodes from the bounded cache
        out = model(question, past_key_values=cache,
                    position_ids=torch.arange(ids.shape[1], ids.shape[1] + question.shape[1]).unsqueeze(0)).logits
    assert torch.isfinite(out).all()


def test_prefill_refuses_a_question_it_cannot_use(smollm2, ids, question):
    model, _ = smollm2
    with pytest.raises(ValueError, match="reads no window queries"):
        prefill_blockwise(model, ids, infkv.keydiff(), capacity=256, block=128, question_ids=question)
    with pytest.raises(ValueError, match="proxy = 'later'"):
        prefill_blockwise(model, ids, infkv.snapkv(), capacity=256, block=128, question_ids=question, proxy="later")
    with pytest.raises(ValueError, match=r"question_ids.shape = \(1, 0\)"):
        prefill_blockwise(model, ids, infkv.snapkv(), capacity=256, block=128, question_ids=ids[:, :0])
