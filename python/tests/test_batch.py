"""Batches from Python: one plan and one run over sequences of different lengths (keys per
sequence, or one paged cache) keep, for every sequence, what its own make_plan / run keeps; a
paged batch compacts in place with its page table rewritten and its freed pages returned (checked
by reading the rows back through the new table); bad batches raise ValueError naming the argument
and the sequence."""
import numpy as np
import pytest

import infkv

H, G, D, PAGE = 2, 2, 8, 4


def make_batch(seed, lengths=(37, 5, 64), nq=(4, 2, 6)):
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((n, H, D)).astype(np.float32) for n in lengths]
    queries = [rng.standard_normal((q, H * G, D)).astype(np.float32) for q in nq]
    qpos = [np.arange(n - q, n, dtype=np.int64) for n, q in zip(lengths, nq)]
    return keys, queries, qpos


def paged(keys, rng, values=None):
    """The sequences' rows in one page pool [pages, PAGE, H, D], pages shuffled, two spare."""
    counts = [(len(k) + PAGE - 1) // PAGE for k in keys]
    total = sum(counts) + 2
    ids = rng.permutation(total).astype(np.int32)
    pool = np.full((total, PAGE, H, D), np.nan, np.float32)
    vpool = None if values is None else pool.copy()
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    for s, k in enumerate(keys):
        for j in range(len(k)):
            page = ids[indptr[s] + j // PAGE]
            pool[page, j % PAGE] = k[j]
            if values is not None:
                vpool[page, j % PAGE] = values[s][j]
    last = np.array([len(k) - (c - 1) * PAGE for k, c in zip(keys, counts)], np.int32)
    table = (indptr, ids[: indptr[-1]].copy(), last)
    cache = infkv.PagedCache(pool, vpool, indptr=table[0], indices=table[1], last_page_len=table[2])
    return cache, pool, vpool, table


@pytest.mark.parametrize(
    "policy",
    [infkv.snapkv(window=2, kernel=3), infkv.inf_mllm(window=3, kernel=3), infkv.keydiff(), infkv.tova(), infkv.streaming_llm()],
    ids=str,
)
def test_batch_keeps_what_each_sequence_keeps_alone(policy):
    keys, queries, qpos = make_batch(1)
    budgets = [infkv.budget(capacity=12, sinks=2, recent=3), infkv.budget(capacity=3), infkv.budget(ratio=0.5, sinks=1)]
    slots = np.concatenate([[0], np.cumsum([len(k) for k in keys])]).astype(np.int64)
    qind = np.concatenate([[0], np.cumsum([len(q) for q in queries])]).astype(np.int64)
    toks = infkv.tokens(np.concatenate([np.arange(len(k)) for k in keys]))
    plan = infkv.make_batch_plan(policy, budgets, slot_indptr=slots, query_indptr=qind, kv_heads=H, q_heads=H * G,
                                 head_dim=D)
    q_all, qpos_all = np.concatenate(queries), np.concatenate(qpos)
    cache = paged(keys, np.random.default_rng(2))[0]
    for keys_arg in (keys, cache):
        got = infkv.run_batch(plan, infkv.BatchLayer(toks, keys=keys_arg, queries=q_all, query_pos=qpos_all))
        assert len(got) == 3
        for s, (k, q, p, b) in enumerate(zip(keys, queries, qpos, budgets)):
            layer = infkv.Layer(infkv.text_tokens(len(k)), keys=k, queries=q, query_pos=p)
            want = infkv.run(infkv.make_plan(policy, b, layer), layer)
            assert want.n_units == got[s].n_units
            for u in range(want.n_units):
                np.testing.assert_array_equal(got[s].unit(u), want.unit(u))
            assert sum(got[s].size(u) for u in range(got[s].n_units)) == plan.kept(s)


def test_compact_paged_keeps_rows_in_first_pages_and_frees_the_rest():
    rng = np.random.default_rng(3)
    keys, _, _ = make_batch(4, lengths=(13, 1, 22, 8))
    values = [-k for k in keys]
    cache, pool, vpool, (indptr, indices, last) = paged(keys, rng, values)
    old = [list(indices[indptr[s]:indptr[s + 1]]) for s in range(4)]
    toks = infkv.tokens(np.concatenate([100 * s + np.arange(len(k)) for s, k in enumerate(keys)]))
    keep_slots = [np.sort(rng.choice(len(k), size=m, replace=False)) for k, m in zip(keys, (5, 1, 22, 4))]
    keeps = [keep_from_mask(k, kept) for k, kept in zip(keys, keep_slots)]
    freed = infkv.compact_paged(cache, toks, keeps)  # rewrites indptr, indices and last in place
    held = []
    for s, kept in enumerate(keep_slots):
        pages = indices[indptr[s]:indptr[s + 1]]
        assert list(pages) == old[s][: len(pages)]
        assert len(pages) == (len(kept) + PAGE - 1) // PAGE
        assert cache.seq_len(s) == len(kept)
        held += list(pages)
        for i, j in enumerate(kept):
            np.testing.assert_array_equal(pool[pages[i // PAGE], i % PAGE], keys[s][j])
            np.testing.assert_array_equal(vpool[pages[i // PAGE], i % PAGE], values[s][j])
    assert sorted(held + list(freed)) == sorted(sum(old, []))
    want_pos = np.concatenate([100 * s + kept for s, kept in enumerate(keep_slots)])
    np.testing.assert_array_equal(toks.positions, want_pos)


def keep_from_mask(k, kept):
    """A KeepSet holding exactly `kept` (StreamingLLM's recent window over a cache whose tokens
    put the kept slots last)."""
    n = len(k)
    pos = np.zeros(n, np.int64)
    rest = [j for j in range(n) if j not in set(kept)]
    pos[rest] = np.arange(len(rest))
    pos[list(kept)] = len(rest) + np.arange(len(kept))
    return infkv.select(infkv.streaming_llm(), infkv.budget(capacity=len(kept), recent=len(kept)),
                        infkv.Layer(infkv.tokens(pos), keys=k))


def test_bad_batches_name_the_argument_and_the_sequence():
    keys, queries, qpos = make_batch(5)
    slots = np.array([0, 37, 42, 106], np.int64)
    qind = np.array([0, 4, 6, 12], np.int64)
    with pytest.raises(ValueError, match=r"budgets.size\(\) = 2"):
        infkv.make_batch_plan(infkv.snapkv(), [infkv.budget(capacity=4)] * 2, slot_indptr=slots, query_indptr=qind,
                              kv_heads=H, q_heads=H * G, head_dim=D)
    with pytest.raises(ValueError, match=r"sequence 1 of the batch: queries.n_slots = 0"):
        infkv.make_batch_plan(infkv.snapkv(window=2), infkv.budget(capacity=4), slot_indptr=slots,
                              query_indptr=np.array([0, 4, 4, 12]), kv_heads=H, q_heads=H * G, head_dim=D)
    with pytest.raises(ValueError, match=r"slot_indptr\[2\] = 30"):
        infkv.make_batch_plan(infkv.keydiff(), infkv.budget(capacity=4), slot_indptr=np.array([0, 37, 30, 40]),
                              kv_heads=H, head_dim=D)
    plan = infkv.make_batch_plan(infkv.keydiff(), infkv.budget(capacity=4), slot_indptr=slots, kv_heads=H, head_dim=D)
    toks = infkv.text_tokens(106)
    with pytest.raises(ValueError, match=r"layers\[0\].keys.size\(\) = 2"):
        infkv.run_batch(plan, infkv.BatchLayer(toks, keys=keys[:2]))
    with pytest.raises(ValueError, match=r"sequence 2 of the batch: .*keys.n_slots"):
        infkv.run_batch(plan, infkv.BatchLayer(toks, keys=[keys[0], keys[1], keys[2][:10]]))
    cache = paged(keys, np.random.default_rng(0))[0]
    with pytest.raises(ValueError, match=r"len\(keeps\) = 1"):
        infkv.compact_paged(cache, toks, [keep_from_mask(keys[0], [1])])
