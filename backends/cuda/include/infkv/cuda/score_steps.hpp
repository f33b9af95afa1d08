// infkv CUDA backend: the two score sources with their own multi-step algorithms, as steps run
// by a launcher L (see steps.hpp): KeyDiff's key diversity and windowed attention (SnapKV,
// Inf-MLLM, TOVA's last query, H2O's step). basic_backend::score and h2o_observe_steps call them.
#pragma once

#include "common.hpp"

namespace infkv::cuda::detail {

/// -cos(k_j, mean unit key) per KV head (KeyDiff): inverse norms, chunk sums of unit keys,
/// the anchor, its norm, then the cosines.
template <class L, row_source R>
void keydiff_steps(const L& launch, const R& keys, score_view out, std::span<std::byte> scratch) {
  validate(keys, "keys");
  const std::int64_t n = keys.n_slots, d = keys.head_dim, hkv = keys.n_heads, nc = detail::chunks(n);
  status_word* st = reinterpret_cast<status_word*>(scratch.data());
  detail::carver c{scratch.data(), 64};
  const auto w = detail::keydiff_scratch::carve(c, hkv, n, d);
  float *part = w.part, *anchor = w.anchor, *inv_an = w.inv_an;
  launch.for_each(hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto h = std::int32_t(i / n);
    const std::int64_t j = i % n;
    const void* row = keys.row(j, h);
    float norm = 0.f;
    for (std::int64_t e = 0; e < d; ++e) {
      const float x = detail::load(keys.type, row, e);
      if (!detail::finite(x)) detail::record(st, encode(fault::key_not_finite, h, e, j));
      norm += x * x;
    }
    out(h, j) = norm > 0.f ? 1.f / sqrtf(norm) : 0.f;
  });
  launch.for_each(hkv * nc * d, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const std::int64_t e = i % d, cc = (i / d) % nc;
    const auto h = std::int32_t(i / (d * nc));
    float s = 0.f;
    for (std::int64_t j = cc * detail::chunk; j < std::min(n, (cc + 1) * detail::chunk); ++j)
      s += detail::load(keys.type, keys.row(j, h), e) * out(h, j);
    part[i] = s;
  });
  launch.for_each(hkv * d, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const std::int64_t h = i / d, e = i % d;
    float s = 0.f;
    for (std::int64_t cc = 0; cc < nc; ++cc) s += part[(h * nc + cc) * d + e];
    anchor[i] = s;
  });
  launch.for_each(hkv, [=] INFKV_HOST_DEVICE(std::int64_t h) {
    float s = 0.f;
    for (std::int64_t e = 0; e < d; ++e) s += anchor[h * d + e] * anchor[h * d + e];
    inv_an[h] = s > 0.f ? 1.f / sqrtf(s) : 0.f;
  });
  launch.for_each(hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto h = std::int32_t(i / n);
    const std::int64_t j = i % n;
    out(h, j) = -detail::dot(keys.type, keys.row(j, h), dtype::f32, anchor + h * d, d) * out(h, j) * inv_an[h];
  });
}

