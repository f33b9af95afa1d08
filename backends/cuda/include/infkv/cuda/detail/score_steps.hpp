// infkv CUDA backend: the score sources with their own multi-step algorithms, as steps run by a
// launcher L (see steps.hpp): the checks of window queries, KeyDiff's key diversity and Expected
// Attention, whose logits go through the launcher's GEMM (window attention: window_steps.hpp).
// basic_backend::score calls them.
#pragma once

#include "block_steps.hpp"

namespace infkv::cuda::detail {

/// The rotary pair element `el` belongs to (rope_pair's inverse), or -1 outside the rotary dims.
INFKV_HOST_DEVICE inline std::int32_t rope_pair_of(rope_style s, std::int64_t el, std::int32_t dims) {
  if (el >= dims) return -1;
  return s == rope_style::normal ? std::int32_t(el / 2) : std::int32_t(el % (dims / 2));
}

/// KeyDiff's blocks (T: the keys' type): per KV head and chunk of 256 keys, a block of 128
/// threads reads each key once (vectorised), writes its inverse norm to out and adds its unit
/// key into the chunk's sums (per element, keys in order); a block per (KV head, 32 elements)
/// adds the chunks' sums into the anchor (anchors).
template <dtype T, row_source R>
struct keydiff_blocks {
  static constexpr int threads = 128, tile = 64;  ///< keys of a chunk are read in tiles
  R keys;
  score_view out;
  float *part, *anchor;
  std::int64_t n, d, nc;

