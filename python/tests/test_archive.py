"""The archive and recall from Python: a round trip on synthetic arrays within each group's
quantization bound, clear errors, and on SmolLM2 a fact that eviction loses and recall brings back."""
import numpy as np
import pytest

import infkv


def test_archive_round_trip_within_the_bound():
    rng = np.random.default_rng(0)
    n, h, d = 10, 2, 8
    keys = rng.normal(size=(n, h, d)).astype(np.float32)
    values = rng.normal(size=(n, h, d)).astype(np.float32)
    toks = infkv.tokens(np.arange(100, 100 + n))
    a = infkv.Archive(n_layers=2, kv_heads=h, head_dim=d, capacity_bytes=1 << 20, page_tokens=4, key_bits=8,
                      value_bits=8)
    layer = infkv.Layer(toks, keys=keys, values=values)
    assert a.archive(layer, [np.array([0, 9], dtype=np.int64)], layer=1) == 2  # slots 1..8 evicted: two pages
    assert a.held_tokens == 8 and a.held_pages == 2
    pages = a.held()
    assert [list(a.page(p)["tokens"].positions) for p in pages] == [[101, 102, 103, 104], [105, 106, 107, 108]]
    assert all(a.page(p)["layer"] == 1 for p in pages)
    for p, first in zip(pages, (1, 5)):
        k, v = a.restore(p)
        assert k.shape == (1, 4, h, d)
        orig_k, orig_v = keys[first:first + 4], values[first:first + 4]
        # keys: one group per (head, channel) over the page's tokens; values: per (token, head)
        k_step = (orig_k.max(axis=0) - orig_k.min(axis=0)) / 255
        v_step = (orig_v.max(axis=2) - orig_v.min(axis=2)) / 255
        assert np.all(np.abs(k[0] - orig_k) <= k_step[None] * 0.51 + 1e-6)
        assert np.all(np.abs(v[0] - orig_v) <= v_step[..., None] * 0.51 + 1e-6)
    q = [rng.normal(size=(3, 4, d)).astype(np.float32) for _ in range(2)]
    b = a.bounds(q, 0.35)
    assert b.shape == (a.capacity_pages,)
    assert np.isfinite(b[pages]).all() and np.isneginf(np.delete(b, pages)).all()
    a.release(pages[0])
    assert a.held_pages == 1 and a.stats["released_tokens"] == 4


def test_archive_errors_name_the_argument():
    with pytest.raises(ValueError, match="archive_options.key_bits = 3"):
        infkv.Archive(n_layers=1, kv_heads=1, head_dim=8, capacity_bytes=1 << 20, key_bits=3)
    with pytest.raises(ValueError, match="when_full = 'later'"):
        infkv.Archive(n_layers=1, kv_heads=1, head_dim=8, capacity_bytes=1 << 20, when_full="later")
    a = infkv.Archive(n_layers=1, kv_heads=1, head_dim=8, capacity_bytes=1 << 20)
    with pytest.raises(ValueError, match="recall scores candidates against the queries"):
        infkv.Recaller(a, infkv.keydiff(), infkv.budget(capacity=64), budget_tokens=8, max_cache_slots=64,
                       q_heads=2, max_queries=8)
    # the recency bias can be left out of recall's scores (keyword accepted, the policy checked)
    infkv.Recaller(a, infkv.inf_mllm(), infkv.budget(capacity=64), budget_tokens=8, max_cache_slots=64, q_heads=2,
                   max_queries=8, recency_bias=False)
    # the layers that score and the position bound reach the recaller (checked there)
    with pytest.raises(ValueError, match="recall_options.layers.size\\(\\) = 1: selects the layers of a per_token"):
        infkv.Recaller(a, infkv.snapkv(), infkv.budget(capacity=64), budget_tokens=8, max_cache_slots=64, q_heads=2,
                       max_queries=8, layers=[0])
    t = infkv.Archive(n_layers=2, kv_heads=1, head_dim=8, capacity_bytes=1 << 20,
                      granularity=infkv.granularity.per_token)
    with pytest.raises(ValueError, match="recall_options.layers\\[1\\] = 1: must be ascending in \\[0, 2\\)"):
        infkv.Recaller(t, infkv.snapkv(), infkv.budget(capacity=64), budget_tokens=8, max_cache_slots=64, q_heads=2,
                       max_queries=8, layers=[1, 1])
    infkv.Recaller(t, infkv.snapkv(), infkv.budget(capacity=64), budget_tokens=8, max_cache_slots=64, q_heads=2,
                   max_queries=8, layers=[1], below=100)
    keys = np.full((6, 1, 8), np.nan, dtype=np.float32)
    layer = infkv.Layer(infkv.text_tokens(6), keys=keys, values=np.zeros_like(keys))
    with pytest.raises(ValueError, match="layers\\[0\\].keys at slot 1, head 0, channel 0 = nan"):
        a.archive(layer, [np.array([0], dtype=np.int64)])
    assert a.held_pages == 0


