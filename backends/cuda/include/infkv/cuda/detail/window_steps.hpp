// infkv CUDA backend: window attention as steps run by a launcher L (see steps.hpp): the mass
// the last window queries give each cached key, for SnapKV, Inf-MLLM, TOVA's last query and H2O's
// step. f16 / bf16 keys whose queries have their type (strided or paged; head_dim a multiple of 16
// up to 256, at most 128 query rows per KV head) go through two fused block-level steps (tensor
// cores, nothing of size queries x keys in global memory); other strided keys whose queries have
// their type through the launcher's GEMM (cuBLAS on a GPU); everything else through scalar steps.
// basic_backend::score and h2o_observe_steps call it.
#pragma once

#include "window_fused_steps.hpp"
#include "window_rows.hpp"

namespace infkv::cuda::detail {

/// The window attention as scalar steps (paged keys, queries of another type than the keys, or
/// strides a GEMM cannot describe): per (query row, key tile) the running max and normaliser,
/// per query row their combination, per (KV head, key) the mass, each logit a dot product
/// (computed twice).
template <class L, row_source R>
void window_attention_scalar(const L& launch, status_word* st, const layer_inputs<R>& in, const window_rows& g,
                             bool per_query_head, score_view out, const softmax_scratch& stats) {
  const R keys = in.keys;
  const const_tensor_view q = in.queries;
  const std::int64_t n = g.n, d = g.d, group = g.group, w = g.w, q0 = g.q0, tiles = detail::tiles(n);
  const float scale = g.scale;
  const token* tok = in.tokens.data();
  const std::int64_t* qpos = in.query_pos.data();
  float *tmax = stats.tmax, *tsum = stats.tsum, *rmax = stats.rmax, *rcoef = stats.rcoef;
  launch.for_each(g.rows * tiles, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t r = x / tiles, t = x % tiles, qh = r / w, i = r % w;
    const auto h = std::int32_t(qh / group);
    const void* qr = q.row(q0 + i, std::int32_t(qh));
    const std::int64_t qp = qpos[q0 + i];
    float m = -INFINITY, s = 0.f;
    for (std::int64_t j = t * detail::key_tile; j < std::min(n, (t + 1) * detail::key_tile); ++j) {
      if (tok[j].pos > qp) continue;
      const float l = scale * detail::dot(q.type, qr, keys.type, keys.row(j, h), d);
      if (l > m) {
        s = s * expf(m - l) + 1.f;
        m = l;
      } else {
        s += expf(l - m);
      }
    }
    tmax[r * tiles + t] = m, tsum[r * tiles + t] = s;
  });
  window_row_statistics(launch, st, q, g, stats, tiles);
  launch.for_each(g.hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const auto h = std::int32_t(x / n);
    const std::int64_t j = x % n;
    const void* kr = keys.row(j, h);
    for (std::int64_t e = 0; e < d; ++e)
      if (!detail::finite(detail::load(keys.type, kr, e))) detail::record(st, encode(fault::key_not_finite, h, e, j));
    g.key_mass(h, j, tok[j].pos, qpos, rmax, rcoef, per_query_head, out, [&](std::int64_t qh, std::int64_t i) {
      return scale * detail::dot(q.type, q.row(q0 + i, std::int32_t(qh)), keys.type, kr, d);
    });
  });
}

/// Whether strided keys can be read in place as a GEMM operand with the window queries: the same
/// element type, each key row contiguous (lda = slot_stride >= head_dim), a non-negative head
/// stride, sizes within cuBLAS's 32-bit ints.
template <row_source R>
bool window_gemm_fits(const layer_inputs<R>& in, const window_rows& g, std::int64_t tile) {
  if constexpr (requires { in.keys.slot_stride; }) {
    constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
    const auto& k = in.keys;
    return in.queries.type == k.type && k.slot_stride >= g.d && k.slot_stride <= most && k.head_stride >= 0 &&
           (g.rows / g.hkv) * g.d <= most && tile * (g.rows / g.hkv) <= most && g.d >= 1;
  } else {
    return false;
  }
}

