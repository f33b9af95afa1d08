"""infkv's policies as kvpress presses, and budgeted block-wise prefill in transformers.

`InfkvPress(policy, compression_ratio=...)` is a kvpress `ScorerPress`: it goes wherever kvpress
takes a press (its pipeline, `with press(model):`, inside `DecodingPress`). It scores and selects
with infkv (the policy's sinks and window protected, its granularity, ties broken as infkv breaks
them: infkv's keep set is applied, not a top-k of scores) and keeps the kept slots in slot order.
The window queries are recomputed from the layer's hidden states (as kvpress's SnapKV does) and
turned with the model's RoPE at the slots' own positions, which the press tracks per layer.

`prefill_blockwise(model, input_ids, policy, capacity, ...)` prefills in blocks (aligned with the
caller's segments when given) and evicts every layer to `capacity` right after each block's
attention, so peak KV memory stays at capacity + one block in one layer; kvpress's presses
compress only after a whole prefill. With `question_ids` (a question known in advance) every
eviction scores against the question's queries (proxy queries) instead of the block's own.

CPU tensors only: the module runs infkv's CPU backend (a CUDA tensor raises ValueError).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np
import torch
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept, extract_keys_and_values, get_prerope_query_states
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

import infkv


def model_rope(model_or_module) -> infkv.rope:
    """infkv's RoPE parameters for a transformers model's rotary embedding (rotate-half, i.e. NeoX
    pairing); raises ValueError when its frequencies are not theta^(-2i/d) (scaled RoPE variants)."""
    rot = getattr(model_or_module, "rotary_emb", None)
    if rot is None and hasattr(model_or_module, "model"):
        rot = getattr(_language_model(model_or_module), "rotary_emb", None)
    if rot is None:
        raise ValueError("infkv: model.rotary_emb = None: the model has no rotary embedding to read RoPE from")
    inv = rot.inv_freq.detach().double().cpu()
    half = inv.numel()
    if half < 2 or float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise ValueError(f"infkv: model.rotary_emb = {type(rot).__name__}: scaled RoPE is not supported")
    dims = 2 * half
    config = getattr(rot, "config", None)
    params = (getattr(config, "rope_parameters", None) or {}) if config is not None else {}
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or float(inv[1] ** (-dims / 2.0))
    expect = float(theta) ** (-2.0 * torch.arange(half, dtype=torch.float64) / dims)
    if not torch.allclose(inv, expect, rtol=1e-5, atol=0):  # inv_freq is float32
        raise ValueError(f"infkv: model.rotary_emb.inv_freq: not theta^(-2i/d) for theta = {theta} (scaled RoPE, "
                         f"{type(rot).__name__}); infkv.rope cannot express it")
    return infkv.rope(theta=theta, dims=dims, style=infkv.rope_style.neox)


def _queries(module, hidden_states: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries of the last rows of `hidden_states` at positions `pos`: (batch, heads, w, d)."""
    w = pos.numel()
    q = get_prerope_query_states(module, hidden_states[:, -w:])
    cos, sin = module.rotary_emb(q, pos.to(q.device).unsqueeze(0))
    return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)