  /// Shared memory: a tile of keys as f32 ([key][d]) and their inverse norms.
  static std::size_t shared_bytes(std::int64_t d) {
    return shared_round(std::size_t(tile * d) * 4) + shared_round(std::size_t(tile) * 4);
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void chunk_sums(const Ctx& c, status_word* st) const {
    const auto h = std::int32_t(c.block / nc);
    const std::int64_t cc = c.block % nc, begin = cc * chunk, end = begin + chunk < n ? begin + chunk : n;
    float* k = reinterpret_cast<float*>(c.shared);
    float* inv = reinterpret_cast<float*>(c.shared + shared_round(std::size_t(tile * d) * 4));
    const std::int64_t e0 = c.thread, e1 = c.thread + c.threads;  // this thread's elements (d <= 256)
    float acc0 = 0.f, acc1 = 0.f;                                 // in registers, not an indexed array
    const std::int64_t per16 = T == dtype::f32 ? 4 : 8, pieces = (d + per16 - 1) / per16;
    for (std::int64_t j0 = begin; j0 < end; j0 += tile) {
      const std::int64_t m = end - j0 < tile ? end - j0 : tile;
      for (std::int64_t x = c.thread; x < m * pieces; x += c.threads) {  // adjacent threads: adjacent bytes
        const std::int64_t jl = x / pieces, e0 = (x % pieces) * per16;
        load_chunk<T>(keys.row(j0 + jl, h), e0, d, k + jl * d + e0);
      }
      c.sync();
      if (c.thread < m) {  // the key's norm, its elements in order (and the check)
        const std::int64_t jl = c.thread;
        float norm = 0.f;
        for (std::int64_t e = 0; e < d; ++e) {
          const float v = k[jl * d + e];
          if (!finite(v)) record(st, encode(fault::key_not_finite, h, e, j0 + jl));
          norm += v * v;
        }
        inv[jl] = norm > 0.f ? 1.f / sqrtf(norm) : 0.f;
        out(h, j0 + jl) = inv[jl];
      }
      c.sync();
      for (std::int64_t jl = 0; jl < m; ++jl) {
        if (e0 < d) acc0 += k[jl * d + e0] * inv[jl];
        if (e1 < d) acc1 += k[jl * d + e1] * inv[jl];
      }
      c.sync();  // the next tile overwrites the keys and their norms
    }
    if (e0 < d) part[(h * nc + cc) * d + e0] = acc0;
    if (e1 < d) part[(h * nc + cc) * d + e1] = acc1;
  }

  /// The anchor, a block per (KV head, 32 elements): lane l of warp w adds the chunks w, w + 8,
  /// ... of element l in order, then lane l of warp 0 adds the 8 warps' sums in order.
  static constexpr int anchor_lanes = 32, anchor_warps = 8;
  INFKV_HOST_DEVICE static std::int64_t anchor_slices(std::int64_t d) { return (d + anchor_lanes - 1) / anchor_lanes; }
  template <class Ctx>
  INFKV_HOST_DEVICE void anchors(const Ctx& c) const {
    const std::int64_t slices = anchor_slices(d), h = c.block / slices;
    const int lane = c.thread % anchor_lanes, warp = c.thread / anchor_lanes;
    const std::int64_t e = (c.block % slices) * anchor_lanes + lane;
    auto* sums = reinterpret_cast<float*>(c.shared);  // [warp][lane]
    float s = 0.f;
    if (e < d)
      for (std::int64_t cc = warp; cc < nc; cc += anchor_warps) s += part[(h * nc + cc) * d + e];
    sums[warp * anchor_lanes + lane] = s;
    c.sync();
    if (warp == 0 && e < d) {
      float a = 0.f;
      for (int w = 0; w < anchor_warps; ++w) a += sums[w * anchor_lanes + lane];
      anchor[h * d + e] = a;
    }
  }
};

/// -cos(k_j, mean unit key) per KV head (KeyDiff), in three launches over the keys read twice:
/// per (KV head, chunk) block the inverse norms and the chunk's sums of unit keys
/// (keydiff_blocks), per (KV head, 32 elements) block the anchor, then per key its cosine with
/// the anchor (a thread per key, vectorised loads; the anchor's norm summed in element order as
/// the dot product goes, the same in every thread of a head). The chunk sums and the norms run in
/// element and key order; the anchor adds the chunks in 8 interleaved runs, then the runs.
template <dtype T, class L, row_source R>
void keydiff_typed(const L& launch, status_word* st, const R& keys, score_view out, const keydiff_scratch& w) {
  const std::int64_t n = keys.n_slots, d = keys.head_dim, hkv = keys.n_heads, nc = chunks(n);
  using B = keydiff_blocks<T, R>;
  const B b{keys, out, w.part, w.anchor, n, d, nc};
  launch.for_blocks(hkv * nc, B::threads, B::shared_bytes(d),
                    [=] INFKV_HOST_DEVICE(const typename L::block_context& c) { b.chunk_sums(c, st); });
  launch.for_blocks(hkv * B::anchor_slices(d), B::anchor_lanes * B::anchor_warps,
                    std::size_t(B::anchor_lanes * B::anchor_warps) * 4,
                    [=] INFKV_HOST_DEVICE(const typename L::block_context& c) { b.anchors(c); });
  const float* anchor = w.anchor;
  launch.for_each(hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto h = std::int32_t(i / n);
    const std::int64_t j = i % n;
    const void* row = keys.row(j, h);
    float dot = 0.f, an = 0.f, x[8];
    for (std::int64_t e0 = 0; e0 < d;) {
      const int count = load_chunk<T>(row, e0, d, x);
      for (int t = 0; t < count; ++t) {
        const float a = anchor[h * d + e0 + t];
        dot += x[t] * a, an += a * a;
      }
      e0 += count;
    }
    const float inv_an = an > 0.f ? 1.f / sqrtf(an) : 0.f;
    out(h, j) = -dot * out(h, j) * inv_an;
  });
}

/// KeyDiff's blocks hold a tile of 64 keys as f32 in shared memory and each thread at most two
/// elements' sums: head_dim up to 256 (raised when planning, and again by a run).
inline void check_keydiff_shape(std::int64_t head_dim) {
  INFKV_REQUIRE(head_dim <= 256, "keys.head_dim", head_dim, "KeyDiff on the CUDA backend takes head_dim <= 256");
}

/// KeyDiff (keydiff_typed for the keys' type).
template <class L, row_source R>
void keydiff_steps(const L& launch, status_word* st, const R& keys, score_view out, std::span<std::byte> scratch) {
  validate(keys, "keys");
  check_keydiff_shape(keys.head_dim);
  detail::carver c{scratch.data(), 0};
  const auto w = detail::keydiff_scratch::carve(c, keys.n_heads, keys.n_slots, keys.head_dim);
  if (keys.n_slots == 0) return;
  switch (keys.type) {
    case dtype::f32: keydiff_typed<dtype::f32>(launch, st, keys, out, w); break;
    case dtype::f16: keydiff_typed<dtype::f16>(launch, st, keys, out, w); break;
    case dtype::bf16: keydiff_typed<dtype::bf16>(launch, st, keys, out, w); break;
  }
}

/// Expected Attention (cpu::expected_attention_into's semantics) over every query of `in`: the
/// rotation tables, each query head's mean before RoPE (double), mu' and the centred queries c'_i
/// under the mean rotation, then the logits through the launcher's GEMM (cuBLAS on a GPU), in f32:
/// each query head's operand rows are mu' and, for the covariance term, either the centred
/// queries (squared projections) or the d rows of Sigma' = s^2 / 2m C'^T C' (itself one GEMM per
/// query head; the form the CPU chooses). Per tile of keys (at most `limit` bytes of logits and
/// keys, all KV heads together) the keys are widened to f32 (the operands are derived
/// statistics: rounding them to f16 / bf16 would change the scores) and checked, one strided
/// batched GEMM over the KV heads gives every key's product with every operand row of its
/// group's query heads, and an elementwise step combines them into the logit (double). Then the
/// sinks are left out, a chunked softmax per query head (double), the group mean. `offset` is
/// where the step's scratch starts.
template <class L, row_source R>
void expected_attention_steps(const L& launch, status_word* st, const layer_inputs<R>& in, const expectation& e,
                              const std::int64_t* order, score_view out, std::span<std::byte> scratch,
                              std::size_t offset, std::int64_t limit = window_tile_limit) {
  check_query_inputs(in);
  const R keys = in.keys;
  const const_tensor_view q = in.queries;
  const std::int64_t n = keys.n_slots, d = keys.head_dim, hkv = keys.n_heads, hq = q.n_heads, group = hq / hkv;
  const std::int64_t m = q.n_slots, nc = detail::chunks(n), sinks = std::min(e.sinks, n), future = e.future;
  const rope rot = in.rotary.value_or(e.rotary);  // the layer's own RoPE wins
  const std::int32_t dims = in.rotary || e.rotated ? rot.checked_dims(std::int32_t(d)) : 0, half = dims / 2;
  const double scale = in.scale > 0.f ? in.scale : 1.0 / sqrt(double(d));
  const double cov_coef = e.covariance ? scale * scale / (2.0 * double(m)) : 0.0;
  const bool cov = e.covariance, matrix = e.matrix(m, d, n);
  const std::int64_t srows = expected_scratch::stat_rows(m, cov), rq = expected_scratch::op_rows(m, d, cov, matrix);
  const std::int64_t cols = group * rq;  // operand rows of one KV head's query heads
  const std::int64_t* qpos = in.query_pos.data();
  detail::carver c{scratch.data(), offset};
  const auto w = detail::expected_scratch::carve(c, hq, hkv, m, d, n, cov, matrix, L::gemm_scratch_bytes(), limit);
  float *table = w.table, *stats = w.stats, *ops = matrix ? w.ops : w.stats, *kt = w.keys, *lg = w.logits;
  double *mu = w.mu, *z = w.z, *pmax = w.pmax, *psum = w.psum, *rmax = w.rmax, *rinv = w.rinv;
  const auto gemm = launch.gemm_scratch(w.gemm);
  // Element el of query i of head qh turned back to before RoPE.
  const auto pre = [=] INFKV_HOST_DEVICE(std::int64_t i, std::int64_t qh, std::int64_t el) {
    const void* row = q.row(i, std::int32_t(qh));
    const std::int32_t p = rope_pair_of(rot.style, el, dims);
    if (p < 0) return detail::load(q.type, row, el);
    std::int32_t a = 0, b = 0;
    rope_pair(rot.style, p, dims, a, b);
    const float xa = detail::load(q.type, row, a), xb = detail::load(q.type, row, b);
    const float cs = table[i * d + p], sn = -table[i * d + half + p];
    return el == a ? xa * cs - xb * sn : xa * sn + xb * cs;
  };
  launch.for_each((m + 1) * half, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t i = x / half;
    const auto p = std::int32_t(x % half);
    const double fr = rope_frequency(rot, p, dims);
    if (i < m) {
      if (p == 0 && (qpos[i] < -max_position || qpos[i] > max_position))
        detail::record(st, encode(fault::bad_position, 1, 0, i));
      const double a = double(qpos[i]) * fr;
      table[i * d + p] = float(cos(a)), table[i * d + half + p] = float(sin(a));
      return;
    }
    std::int64_t t0 = 0;  // positions beyond 2^62 are recorded above and skipped here
    for (std::int64_t k = 0; k < m; ++k) t0 = qpos[k] >= t0 && qpos[k] <= max_position ? qpos[k] + 1 : t0;
    double cs = 0, sn = 0;
    for (std::int64_t t = t0; t < t0 + future; ++t) cs += cos(double(t) * fr), sn += sin(double(t) * fr);
    table[m * d + p] = float(cs / double(future)), table[m * d + half + p] = float(sn / double(future));
  });
  launch.for_each(hq * d, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t qh = x / d, el = x % d;
    double s = 0.0;
    for (std::int64_t i = 0; i < m; ++i) {
      const float v = detail::load(q.type, q.row(i, std::int32_t(qh)), el);
      if (!detail::finite(v)) detail::record(st, encode(fault::query_not_finite, qh, el, i));
      s += pre(i, qh, el);
    }
    mu[x] = s / double(m);
  });
  // Row 0 of each query head: mu'; row i: c'_i (centred query i - 1 under the mean rotation).
  launch.for_each(hq * srows * d, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t qh = x / (srows * d), r = (x / d) % srows, el = x % d;
    const auto centred = [&](std::int64_t k) {
      return r == 0 ? mu[qh * d + k] : double(pre(r - 1, qh, k)) - mu[qh * d + k];
    };
    const std::int32_t p = rope_pair_of(rot.style, el, dims);
    double v = centred(el);
    if (p >= 0) {
      std::int32_t a = 0, b = 0;
      rope_pair(rot.style, p, dims, a, b);
      const double xa = centred(a), xb = centred(b), cs = table[m * d + p], sn = table[m * d + half + p];
      v = el == a ? xa * cs - xb * sn : xa * sn + xb * cs;
    }
    stats[x] = float(v);
  });
  if (matrix) {  // operand rows: mu', then Sigma' (times s^2 / 2m) row by row
    launch.for_each(hq * d, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      ops[(x / d) * rq * d + x % d] = stats[(x / d) * srows * d + x % d];
    });
    // Per query head: C'^T is the d x m column-major matrix of its centred queries (ld d);
    // Sigma' = cov_coef C'^T (C'^T)^T, d x d, symmetric, so its columns are its rows.
    gemm.gemm_strided_batched(blas_op::n, blas_op::t, d, d, m, float(cov_coef), stats + d, dtype::f32, d, srows * d,
                              stats + d, dtype::f32, d, srows * d, 0.f, ops + d, dtype::f32, d, rq * d, hq);
  }
  for (std::int64_t j0 = 0; j0 < n; j0 += w.tile) {
    const std::int64_t mt = std::min(w.tile, n - j0);
    // The tile's keys in f32, rows of d elements (adjacent threads read and write adjacent
    // elements): KV head h's is the d x mt column-major matrix at kt + h mt d.
    launch.for_each(hkv * mt * d, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t h = x / (mt * d), j = j0 + (x / d) % mt, el = x % d;
      const float k = detail::load(keys.type, keys.row(j, std::int32_t(h)), el);
      if (!detail::finite(k)) detail::record(st, encode(fault::key_not_finite, h, el, j));
      kt[x] = k;
    });
    // Per KV head: the mt x cols products of its keys with its query heads' operand rows (d x cols,
    // ld d), column-major (ldc mt): operand row r of query head h G + g at lg + h mt cols + (g rq + r) mt.
    gemm.gemm_strided_batched(blas_op::t, blas_op::n, mt, cols, d, 1.f, kt, dtype::f32, d, mt * d, ops, dtype::f32, d,
                              cols * d, 0.f, lg, dtype::f32, mt, mt * cols, hkv);
    launch.for_each(hq * mt, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t qh = x / mt, jl = x % mt, j = j0 + jl, h = qh / group;
      const float* col = lg + (h * cols + (qh % group) * rq) * mt + jl;  // operand row r at col[r mt]
      double quad = 0.0;
      if (matrix) {
        const float* k = kt + (h * mt + jl) * d;
        for (std::int64_t a = 0; a < d; ++a) quad += double(col[(1 + a) * mt]) * double(k[a]);
      } else {
        for (std::int64_t i = 1; i < srows; ++i) quad += double(col[i * mt]) * double(col[i * mt]);
        quad *= cov_coef;
      }
      const double zx = z[qh * n + j] = scale * double(col[0]) + quad;
      if (!detail::finite(float(zx))) {  // sinks are left out of the softmax: their logits do not matter
        bool sink = false;
        for (std::int64_t r = 0; r < sinks; ++r) sink = sink || order[r] == j;
        if (!sink) detail::record(st, encode(fault::logit_overflow, h, qh, j));
      }
    });
  }
  launch.for_each(sinks * hq, [=] INFKV_HOST_DEVICE(std::int64_t x) { z[(x % hq) * n + order[x / hq]] = -INFINITY; });
  launch.for_each(hq * nc, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t qh = x / nc, cc = x % nc;
    double mx = -INFINITY;
    for (std::int64_t j = cc * detail::chunk; j < std::min(n, (cc + 1) * detail::chunk); ++j)
      mx = fmax(mx, z[qh * n + j]);
    pmax[x] = mx;
  });
  launch.for_each(hq, [=] INFKV_HOST_DEVICE(std::int64_t qh) {
    double mx = -INFINITY;
    for (std::int64_t cc = 0; cc < nc; ++cc) mx = fmax(mx, pmax[qh * nc + cc]);
    rmax[qh] = mx;
  });
  launch.for_each(hq * nc, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t qh = x / nc, cc = x % nc;
    double s = 0;
    if (rmax[qh] != -INFINITY)
      for (std::int64_t j = cc * detail::chunk; j < std::min(n, (cc + 1) * detail::chunk); ++j)
        s += exp(z[qh * n + j] - rmax[qh]);
    psum[x] = s;
  });
  launch.for_each(hq, [=] INFKV_HOST_DEVICE(std::int64_t qh) {
    double s = 0;
    for (std::int64_t cc = 0; cc < nc; ++cc) s += psum[qh * nc + cc];
    rinv[qh] = s > 0 ? 1.0 / s : 0.0;
  });
  launch.for_each(keys.n_heads * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t h = x / n, j = x % n;
    if (z[h * group * n + j] == -INFINITY) {  // a sink, left out of the softmax
      out(h, j) = 1.f;
      return;
    }
    double s = 0.0;
    for (std::int64_t g = 0; g < group; ++g) {
      const std::int64_t qh = h * group + g;
      s += exp(z[qh * n + j] - rmax[qh]) * rinv[qh];
    }
    out(h, j) = float(s / double(group));
  });
}

}  // namespace infkv::cuda::detail