def test_recall_with_rotary_positions_and_distance_reaches_the_recaller():
    """rotary_pos (compact positions) is passed through and checked there: its length, the layers' RoPE."""
    rng = np.random.default_rng(1)
    n, h, d = 24, 1, 8
    a = infkv.Archive(n_layers=1, kv_heads=h, head_dim=d, capacity_bytes=1 << 20, page_tokens=4,
                      granularity=infkv.granularity.per_token)
    keys = rng.normal(size=(n, h, d)).astype(np.float32)
    a.archive(infkv.Layer(infkv.tokens(np.arange(1000, 1000 + n)), keys=keys, values=keys),
              [np.arange(16, n, dtype=np.int64)])
    cached = infkv.tokens(np.concatenate([np.arange(1000, 1004), np.arange(1016, 1024)]))
    ck = rng.normal(size=(12, h, d)).astype(np.float32)
    rope = infkv.rope(theta=10000.0)
    r = infkv.Recaller(a, infkv.snapkv(window=2, kernel=1), infkv.budget(capacity=12, sinks=2, recent=2),
                       budget_tokens=4, max_cache_slots=12, q_heads=1, max_queries=2)
    q = [rng.normal(size=(2, 1, d)).astype(np.float32)]
    qpos = np.array([1024, 1025], dtype=np.int64)
    layer = infkv.Layer(cached, keys=ck, values=ck, rotary=rope)
    pages, recalled, displaced = r.recall(a, [layer], q, qpos, 0.35, rotary_pos=np.arange(12, dtype=np.int64))
    assert len(recalled) == len(displaced) <= 4
    with pytest.raises(ValueError, match="rotary_pos.size\\(\\) = 3: must be 0 or the cache's 12 slots"):
        r.recall(a, [layer], q, qpos, 0.35, rotary_pos=np.arange(3, dtype=np.int64))
    with pytest.raises(ValueError, match="cache\\[0\\].rotary = unset"):
        r.recall(a, [infkv.Layer(cached, keys=ck, values=ck)], q, qpos, 0.35, rotary_pos=np.arange(12, dtype=np.int64))
    # position-agnostic ranking: `distance` reaches the recaller, in either position mode
    at = dict(budget_tokens=4, max_cache_slots=12, q_heads=1, max_queries=2)
    far = infkv.Recaller(a, infkv.snapkv(window=2, kernel=1), infkv.budget(capacity=12, sinks=2, recent=2),
                         distance=8, **at)
    pages, recalled, displaced = far.recall(a, [layer], q, qpos, 0.35)
    assert len(recalled) == len(displaced) <= 4
    with pytest.raises(ValueError, match="cache\\[0\\].rotary = unset: recall_options.distance turns"):
        far.recall(a, [infkv.Layer(cached, keys=ck, values=ck)], q, qpos, 0.35)
    with pytest.raises(ValueError, match="recall_options.distance = -1: must be >= 0"):
        infkv.Recaller(a, infkv.snapkv(window=2, kernel=1), infkv.budget(capacity=12, sinks=2, recent=2),
                       distance=-1, **at)


def test_recall_brings_back_what_eviction_lost(smollm2, kjv_text):
    """SmolLM2, a fact stated early in 1,667 tokens of KJV, a 256-slot cache evicted per block of
    128 (SnapKV): the fact is gone and the model answers wrong; with a 4-bit archive and recall
    before the question it answers right."""
    import torch

    from infkv.kvpress import prefill_blockwise, recall

    model, tok = smollm2
    pre = tok(kjv_text[20000:21000]).input_ids
    needle = tok(" Remember this: the secret code of the treasury is 7481.").input_ids
    post = tok(kjv_text[30000:36000]).input_ids[:1400]
    question = tok(" Question: what is the secret code of the treasury? Answer: the secret code of the treasury is"
                   ).input_ids
    ids = torch.tensor([pre + needle + post])
    at = (len(pre), len(pre) + len(needle))
    c = model.config
    heads, d = c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    policy, per_layer = infkv.snapkv(window=32), infkv.granularity.per_layer

    def answer(cache, press):
        end = max(e for _, e in press.positions.values())
        q = torch.tensor([question])
        out = model(input_ids=q, past_key_values=cache, position_ids=torch.arange(end, end + q.shape[1])[None])
        tokens, pos = [], end + q.shape[1]
        for _ in range(6):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=torch.tensor([[pos]]))
            pos += 1
        return tok.decode(tokens)

    def holding(press):  # layers whose cache holds a token of the fact
        return sum(bool(((p[0, 0] >= at[0]) & (p[0, 0] < at[1])).any()) for p, _ in press.positions.values())

    cache, press, _ = prefill_blockwise(model, ids, policy, 256, 128, sinks=4, granularity=per_layer)
    assert holding(press) <= 3  # of 30 layers
    assert "7481" not in answer(cache, press)

    archive = infkv.Archive(n_layers=c.num_hidden_layers, kv_heads=heads, head_dim=d, capacity_bytes=64 << 20)
    cache, press, _ = prefill_blockwise(model, ids, policy, 256, 128, sinks=4, granularity=per_layer, archive=archive)
    assert archive.held_tokens == c.num_hidden_layers * ids.shape[1]  # written through: every token, every layer
    recaller = infkv.Recaller(archive, policy, infkv.budget(capacity=256, sinks=4), budget_tokens=64,
                              max_cache_slots=256, q_heads=c.num_attention_heads, max_queries=64)
    stats = recall(model, cache, press, recaller, torch.tensor([question]))
    assert 0 < stats.tokens <= 64 * c.num_hidden_layers
    assert all(layer.keys.shape[2] == 256 for layer in cache.layers)  # the cache's size is unchanged
    s = archive.stats
    assert s["archived_tokens"] == archive.held_tokens == c.num_hidden_layers * ids.shape[1]  # the pages stay
    assert s["released_tokens"] == s["dropped_tokens"] == 0
    assert holding(press) >= c.num_hidden_layers // 3
    assert "7481" in answer(cache, press)