@dataclass
class InfkvPress(ScorerPress):
    """A kvpress press that keeps what an infkv policy keeps.

    policy: an infkv policy (`infkv.snapkv(window=64)`, `infkv.inf_mllm(...)`, ...).
    compression_ratio: share of the slots evicted (kvpress's meaning: keeps int(n * (1 - ratio)),
        at least 1).
    sinks, recent: the budget's protected first / last slots (the policy may widen them).
    granularity: infkv.granularity (None: the policy's natural one; per_token is per_layer here,
        a press sees one layer at a time).
    threads: CPU threads infkv scores with.
    archive: an infkv.Archive (per_layer pages) that keeps the stream written through (each
        eviction first archives the slots added since the last), for `recall` to bring back (one
        batch row; every head must keep the same slots).
    """

    policy: Any = None
    compression_ratio: float = 0.0
    sinks: int = 0
    recent: int = 0
    granularity: Optional[infkv.granularity] = None
    threads: int = 1
    archive: Any = None  # an infkv.Archive (per_layer) that keeps the stream, written through
    # layer -> hidden states (1, q, hidden) of a question known in advance: evictions then score
    # against its queries (proxy queries) at the positions right after the cache, not the window's
    question: Optional[dict] = field(default=None, repr=False)
    positions: dict = field(default_factory=dict, repr=False)  # layer -> (positions [heads, slots], next)
    archived_to: dict = field(default_factory=dict, repr=False)  # layer -> first position not archived

    def __post_init__(self):
        super().__post_init__()
        if self.policy is None:
            raise ValueError("infkv: InfkvPress.policy = None: give an infkv policy (infkv.snapkv(), ...)")
        self.needs = infkv.capture_needs_of(self.policy)  # checks the policy
        if self.archive is not None and not isinstance(self.archive, infkv.Archive):
            raise ValueError(f"infkv: InfkvPress.archive = {type(self.archive).__name__}: must be an infkv.Archive")
        infkv.budget(ratio=1.0, sinks=self.sinks, recent=self.recent)  # checks sinks and recent

    def post_init_from_model(self, model):
        if isinstance(self.policy, infkv.expected_attention) and self.policy.rotary is not None:
            self.policy.rotary = model_rope(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("InfkvPress keeps infkv's keep set (compress); use infkv.run_scores for scores")

    def slot_positions(self, module, keys: torch.Tensor, kwargs: dict):
        """Positions of the layer's cached slots, per KV head (heads keep different slots at per-head
        granularity), and the position after the newest token. Each head's slots stay in time order
        (this press keeps slot order, the cache appends), so the slots added since the last call
        take the positions after the newest token seen; a new prefill starts again from 0."""
        b, h, n, layer = keys.shape[0], keys.shape[1], keys.shape[2], module.layer_idx
        prev, nxt = self.positions.get(layer, (None, 0))
        q_len = kwargs["hidden_states"].shape[1] if "hidden_states" in kwargs else 0
        if prev is None or prev.shape[:2] != (b, h) or (q_len and is_prefilling(kwargs["cache_position"], q_len)):
            prev, nxt = torch.empty(b, h, 0, dtype=torch.int64), 0
        if prev.shape[2] >= n:  # the caller cut the cache back (kvpress drops an answer)
            return prev[:, :, :n], int(prev[:, :, n - 1].max()) + 1 if n else 0
        added = n - prev.shape[2]
        new = torch.arange(nxt, nxt + added, dtype=torch.int64).expand(b, h, added)
        return torch.cat([prev, new], dim=2), nxt + added

    def keep_sets(self, module, hidden_states, keys, values, pos: torch.Tensor, end: int, capacity: int) -> list:
        """Per batch row, per KV head, the slots infkv keeps for `capacity` slots per unit. `pos`:
        the slots' positions per batch row and head; `end`: the position after the newest token (the last rows of
        `hidden_states` are the newest tokens, and give the window queries)."""
        b, h, n, d = keys.shape
        bud = infkv.budget(capacity=capacity, sinks=self.sinks, recent=self.recent)
        if self.question is not None:  # proxy queries: the question's, right after the cache
            hidden_states = self.question[module.layer_idx]
            q = hidden_states.shape[1]
            w = min(self.needs.queries, q)
            qpos = torch.arange(end + q - w, end + q, dtype=torch.int64)
        else:
            w = min(self.needs.queries, hidden_states.shape[1], n)
            qpos = torch.arange(end - w, end, dtype=torch.int64)
        queries = _queries(module, hidden_states, qpos) if w else None
        g = self.granularity
        if g == infkv.granularity.per_token:
            g = infkv.granularity.per_layer
        scale = float(getattr(module, "scaling", 1.0 / math.sqrt(d)))
        group = queries.shape[1] // h if w else 1

        def select(i, heads, toks):
            return infkv.select(self.policy, bud, infkv.Layer(
                toks,
                keys=keys[i, heads].detach() if self.needs.keys else None,
                values=values[i, heads].detach() if self.needs.values else None,
                queries=queries[i, heads.start * group:heads.stop * group].detach().contiguous() if w else None,
                query_pos=qpos.numpy() if w else None, scale=scale, layout="hnd"), granularity=g, threads=self.threads)

        out = []
        for i in range(b):
            if torch.equal(pos[i], pos[i, :1].expand_as(pos[i])):  # every head holds the same positions
                ks = select(i, slice(0, h), infkv.tokens(pos[i, 0]))
                out.append([ks.unit(u if ks.n_units > 1 else 0) for u in range(h)])
            elif (g or infkv.natural_granularity(self.policy)) == infkv.granularity.per_head:
                # the heads hold different slots (an earlier per-head eviction): one decision per head
                out.append([select(i, slice(u, u + 1), infkv.tokens(pos[i, u])).unit(0) for u in range(h)])
            else:
                raise ValueError(f"infkv: granularity = {g}: the layer's heads hold different slots (an earlier "
                                 "per-head eviction); only a per-head decision can follow it")
        return out

    def evict(self, module, hidden_states, keys, values, kwargs, capacity: int):
        """Keys and values after keeping `capacity` slots per unit; the kept positions are remembered."""
        pos, end = self.slot_positions(module, keys, kwargs)
        if capacity >= keys.shape[2]:
            self.positions[module.layer_idx] = (pos, end)
            return keys, values
        kept_k, kept_v, kept_pos = [], [], []
        sets = self.keep_sets(module, hidden_states, keys, values, pos, end, capacity)
        if self.archive is not None:
            if len(sets) != 1 or any(not torch.equal(torch.from_numpy(u), torch.from_numpy(sets[0][0])) for u in sets[0]):
                raise ValueError("infkv: InfkvPress.archive: archiving needs one batch row whose heads keep the same "
                                 f"slots: granularity = {self.granularity} (pass infkv.granularity.per_layer)")
            self.archive_new(module.layer_idx, pos[0, 0], keys[0], values[0])
        for i, units in enumerate(sets):
            idx = torch.stack([torch.from_numpy(u) for u in units])  # (heads, kept)
            kept_pos.append(pos[i].gather(1, idx))
            idx = idx.to(keys.device).unsqueeze(-1).expand(-1, -1, keys.shape[3])
            kept_k.append(keys[i].gather(1, idx))
            kept_v.append(values[i].gather(1, idx))
        self.positions[module.layer_idx] = (torch.stack(kept_pos), end)
        return torch.stack(kept_k).contiguous(), torch.stack(kept_v).contiguous()

    def archive_new(self, layer: int, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Archives the slots of one layer's cache (keys, values: heads x slots x d; positions `pos`)
        from the first position not archived yet on, before any of them can leave."""
        start = self.archived_to.get(layer, 0)
        new = pos >= start
        if not bool(new.any()):
            return 0
        kept = torch.nonzero(~new).squeeze(1).numpy().astype("int64")
        toks = infkv.tokens(pos)
        pages = self.archive.archive(infkv.Layer(toks, keys=keys.detach(), values=values.detach(), layout="hnd"),
                                     [kept], layer=layer)
        self.archived_to[layer] = int(pos.max()) + 1
        return pages

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            self.positions[module.layer_idx] = self.slot_positions(module, keys, kwargs)
            return keys, values
        return self.evict(module, hidden_states, keys, values, kwargs,
                          compute_n_kept(keys.shape[2], self.compression_ratio))


def _language_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


@contextlib.contextmanager
def _hooks(model, hook):
    lm = _language_model(model)
    handles = []
    try:
        for layer in lm.layers:
            layer.self_attn.rotary_emb = lm.rotary_emb
            handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def cache_bytes(cache) -> int:
    """Bytes of the K and V tensors a transformers cache holds, over all layers."""
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4)


@dataclass
class PrefillStats:
    blocks: int = 0
    tokens: int = 0
    peak_kv_bytes: int = 0  # largest sum over layers of the cached K and V, measured after every layer
    final_kv_bytes: int = 0
    kept: list = field(default_factory=list)  # cached slots per layer at the end


def block_bounds(n: int, block: int, segments: Optional[Iterable[int]] = None) -> list:
    """(start, end) of each block: `block` tokens each, or, with `segments` (one id per token,
    non-decreasing), whole segments grouped up to `block` tokens (a segment longer than `block` is
    its own block)."""
    if block < 1:
        raise ValueError(f"infkv: block = {block}: must be >= 1")
    if segments is None:
        return [(s, min(n, s + block)) for s in range(0, n, block)]
    seg = list(segments)
    if len(seg) != n:
        raise ValueError(f"infkv: segments has {len(seg)} entries: must have one per token ({n})")
    starts = [0] + [i for i in range(1, n) if seg[i] != seg[i - 1]]
    if any(seg[i] < seg[i - 1] for i in range(1, n)):
        raise ValueError("infkv: segments: must be non-decreasing")
    bounds, begin = [], 0
    for s, e in zip(starts, starts[1:] + [n]):
        if s > begin and e - begin > block:
            bounds.append((begin, s))
            begin = s
    if begin < n:
        bounds.append((begin, n))
    return bounds


def _question_hidden(model, question_ids: torch.Tensor, cache=None, start: int = 0) -> dict:
    """Each layer's attention input (1, q, hidden) for `question_ids` decoded at positions start,
    start + 1, ... after `cache` (None: alone, in a cache of its own); the question's rows leave
    `cache` again."""
    before = None if cache is None else [layer.keys.shape[2] for layer in cache.layers]
    hidden = {}

    def hook(module, args, kwargs, output):
        hidden[module.layer_idx] = kwargs["hidden_states"].detach()
        return output

    q = question_ids.shape[1]
    with _hooks(model, hook):
        model.model(input_ids=question_ids.to(model.device), past_key_values=DynamicCache() if cache is None else cache,
                    position_ids=torch.arange(start, start + q, device=model.device).unsqueeze(0), use_cache=True)
    if cache is not None:
        for layer, n in zip(cache.layers, before):
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
    return hidden


@torch.no_grad()
def prefill_blockwise(model, input_ids: torch.Tensor, policy, capacity: int, block: int = 512, *, sinks: int = 0,
                      recent: int = 0, segments=None, cache=None, threads: int = 1, granularity=None, archive=None,
                      question_ids: Optional[torch.Tensor] = None, proxy: str = "alone"):
    """Prefills `input_ids` (1 x n) block by block into `cache` (a new DynamicCache by default),
    evicting every layer to `capacity` slots right after each block's attention with infkv's
    `policy`. Positions stay the tokens' own (keep mode: position_ids passed, keys not re-rotated).
    With `archive` (an infkv.Archive of per_layer pages) the stream is archived, written through.

    With `question_ids` (1 x q, a question known in advance; its tokens are not prefilled here)
    every eviction scores against the question's queries at the positions right after the cache
    (proxy queries; the policy must read window queries): `proxy="alone"` computes them once from a
    pass over the question by itself, and evicts inside each block's forward as without a question
    (peak: capacity + one block in one layer); `proxy="after_cache"` passes the question over the
    cache after every block and then evicts every layer (peak: capacity + one block + the question
    in every layer).
    Returns (cache, press, stats): the press holds the kept positions per layer, for decoding on."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"infkv: input_ids.shape = {tuple(input_ids.shape)}: must be (1, n)")
    if capacity < 1:
        raise ValueError(f"infkv: capacity = {capacity}: must be >= 1")
    if proxy not in ("alone", "after_cache"):
        raise ValueError(f"infkv: proxy = {proxy!r}: must be 'alone' or 'after_cache'")
    if question_ids is not None:
        if question_ids.dim() != 2 or question_ids.shape[0] != 1 or question_ids.shape[1] < 1:
            raise ValueError(f"infkv: question_ids.shape = {tuple(question_ids.shape)}: must be (1, q), q >= 1")
        if infkv.capture_needs_of(policy).queries == 0:
            raise ValueError(f"infkv: question_ids: {type(policy).__name__} reads no window queries, so a question "
                             "cannot steer it: prefill without one")
    n = input_ids.shape[1]
    bounds = block_bounds(n, block, segments)
    press = InfkvPress(policy=policy, sinks=sinks, recent=recent, threads=threads, granularity=granularity,
                       archive=archive)
    press.post_init_from_model(model)
    infkv.protect(policy, infkv.budget(capacity=capacity, sinks=sinks, recent=recent)).validate()
    cache = DynamicCache() if cache is None else cache
    stats = PrefillStats()
    after_cache = question_ids is not None and proxy == "after_cache"
    if question_ids is not None and not after_cache:
        press.question = _question_hidden(model, question_ids)

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, cache_bytes(cache))
        if not after_cache:
            keys, values = extract_keys_and_values(cache, module.layer_idx)
            layer.keys, layer.values = press.evict(module, kwargs["hidden_states"], keys, values, kwargs, capacity)
        return output

    lm = _language_model(model)
    with _hooks(model, hook):
        for s, e in bounds:
            model.model(input_ids=input_ids[:, s:e].to(model.device), past_key_values=cache,
                        position_ids=torch.arange(s, e, device=model.device).unsqueeze(0), use_cache=True)
            stats.blocks += 1
            stats.tokens += e - s
            if after_cache:
                press.question = _question_hidden(model, question_ids, cache, e)  # the hook counts its rows
                for i, layer in enumerate(cache.layers):
                    keys, values = extract_keys_and_values(cache, i)
                    layer.keys, layer.values = press.evict(lm.layers[i].self_attn, None, keys, values, {}, capacity)
    press.question = None
    stats.final_kv_bytes = cache_bytes(cache)
    stats.kept = [layer.keys.shape[2] for layer in cache.layers]
    return cache, press, stats


@dataclass
class RecallStats:
    pages: int = 0  # pages recalled from (they stay archived), over all layers
    tokens: int = 0  # slots brought back (= slots displaced), over all layers
    question_tokens: int = 0


@torch.no_grad()
def recall(model, cache, press: InfkvPress, recaller, question_ids: torch.Tensor) -> RecallStats:
    """Before a question: brings back into `cache` the archived tokens the question needs.

    The question's queries come from one pass over `question_ids` (1 x q) after the cache, at the
    positions after the newest token; its rows leave the cache again, so the caller then decodes the
    question as usual. Per layer, what the stream wrote since the last eviction is archived first;
    then `recaller` (an infkv.Recaller over `press.archive`) chooses the archived tokens and the
    cached slots they displace; the tokens' dequantized rows take the displaced slots' place at
    their original positions (keep mode: keys are cached after RoPE). The archive keeps everything;
    the cache's size does not change."""
    archive = press.archive
    if archive is None:
        raise ValueError("infkv: press.archive = None: prefill with an archive to recall from it")
    if question_ids.dim() != 2 or question_ids.shape[0] != 1 or question_ids.shape[1] < 1:
        raise ValueError(f"infkv: question_ids.shape = {tuple(question_ids.shape)}: must be (1, q), q >= 1")
    lm = _language_model(model)
    layers = range(len(lm.layers))
    if any(layer not in press.positions for layer in layers):
        raise ValueError("infkv: press.positions: every layer must have been prefilled with the press")
    end = max(press.positions[layer][1] for layer in layers)
    q = question_ids.shape[1]
    qpos = torch.arange(end, end + q, dtype=torch.int64)
    hidden = _question_hidden(model, question_ids, cache, end)  # its rows leave the cache again
    queries = [_queries(lm.layers[layer].self_attn, hidden[layer], qpos)[0].transpose(0, 1).contiguous()
               for layer in layers]  # [q, q_heads, d] each
    stats = RecallStats(question_tokens=q)
    for layer in layers:
        module, c = lm.layers[layer].self_attn, cache.layers[layer]
        pos, nxt = press.positions[layer]
        keys, values = c.keys[0], c.values[0]  # heads x slots x d
        if not torch.equal(pos[0], pos[0, :1].expand_as(pos[0])):
            raise ValueError(f"infkv: layer {layer}: the heads hold different slots; recall needs per_layer eviction")
        toks = infkv.tokens(pos[0, 0])
        scale = float(getattr(module, "scaling", 1.0 / math.sqrt(keys.shape[-1])))
        press.archive_new(layer, pos[0, 0], keys, values)
        pages, recalled, displaced = recaller.recall(
            archive, infkv.Layer(toks, keys=keys.detach(), values=values.detach(), layout="hnd"), queries,
            qpos.numpy(), scale, layer=layer)
        if len(recalled) == 0:
            continue
        rows = {int(p): archive.restore(int(p)) for p in np.unique(recalled[:, 0])}  # [1, tokens, heads, d] each
        rk = torch.from_numpy(np.stack([rows[int(p)][0][0, i] for p, i in recalled])).transpose(0, 1)
        rv = torch.from_numpy(np.stack([rows[int(p)][1][0, i] for p, i in recalled])).transpose(0, 1)
        back = np.array([archive.page(int(p))["tokens"].positions[i] for p, i in recalled], dtype=np.int64)
        kept = torch.ones(keys.shape[1], dtype=torch.bool)
        kept[torch.from_numpy(displaced)] = False
        kept_slots = torch.nonzero(kept).squeeze(1)
        c.keys = torch.cat([keys[:, kept_slots], rk.to(keys.dtype).to(keys.device)], dim=1).unsqueeze(0).contiguous()
        c.values = torch.cat([values[:, kept_slots], rv.to(values.dtype).to(values.device)],
                             dim=1).unsqueeze(0).contiguous()
        new_pos = torch.cat([pos[0, 0][kept_slots], torch.from_numpy(back)])
        press.positions[layer] = (new_pos.expand(1, keys.shape[0], -1).clone(), nxt)
        stats.pages += len(pages)
        stats.tokens += len(recalled)
    return stats