/// Attention mass the last `window` queries give each cached key (softmax over the visible
/// keys), per KV head (mean over its G query heads) or per query head. Nothing of size queries x
/// keys is materialised. Strided keys whose queries have their type (window_gemm_fits): the
/// window queries are packed per KV head, then per tile of keys (window_tile_keys: at most
/// `limit` bytes of logits) one strided batched GEMM over the KV heads gives the tile's logits
/// (keys read in place: ld = slot_stride, batch stride = head_stride; the logits of KV head h a
/// rows x keys column-major matrix, so that threads of adjacent query rows read adjacent logits)
/// and the per (query row, 256-key tile) running max and normaliser are read from it; per query
/// row their combination; a second pass of GEMMs (the logits now keys x rows, adjacent keys
/// adjacent) gives each (KV head, key) its mass. Keys and queries are checked by elementwise steps. Other inputs
/// go through window_attention_scalar. `offset` is where the step's scratch starts (after
/// anything the caller keeps there).
template <class L, row_source R>
void window_attention_steps(const L& launch, status_word* st, const layer_inputs<R>& in, std::int64_t window,
                            bool per_query_head, score_view out, std::span<std::byte> scratch, std::size_t offset,
                            std::int64_t limit = window_tile_limit) {
  check_query_inputs(in);
  const window_rows g = window_rows::of(in, window);
  const std::int64_t elem = std::int64_t(size_of(in.queries.type));
  detail::carver c{scratch.data(), offset};
  const auto ws = detail::window_scratch::carve(c, g.rows, g.n, g.d, elem, L::gemm_scratch_bytes(), limit);
  if (window_fused_fits(in, g)) {
    if (in.keys.type == dtype::f16)
      window_attention_fused<dtype::f16>(launch, st, in, g, per_query_head, out, ws.stats);
    else
      window_attention_fused<dtype::bf16>(launch, st, in, g, per_query_head, out, ws.stats);
    return;
  }
  if (!window_gemm_fits(in, g, ws.tile)) {
    window_attention_scalar(launch, st, in, g, per_query_head, out, ws.stats);
    return;
  }
  if constexpr (requires { in.keys.slot_stride; }) {
    const auto keys = in.keys;
    const const_tensor_view q = in.queries;
    const std::int64_t n = g.n, d = g.d, hkv = g.hkv, w = g.w, q0 = g.q0, tiles = detail::tiles(n);
    const std::int64_t per_head = g.rows / hkv;  // query rows of one KV head
    const token* tok = in.tokens.data();
    const std::int64_t* qpos = in.query_pos.data();
    float *tmax = ws.stats.tmax, *tsum = ws.stats.tsum, *rmax = ws.stats.rmax, *rcoef = ws.stats.rcoef;
    std::byte* packed = ws.queries;
    float* logits = ws.logits;
    const auto gemm = launch.gemm_scratch(ws.gemm);
    // Packed queries: row r of the window (KV head r / per_head), its d elements contiguous.
    launch.for_each(g.rows * d, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t r = x / d, e = x % d, qh = r / w, i = r % w;
      const auto* src = static_cast<const std::byte*>(q.row(q0 + i, std::int32_t(qh))) + e * elem;
      memcpy(packed + x * elem, src, std::size_t(elem));
    });
    launch.for_each(hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const auto h = std::int32_t(x / n);
      const std::int64_t j = x % n;
      const void* kr = keys.row(j, h);
      for (std::int64_t e = 0; e < d; ++e)
        if (!detail::finite(detail::load(keys.type, kr, e))) detail::record(st, encode(fault::key_not_finite, h, e, j));
    });
    // Logits of keys [j0, j0 + m), all KV heads in one batch. K_h is the d x m column-major view
    // of KV head h's keys in place (ld slot_stride, batch stride head_stride), Q_h the d x
    // per_head packed queries (ld d). For the softmax statistics (a thread per query row and
    // sub-tile) C_h = scale Q_h^T K_h, per_head x m (ldc per_head): key j0 + jl of window row
    // r = h per_head + rr at (h m + jl) per_head + rr, adjacent rows adjacent. For the mass (a
    // thread per key) C_h = scale K_h^T Q_h, m x per_head (ldc m): at r m + jl, adjacent keys
    // adjacent.
    const auto row_logits = [&](std::int64_t j0, std::int64_t m) {
      gemm.gemm_strided_batched(blas_op::t, blas_op::n, per_head, m, d, g.scale, packed, q.type, d, per_head * d,
                                keys.row(j0, 0), keys.type, keys.slot_stride, keys.head_stride, 0.f, logits, dtype::f32,
                                per_head, per_head * m, hkv);
    };
    const auto key_logits = [&](std::int64_t j0, std::int64_t m) {
      gemm.gemm_strided_batched(blas_op::t, blas_op::n, m, per_head, d, g.scale, keys.row(j0, 0), keys.type,
                                keys.slot_stride, keys.head_stride, packed, q.type, d, per_head * d, 0.f, logits,
                                dtype::f32, m, m * per_head, hkv);
    };
    for (std::int64_t j0 = 0; j0 < n; j0 += ws.tile) {
      const std::int64_t m = std::min(ws.tile, n - j0), sub = detail::tiles(m), t0 = j0 / detail::key_tile;
      const std::int64_t rows = g.rows;
      row_logits(j0, m);
      launch.for_each(rows * sub, [=] INFKV_HOST_DEVICE(std::int64_t x) {
        const std::int64_t r = x % rows, tl = x / rows, qp = qpos[q0 + r % w];
        const float* lr = logits + (r / per_head) * per_head * m + r % per_head;  // key jl at lr[jl per_head]
        float mx = -INFINITY, s = 0.f;
        for (std::int64_t jl = tl * detail::key_tile; jl < std::min(m, (tl + 1) * detail::key_tile); ++jl) {
          if (tok[j0 + jl].pos > qp) continue;
          const float l = lr[jl * per_head];
          if (l > mx) {
            s = s * expf(mx - l) + 1.f;
            mx = l;
          } else {
            s += expf(l - mx);
          }
        }
        tmax[r * tiles + t0 + tl] = mx, tsum[r * tiles + t0 + tl] = s;
      });
    }
    window_row_statistics(launch, st, q, g, ws.stats, tiles);
    for (std::int64_t j0 = 0; j0 < n; j0 += ws.tile) {
      const std::int64_t m = std::min(ws.tile, n - j0);
      key_logits(j0, m);
      launch.for_each(hkv * m, [=] INFKV_HOST_DEVICE(std::int64_t x) {
        const std::int64_t h = x / m, jl = x % m, j = j0 + jl;
        g.key_mass(h, j, tok[j].pos, qpos, rmax, rcoef, per_query_head, out,
                   [&](std::int64_t qh, std::int64_t i) { return logits[(qh * w + i) * m + jl]; });
      });
    }
  }
}

}  // namespace infkv::cuda::detail
