// infkv CUDA backend: what every path of the window attention shares (window_steps.hpp,
// window_fused_steps.hpp): the layout of its query rows and the combination of per-row partial
// maxima and normalisers into each row's statistics.
#pragma once

#include "block_steps.hpp"
#include "score_steps.hpp"

namespace infkv::cuda::detail {

/// The window attention's row layout: row r = query head * w + i (query q0 + i); its KV head is
/// (r / w) / group, so the rows of KV head h are [h * group * w, (h + 1) * group * w).
struct window_rows {
  std::int64_t n, d, hkv, hq, group, w, q0, rows;
  float scale;
  template <row_source R>
  static window_rows of(const layer_inputs<R>& in, std::int64_t window) {
    const std::int64_t n = in.keys.n_slots, d = in.keys.head_dim, hkv = in.keys.n_heads, hq = in.queries.n_heads;
    const std::int64_t w = std::min(window, in.queries.n_slots);
    return {n,
            d,
            hkv,
            hq,
            hq / hkv,
            w,
            in.queries.n_slots - w,
            hq * w,
            in.scale > 0.f ? in.scale : 1.f / std::sqrt(float(d))};
  }
  /// Key j's (at position `pos`) attention mass under KV head h: over its group's query heads and
  /// the window's queries that see the key, exp(logit(qh, i) - rmax[r]) x rcoef[r], r = qh * w + i;
  /// written per query head, or the group's mean per KV head.
  template <class Logit>
  INFKV_HOST_DEVICE void key_mass(std::int64_t h, std::int64_t j, std::int64_t pos, const std::int64_t* qpos,
                                  const float* rmax, const float* rcoef, bool per_query_head, score_view out,
                                  Logit logit) const {
    float total = 0.f;
    for (std::int64_t gg = 0; gg < group; ++gg) {
      const std::int64_t qh = h * group + gg;
      float mass = 0.f;
      for (std::int64_t i = 0; i < w; ++i) {
        const std::int64_t r = qh * w + i;
        if (pos > qpos[q0 + i] || rcoef[r] == 0.f) continue;
        mass += expf(logit(qh, i) - rmax[r]) * rcoef[r];
      }
      if (per_query_head) out(qh, j) = mass;
      total += mass;
    }
    if (!per_query_head) out(h, j) = total / float(group);
  }
};

/// Per query row: the combination of its `parts` partial maxima and normalisers (row r's at
/// [r parts, (r + 1) parts)); queries are checked here. A block-level step, a warp per row (8 rows
/// per block, every SM busy): lane l takes parts l, l + 32, ...; the lanes' maxima give the row's,
/// then lane 0 adds the lanes' sums in lane order (deterministic).
template <class L>
void window_row_statistics(const L& launch, status_word* st, const const_tensor_view& q, const window_rows& g,
                           const softmax_scratch& s, std::int64_t parts) {
  constexpr int threads = 256, lanes = 32, per_block = threads / lanes;
  const std::int64_t rows = g.rows, w = g.w, q0 = g.q0, d = g.d;
  float *tmax = s.tmax, *tsum = s.tsum, *rmax = s.rmax, *rcoef = s.rcoef;
  launch.for_blocks((rows + per_block - 1) / per_block, threads, std::size_t(2 * threads) * 4,
                    [=] INFKV_HOST_DEVICE(const typename L::block_context& c) {
                      const int warp = c.thread / lanes, lane = c.thread % lanes;
                      const std::int64_t r = c.block * per_block + warp;
                      float* lane_max = reinterpret_cast<float*>(c.shared) + warp * lanes;
                      float* lane_sum = lane_max + threads;
                      const bool mine = r < rows;  // the same for a whole warp
                      if (mine) {
                        const std::int64_t qh = r / w, i = r % w;
                        const void* qr = q.row(q0 + i, std::int32_t(qh));
                        for (std::int64_t e = lane; e < d; e += lanes)
                          if (!detail::finite(detail::load(q.type, qr, e)))
                            detail::record(st, encode(fault::query_not_finite, qh, e, q0 + i));
                        float m = -INFINITY;
                        for (std::int64_t t = lane; t < parts; t += lanes) m = fmaxf(m, tmax[r * parts + t]);
                        lane_max[lane] = m;
                      }
                      c.warp_sync();
                      if (mine) {
                        float m = -INFINITY, sum = 0.f;
                        for (int l = 0; l < lanes; ++l) m = fmaxf(m, lane_max[l]);
                        for (std::int64_t t = lane; t < parts; t += lanes)
                          if (tsum[r * parts + t] > 0.f)
                            sum += tsum[r * parts + t] * block_expf(c, tmax[r * parts + t] - m);
                        lane_sum[lane] = sum;
                        if (lane == 0) rmax[r] = m;
                      }
                      c.warp_sync();
                      if (mine && lane == 0) {
                        float sum = 0.f;
                        for (int l = 0; l < lanes; ++l) sum += lane_sum[l];
                        rcoef[r] = sum > 0.f ? 1.f / sum : 0.f;
                      }
                    });
}

}  // namespace infkv::cuda::detail
