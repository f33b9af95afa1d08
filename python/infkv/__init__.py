"""infkv: KV-cache policies for streaming LLM inference under a fixed memory budget.

The C++ library's policies, budgets, plans and CPU kernels (`make_plan` / `run` / `select` /
`compact` / `rerotate`) over NumPy arrays and torch tensors, viewed without copying. Bad input
raises ValueError naming the argument; `infkv.kvpress` holds presses for NVIDIA's kvpress and
budgeted block-wise prefill for Hugging Face transformers.
"""
from __future__ import annotations

import numpy as _np

from ._infkv import (  # noqa: F401
    Archive,
    BatchLayer,
    BatchPlan,
    EngineError,
    H2OState,
    KeepSet,
    Layer,
    LayerShape,
    PagedCache,
    Plan,
    Recaller,
    Tokens,
    __version__,
    adakv,
    age_unit,
    attention_bias,
    budget,
    capture_needs,
    capture_needs_of,
    compact,
    compact_paged,
    compact_positions,
    decay,
    expected_attention,
    granularity,
    h2o,
    inf_mllm,
    keydiff,
    make_batch_plan,
    make_plan,
    modality,
    natural_granularity,
    plan_options,
    pooling,
    reconstruction_scores,
    protect,
    reduction,
    rerotate,
    rope,
    rope_style,
    run,
    run_batch,
    run_scores,
    select,
    snapkv,
    streaming_llm,
    text_tokens,
    tova,
    union_of,
)


def _array(x, dtype, name):
    if hasattr(x, "detach"):  # a torch tensor: to NumPy (a CPU tensor is shared, not copied)
        x = x.detach().cpu().numpy()
    a = _np.ascontiguousarray(_np.asarray(x))
    if a.ndim != 1:
        raise ValueError(f"infkv: {name}.ndim = {a.ndim}: must be 1")
    if a.size and not _np.can_cast(a.dtype, dtype, casting="same_kind"):
        raise ValueError(f"infkv: {name}.dtype = {a.dtype}: must be an integer type")
    return a.astype(dtype, copy=False)


def tokens(positions, segments=None, kinds=None) -> Tokens:
    """Tokens of the cached slots from array-likes: positions (int64), segments (int32, the frame,
    tile or turn of each slot), kinds (modality values or their ints)."""
    pos = _array(positions, _np.int64, "positions")
    seg = None if segments is None else _array(segments, _np.int32, "segments")
    kin = None
    if kinds is not None:
        kinds = [int(k.value) if isinstance(k, modality) else k for k in kinds] if isinstance(kinds, (list, tuple)) else kinds
        kin = _array(kinds, _np.uint8, "kinds")
    return Tokens.from_arrays(pos, seg, kin)

