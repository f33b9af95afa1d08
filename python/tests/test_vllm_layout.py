"""infkv on vLLM's own CPU KV cache, with vLLM's own kernels: rows written by vLLM's cache-write op
read back exactly through infkv.vllm.CpuKVLayout, for the kernel variant vLLM picks on this CPU
(AMX for bf16 where the CPU has it) and for the portable "vec" one; a batch plan over keys read out of vLLM's
buffer keeps what infkv keeps on the original keys; after each request's kept rows are compacted
to the front of its blocks and the rest of its blocks dropped from its block table, vLLM's CPU
attention over (kept + one new token) equals a float64 reference of attention over exactly those
tokens. Needs vLLM (scripts/vllm_test.sh runs this file in vLLM's environment)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/vllm_test.sh runs this in its environment")
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

import infkv  # noqa: E402
from infkv.vllm import CpuKVLayout  # noqa: E402

H, G, D, B = 2, 3, 64, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("isa", ["this CPU's", "vec"])
def test_layout_reads_back_what_vllm_writes(dtype, block_size, isa):
    CpuKVLayout.check(dtype, block_size, D, _get_attn_isa(dtype, block_size, D, "auto") if isa != "vec" else isa)


def test_a_layout_that_does_not_store_elements_as_they_are_is_refused():
    # an fp8 cache (one byte per element, scaled) is refused by its dtype
    with pytest.raises(ValueError, match="kv_cache.dtype"):
        CpuKVLayout(torch.zeros(2, H, B, 2 * D, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vllm_attention_over_compacted_requests_is_attention_over_the_kept_tokens(dtype):
    isa = _get_attn_isa(dtype, B, D, "auto")  # AMX for bf16 where this CPU has it
    gen = torch.Generator().manual_seed(0)
    lengths, window = [150, 40, 300], 8
    n_blocks = sum((n + 1 + B - 1) // B for n in lengths) + 4
    cache = torch.zeros(n_blocks, H, B, 2 * D, dtype=dtype)
    kc, vc = cache.view(n_blocks, H, 2 * B, D).chunk(2, dim=2)
    layout = CpuKVLayout(cache, isa)
    ids = torch.randperm(n_blocks - 1, generator=gen) + 1  # block 0 is vLLM's null block
    blocks, keys, values, queries, at = [], [], [], [], 0
    for n in lengths:
        need = (n + 1 + B - 1) // B
        blocks.append(ids[at:at + need].tolist())
        at += need
        k, v = torch.randn(n, H, D, generator=gen).to(dtype), torch.randn(n, H, D, generator=gen).to(dtype)
        slots = torch.tensor([blocks[-1][i // B] * B + i % B for i in range(n)])
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
        keys.append(k), values.append(v), queries.append(torch.randn(window, H * G, D, generator=gen))
    read = [layout.read(b, n) for b, n in zip(blocks, lengths)]
    for (rk, rv), k, v in zip(read, keys, values):
        assert torch.equal(rk, k) and torch.equal(rv, v)
    # One batch plan over the keys read out of vLLM's buffer.
    policy = infkv.snapkv(window=window, kernel=3)
    budgets = [infkv.budget(capacity=64, sinks=4), infkv.budget(capacity=64, sinks=4), infkv.budget(ratio=0.25, sinks=4)]
    slot_indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    query_indptr = np.arange(len(lengths) + 1, dtype=np.int64) * window
    qpos = np.concatenate([np.arange(n - window, n) for n in lengths]).astype(np.int64)
    toks = infkv.tokens(np.concatenate([np.arange(n) for n in lengths]))
    plan = infkv.make_batch_plan(policy, budgets, slot_indptr=slot_indptr, query_indptr=query_indptr, kv_heads=H,
                                 q_heads=H * G, head_dim=D, options=infkv.plan_options(granularity=infkv.granularity.per_token))
    keeps = infkv.run_batch(plan, infkv.BatchLayer(toks, keys=[rk.float().numpy() for rk, _ in read],
                                                   queries=torch.cat(queries).numpy(), query_pos=qpos))
    for s, (k, q) in enumerate(zip(keys, queries)):
        layer = infkv.Layer(infkv.text_tokens(lengths[s]), keys=k.float().numpy(), queries=q.numpy(),
                            query_pos=qpos[s * window:(s + 1) * window])
        alone = infkv.select(policy, budgets[s], layer, granularity=infkv.granularity.per_token)
        np.testing.assert_array_equal(keeps[s].unit(0), alone.unit(0))
    # Compact each request in its own blocks; one new token per request goes after the kept ones.
    kept = [keep.unit(0) for keep in keeps]
    new_k, new_v = (torch.randn(3, H, D, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(3, H * G, D, generator=gen).to(dtype)
    rows, seq_lens = [], []
    for s, b in enumerate(blocks):
        need = layout.compact(b, kept[s])
        m = len(kept[s])
        slot = b[m // B] * B + m % B
        ops.cpu_attn_reshape_and_cache(new_k[s:s + 1], new_v[s:s + 1], kc, vc, torch.tensor([slot]), isa)
        live = b[:(m + 1 + B - 1) // B]
        assert len(live) <= need + 1
        rows.append(live)
        seq_lens.append(m + 1)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    out = torch.empty(3, H * G, D, dtype=dtype)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=3, num_heads=H * G, num_kv_heads=H, head_dim=D, seq_lens=seq,
                                               dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
                                               isa=isa, enable_kv_split=True)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
                                    seq_lens=seq, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
                                    block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    for s in range(3):  # float64 reference over exactly the kept tokens and the new one
        k = torch.cat([keys[s][kept[s]], new_k[s:s + 1]]).double().repeat_interleave(G, 1)
        v = torch.cat([values[s][kept[s]], new_v[s:s + 1]]).double().repeat_interleave(G, 1)
        p = (torch.einsum("hd,khd->hk", q[s].double(), k) * D ** -0.5).softmax(-1)
        ref = torch.einsum("hk,khd->hd", p, v)
        assert (out[s].double() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)