/// Attention mass the last `window` queries give each cached key (softmax over the visible
/// keys), per KV head (mean over its G query heads) or per query head. Three steps, nothing of
/// size queries x keys materialised: per (query row, key tile) the running max and normaliser,
/// per query row their combination, per (KV head, key) the mass, logits recomputed.
/// `offset` is where the step's scratch starts (after the status word and anything kept).
template <class L, row_source R>
void window_attention_steps(const L& launch, const layer_inputs<R>& in, std::int64_t window, bool per_query_head,
                            score_view out, std::span<std::byte> scratch, std::size_t offset) {
  validate(in.keys, "keys");
  validate(in.queries, "queries");
  INFKV_REQUIRE(in.queries.head_dim == in.keys.head_dim, "queries.head_dim", in.queries.head_dim,
                "must equal keys.head_dim (", in.keys.head_dim, ")");
  INFKV_REQUIRE(in.queries.n_heads % in.keys.n_heads == 0, "queries.n_heads", in.queries.n_heads,
                "must be a multiple of keys.n_heads (", in.keys.n_heads, ")");
  INFKV_REQUIRE(std::int64_t(in.query_pos.size()) == in.queries.n_slots, "query_pos.size()", in.query_pos.size(),
                "must equal the number of queries (", in.queries.n_slots, ")");
  INFKV_REQUIRE(in.queries.n_slots >= 1, "queries.n_slots", in.queries.n_slots, "needs at least one query");
  INFKV_REQUIRE(std::isfinite(in.scale) && in.scale >= 0.f, "scale", in.scale, "must be finite and >= 0");
  const R keys = in.keys;
  const tensor_view q = in.queries;
  const std::int64_t n = keys.n_slots, d = keys.head_dim, hkv = keys.n_heads, hq = q.n_heads, group = hq / hkv;
  const std::int64_t w = std::min(window, q.n_slots), q0 = q.n_slots - w, rows = hq * w;
  const std::int64_t tiles = detail::tiles(n);
  const float scale = in.scale > 0.f ? in.scale : 1.f / std::sqrt(float(d));
  const token* tok = in.tokens.data();
  const std::int64_t* qpos = in.query_pos.data();
  status_word* st = reinterpret_cast<status_word*>(scratch.data());
  detail::carver c{scratch.data(), offset};
  const auto stats = detail::softmax_scratch::carve(c, rows, n);
  float *tmax = stats.tmax, *tsum = stats.tsum, *rmax = stats.rmax, *rcoef = stats.rcoef;
  // Row r = query head * w + i (query q0 + i); its KV head is (r / w) / group.
  launch.for_each(rows * tiles, [=] INFKV_HOST_DEVICE(std::int64_t x) {
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
  launch.for_each(rows, [=] INFKV_HOST_DEVICE(std::int64_t r) {
    const std::int64_t qh = r / w, i = r % w;
    const void* qr = q.row(q0 + i, std::int32_t(qh));
    for (std::int64_t e = 0; e < d; ++e)
      if (!detail::finite(detail::load(q.type, qr, e)))
        detail::record(st, encode(fault::query_not_finite, qh, e, q0 + i));
    float m = -INFINITY, s = 0.f;
    for (std::int64_t t = 0; t < tiles; ++t) m = fmaxf(m, tmax[r * tiles + t]);
    for (std::int64_t t = 0; t < tiles; ++t)
      if (tsum[r * tiles + t] > 0.f) s += tsum[r * tiles + t] * expf(tmax[r * tiles + t] - m);
    rmax[r] = m, rcoef[r] = s > 0.f ? 1.f / s : 0.f;
  });
  launch.for_each(hkv * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const auto h = std::int32_t(x / n);
    const std::int64_t j = x % n;
    const void* kr = keys.row(j, h);
    for (std::int64_t e = 0; e < d; ++e)
      if (!detail::finite(detail::load(keys.type, kr, e))) detail::record(st, encode(fault::key_not_finite, h, e, j));
    float total = 0.f;
    for (std::int64_t g = 0; g < group; ++g) {
      const std::int64_t qh = h * group + g;
      float mass = 0.f;
      for (std::int64_t i = 0; i < w; ++i) {
        const std::int64_t r = qh * w + i;
        if (tok[j].pos > qpos[q0 + i] || rcoef[r] == 0.f) continue;
        mass += expf(scale * detail::dot(q.type, q.row(q0 + i, std::int32_t(qh)), keys.type, kr, d) - rmax[r]) * rcoef[r];
      }
      if (per_query_head) out(qh, j) = mass;
      total += mass;
    }
    if (!per_query_head) out(h, j) = total / float(group);
  });
}

}  // namespace infkv::cuda::detail
