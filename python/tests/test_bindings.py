"""The module against independent NumPy float64 references of the policies' definitions, and its
handling of bad input (ValueError naming the argument)."""
import re

import numpy as np
import pytest

import infkv

rng = np.random.default_rng(7)


def keydiff_ref(keys):  # keys [n, h, d]: -cos(k_j, mean of unit keys) per head
    k = keys.astype(np.float64)
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    anchor = unit.mean(axis=0)  # [h, d]
    cos = (unit * (anchor / np.linalg.norm(anchor, axis=-1, keepdims=True))).sum(-1)
    return -cos.T  # [h, n]


def window_attention_ref(keys, queries, qpos, kpos, group):  # mass per query head [hq, n]
    n, h, d = keys.shape
    hq = queries.shape[1]
    out = np.zeros((hq, n))
    for qh in range(hq):
        k = keys[:, qh // group].astype(np.float64)
        for i, p in enumerate(qpos):
            logit = k @ queries[i, qh].astype(np.float64) / np.sqrt(d)
            logit[kpos > p] = -np.inf
            e = np.exp(logit - logit.max())
            out[qh] += e / e.sum()
    return out


def top_keep(scores, kpos, cap, sinks=0, recent=0):
    """infkv's selection from the definition: protected sinks and recent positions, then the best
    scores (higher first, then newer position, then lower slot)."""
    n = scores.size
    order = np.lexsort((np.arange(n), kpos))  # time order
    keep = set(order[:sinks]) | set(order[n - recent:] if recent else [])
    rest = sorted((i for i in range(n) if i not in keep), key=lambda i: (-scores[i], -kpos[i], i))
    keep |= set(rest[: cap - len(keep)])
    return np.array(sorted(keep))


def test_keydiff_matches_reference_in_both_layouts_and_dtypes():
    n, h, d = 300, 3, 32
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    toks = infkv.text_tokens(n)
    ref = keydiff_ref(keys)
    for arr, layout in ((keys, "nhd"), (np.ascontiguousarray(keys.transpose(1, 0, 2)), "hnd")):
        layer = infkv.Layer(toks, keys=arr, layout=layout)
        plan = infkv.make_plan(infkv.keydiff(), infkv.budget(ratio=1.0), layer)
        np.testing.assert_allclose(infkv.run_scores(plan, layer), ref, rtol=0, atol=2e-6)
        ks = infkv.select(infkv.keydiff(), infkv.budget(capacity=50, sinks=3), layer)
        assert ks.n_units == h
        for u in range(h):
            np.testing.assert_array_equal(ks.unit(u), top_keep(ref[u], np.arange(n), 50, sinks=3))


def test_snapkv_window_attention_and_torch_tensors():
    torch = pytest.importorskip("torch")
    n, h, g, d, w = 200, 2, 3, 16, 8
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    queries = rng.standard_normal((w, h * g, d)).astype(np.float32)
    qpos = np.arange(n - w, n, dtype=np.int64)
    layer = infkv.Layer(infkv.text_tokens(n), keys=torch.from_numpy(keys), queries=torch.from_numpy(queries),
                        query_pos=qpos)
    pol = infkv.snapkv(window=w, kernel=1)  # no pooling: the window attention mass, group mean
    mass = window_attention_ref(keys, queries, qpos, np.arange(n), g).reshape(h, g, n).mean(1)
    got = infkv.run_scores(infkv.make_plan(pol, infkv.budget(ratio=1.0), layer), layer)
    pre = n - w  # the window gets its row's mean (it is protected by position)
    np.testing.assert_allclose(got[:, :pre] / mass[:, :pre], got[0, 0] / mass[0, 0], rtol=2e-5)
    ks = infkv.select(pol, infkv.budget(capacity=40), layer)
    for u in range(h):
        np.testing.assert_array_equal(ks.unit(u), top_keep(mass[u], np.arange(n), 40, recent=w))


def test_plan_run_and_keep_set_agree_with_select():
    n, h, d = 128, 2, 8
    keys = rng.standard_normal((n, h, d)).astype(np.float16)
    toks = infkv.text_tokens(n, first=1000)
    layer = infkv.Layer(toks, keys=keys)
    plan = infkv.make_plan(infkv.keydiff(), infkv.budget(capacity=32), layer,
                           infkv.plan_options(granularity=infkv.granularity.per_layer))
    assert (plan.units, plan.keep_per_unit, plan.kept_total, plan.evicts()) == (1, 32, 32, True)
    ks = infkv.run(plan, [layer])
    assert ks.n_units == 1 and ks.size(0) == 32 and ks.mask(0).sum() == 32
    same = infkv.select(infkv.keydiff(), infkv.budget(capacity=32), layer, granularity=infkv.granularity.per_layer)
    np.testing.assert_array_equal(ks.unit(0), same.unit(0))


def test_compact_and_rerotate_in_place():
    n, h, d = 64, 2, 8
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    values = rng.standard_normal((n, h, d)).astype(np.float32)
    k0, v0 = keys.copy(), values.copy()
    toks = infkv.text_tokens(n, first=10)
    ks = infkv.select(infkv.streaming_llm(), infkv.budget(capacity=16, sinks=4), infkv.Layer(toks, keys=keys))
    kept = ks.unit(0)
    np.testing.assert_array_equal(kept, np.r_[0:4, n - 12:n])
    m = infkv.compact(keys, values, toks, ks)
    assert m == 16 and len(toks) == 16
    np.testing.assert_array_equal(keys[:m], k0[kept])
    np.testing.assert_array_equal(values[:m], v0[kept])
    np.testing.assert_array_equal(toks.positions, 10 + kept)
    delta = infkv.compact_positions(toks)
    np.testing.assert_array_equal(toks.positions, np.arange(16))
    np.testing.assert_array_equal(delta, np.arange(16) - 10 - kept)
    r = infkv.rope(theta=10000.0, style=infkv.rope_style.normal)
    before = keys[:m].copy()
    infkv.rerotate(keys[:m], delta, r)  # a view of the kept rows, turned in place
    # reference: pair (2i, 2i+1) of slot j turned by delta[j] * theta^(-2i/d)
    f = 10000.0 ** (-np.arange(d // 2) * 2.0 / d)
    ang = delta[:, None] * f[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = before[..., 0::2].astype(np.float64), before[..., 1::2].astype(np.float64)
    np.testing.assert_allclose(keys[:m, :, 0::2], x0 * c - x1 * s, atol=2e-5)
    np.testing.assert_allclose(keys[:m, :, 1::2], x0 * s + x1 * c, atol=2e-5)


def test_compact_positions_max_gap():
    # kept: positions 10-13 and 30-41 (a gap of 16 free positions between them)
    keys = np.zeros((32, 1, 8), np.float32)
    toks = infkv.text_tokens(32, first=10)
    ks = infkv.select(infkv.streaming_llm(), infkv.budget(capacity=16, sinks=4), infkv.Layer(toks, keys=keys))
    infkv.compact(keys, None, toks, ks)
    np.testing.assert_array_equal(toks.positions, np.r_[10:14, 30:42])
    delta = infkv.compact_positions(toks, max_gap=3)  # the gap narrowed to 3 free positions
    np.testing.assert_array_equal(toks.positions, np.r_[0:4, 7:19])
    np.testing.assert_array_equal(delta, np.r_[[-10] * 4, [-23] * 12])
    with pytest.raises(ValueError, match="max_gap = -1"):
        infkv.compact_positions(toks, max_gap=-1)


def test_capture_needs_and_protection():
    needs = infkv.capture_needs_of(infkv.snapkv(window=16))
    assert needs.keys and not needs.values and needs.queries == 16 and needs.observes()
    assert not infkv.capture_needs_of(infkv.streaming_llm()).observes()
    ea = infkv.capture_needs_of(infkv.expected_attention())
    assert ea.values and ea.rope and ea.queries == 64
    assert infkv.natural_granularity(infkv.tova()) == infkv.granularity.per_layer
    assert infkv.natural_granularity(infkv.keydiff()) == infkv.granularity.per_head
    b = infkv.protect(infkv.snapkv(window=16), infkv.budget(capacity=100, recent=4))
    assert (b.capacity, b.recent) == (100, 16)


@pytest.mark.parametrize("call, needle", [
    (lambda: infkv.budget(capacity=3, sinks=4), "budget.capacity = 3"),
    (lambda: infkv.budget(capacity=5, ratio=0.5), "budget.capacity = 5"),
    (lambda: infkv.snapkv(kernel=4), "snapkv.kernel = 4"),
    (lambda: infkv.Layer(infkv.text_tokens(4), keys=np.zeros((4, 1, 8), np.int32)), "keys.dtype = int32"),
    (lambda: infkv.Layer(infkv.text_tokens(4), keys=np.zeros((4, 8), np.float32)), "keys.ndim = 2"),
    (lambda: infkv.Layer(infkv.text_tokens(4), keys=np.zeros((4, 8, 2), np.float32).transpose(0, 2, 1)),
     "keys.stride(2)"),
    (lambda: infkv.Layer(infkv.text_tokens(5), keys=np.zeros((4, 1, 8), np.float32)), "tokens = 5"),
    (lambda: infkv.Layer(infkv.text_tokens(4), keys=np.zeros((4, 1, 8), np.float32), layout="ndh"), "layout"),
    (lambda: infkv.tokens([0, -1]), "positions[1].pos = -1"),
    (lambda: infkv.make_plan(infkv.snapkv(), infkv.budget(capacity=40),
                             infkv.Layer(infkv.text_tokens(64), keys=np.zeros((64, 1, 8), np.float32))),
     "queries.n_slots = 0"),
    (lambda: infkv.make_plan(infkv.keydiff(), infkv.budget(capacity=8, recent=4), infkv.LayerShape(n_slots=64),
                             infkv.plan_options(adakv=infkv.adakv(alpha=2.0))), "adakv.alpha = 2"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        call()


def test_nan_keys_raise():
    keys = np.ones((16, 1, 8), np.float32)
    keys[5, 0, 3] = np.nan
    layer = infkv.Layer(infkv.text_tokens(16), keys=keys)
    with pytest.raises(ValueError, match=r"keys\[slot 5, head 0\]"):
        infkv.select(infkv.keydiff(), infkv.budget(capacity=4), layer)


def test_cuda_tensor_is_refused_clearly():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(ValueError, match="keys.device = cuda"):
        infkv.Layer(infkv.text_tokens(4), keys=torch.zeros((4, 1, 8), device="cuda"))


def test_threads_belong_to_the_plan():
    """A plan is sized for its thread count and run on it (a plan sized for one thread once overran
    its workspace when run on two)."""
    keys = rng.standard_normal((8, 2048, 64)).astype(np.float32)
    queries = rng.standard_normal((24, 32, 64)).astype(np.float32)
    layer = infkv.Layer(infkv.text_tokens(2048), keys=keys, queries=queries, query_pos=np.arange(2016, 2048),
                        layout="hnd")
    pol = infkv.inf_mllm(window=32, bias=infkv.attention_bias(beta=0.5))
    runs = []
    for threads in (1, 2, 3):
        plan = infkv.make_plan(pol, infkv.budget(capacity=512, sinks=4), layer, threads=threads)
        assert plan.threads == threads
        ks = infkv.run(plan, layer)
        runs.append([ks.unit(u) for u in range(ks.n_units)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="executor.threads = 0"):
        infkv.make_plan(pol, infkv.budget(capacity=512), layer, threads=0)


def test_policies_print_their_parameters():
    assert repr(infkv.snapkv(window=8)) == "snapkv(window=8, kernel=5, pool=avg)"
    assert repr(infkv.streaming_llm()) == "streaming_llm()"
    assert "bias.beta=0.5" in repr(infkv.inf_mllm(bias=infkv.attention_bias(beta=0.5)))
    assert repr(infkv.budget(capacity=8, sinks=2)) == "budget(capacity=8, ratio=0, sinks=2, recent=0)"


def test_h2o_accumulates_the_reference_mass_and_keeps_its_heavy_hitters():
    n, h, group, d = 60, 2, 2, 16
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    toks = infkv.text_tokens(n)
    state = infkv.H2OState(infkv.h2o(forgetting=0.5), h)
    state.append(n)
    want = np.zeros((h, n))
    for p in (40, 59):  # two decode steps, one query each; keys after p are not seen yet
        q = rng.standard_normal((1, h * group, d)).astype(np.float32)
        state.observe(infkv.Layer(toks, keys=keys, queries=q, query_pos=np.array([p])))
        mass = window_attention_ref(keys, q, [p], np.arange(n), group)  # [hq, n]
        want = 0.5 * want + mass.reshape(h, group, n).mean(axis=1)
    np.testing.assert_allclose(state.scores, want, rtol=0, atol=2e-6)
    layer = infkv.Layer(toks, keys=keys, accumulated=state.scores)
    ks = infkv.select(infkv.h2o(forgetting=0.5), infkv.budget(capacity=20, recent=2), layer)
    assert ks.n_units == h
    for u in range(h):
        np.testing.assert_array_equal(ks.unit(u), top_keep(state.scores[u], np.arange(n), 20, recent=2))
    state.evict(ks)  # each head keeps its own slots, as the cache is compacted
    assert state.n_slots == 20
    for u in range(h):
        np.testing.assert_allclose(state.scores[u], want[u][ks.unit(u)], rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match=re.escape("accumulated.rows = 0")):
        infkv.select(infkv.h2o(), infkv.budget(capacity=20), infkv.Layer(toks, keys=keys))
    with pytest.raises(ValueError, match=re.escape("accumulated.shape[1] = 60")):
        infkv.Layer(infkv.text_tokens(59), accumulated=np.zeros((h, n), np.float32))
    with pytest.raises(ValueError, match=re.escape("h2o.forgetting = 0")):
        infkv.h2o(forgetting=0.0)


def test_union_of_two_policies_as_one_policy():
    n, h, group, d = 90, 2, 2, 8
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    queries = rng.standard_normal((6, h * group, d)).astype(np.float32)
    layer = infkv.Layer(infkv.text_tokens(n), keys=keys, queries=queries, query_pos=np.arange(n - 6, n))
    first, second = infkv.snapkv(window=4), infkv.keydiff()
    b = infkv.budget(capacity=30, sinks=2)
    wide = infkv.protect(first, b)  # the union protects both policies' tokens

    def alone(p):
        return infkv.select(p, wide, layer, granularity=infkv.granularity.per_layer).unit(0)

    np.testing.assert_array_equal(infkv.select(infkv.union_of(first, second, share=1.0), b, layer).unit(0), alone(first))
    np.testing.assert_array_equal(infkv.select(infkv.union_of(first, second, share=0.0), b, layer).unit(0),
                                  alone(second))
    half = infkv.select(infkv.union_of(first, second, share=0.5), b, layer)
    assert half.n_units == 1 and half.size(0) == 30
    assert not np.array_equal(half.unit(0), alone(first)) and not np.array_equal(half.unit(0), alone(second))
    assert repr(infkv.union_of(first, second, share=0.25)) == (
        "union_of(snapkv(window=4, kernel=5, pool=avg), keydiff(pool=none, kernel=1), share=0.25)")
    assert infkv.capture_needs_of(infkv.union_of(first, second)).queries == 4
    with pytest.raises(ValueError, match=re.escape("union_of.share = 1.5")):
        infkv.union_of(first, second, share=1.5)
    with pytest.raises(ValueError, match=re.escape("plan_options.g = per_head")):
        infkv.make_plan(infkv.union_of(first, second), b, layer,
                        infkv.plan_options(granularity=infkv.granularity.per_head))
