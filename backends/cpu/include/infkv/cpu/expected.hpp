// infkv CPU backend: Expected Attention's score source (policies/expected_attention.hpp) and the
// value-norm weighting any per-KV-head score can take.
//
// Expected Attention per KV head h, for each query head of its group: the m window queries are
// turned back to before RoPE (rotation by -pos), mu = their mean, c_i = q_i - mu; with R the mean
// rotation over the next `future` positions, mu' = R mu and c'_i = R c_i, so that
// k' (R Sigma R') k = (1/m) sum_i (c'_i . k)^2 with Sigma the window's covariance (divided by m,
// as kvpress). z_j = s mu'.k_j + s^2/(2m) sum_i (c'_i . k_j)^2, a softmax over the keys (the first
// `sinks` in time order left out, scored 1, above every probability), the mean over the group.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include <infkv/detail/carver.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/policy.hpp>
#include <infkv/rope.hpp>
#include <infkv/scores.hpp>

#include "attention.hpp"
#include "detail/kernels.hpp"
#include "detail/softmax.hpp"
#include "executor.hpp"

namespace infkv::cpu {

namespace detail {

/// Expected Attention's scratch: shared by the workers, each window query's cos and sin per
/// rotary pair, then the mean rotation's ((m + 1) rows of d floats); per worker, mu' and the m
/// centred queries of each of the G query heads, a key row, the G rows of logits.
struct expected_layout {
  std::int64_t workers, group, m, d, n;
  struct worker_pieces {
    float *stats, *k, *z;
  };
  float* shared(infkv::detail::carver& c) const { return c.take<float>((m + 1) * d); }
  worker_pieces worker(infkv::detail::carver& c) const {
    return {c.take<float>(group * (m + 1) * d), c.take<float>(d), c.take<float>(group * n)};
  }
  std::size_t worker_bytes() const {
    return infkv::detail::bytes_of([&](infkv::detail::carver& c) { worker(c); });
  }
  std::size_t bytes() const {
    return infkv::detail::bytes_of([&](infkv::detail::carver& c) { shared(c); }) +
           std::size_t(workers) * worker_bytes();
  }
};

/// Rotates pair (a, b) of x by (c, s): x_a c - x_b s, x_a s + x_b c.
inline void turn(float* x, std::int32_t a, std::int32_t b, float c, float s) {
  const float xa = x[a], xb = x[b];
  x[a] = xa * c - xb * s;
  x[b] = xa * s + xb * c;
}

/// The largest |element| of rows [0, rows) of `head` in `t`, and the row holding it.
template <row_source R>
std::pair<float, std::int64_t> largest(const R& t, std::int32_t head, std::int64_t rows) {
  std::vector<float> x(static_cast<std::size_t>(t.head_dim));
  std::pair<float, std::int64_t> top{0.f, 0};
  for (std::int64_t i = 0; i < rows; ++i) {
    to_f32(t.type, t.row(i, head), x.data(), t.head_dim);
    for (const float v : x)
      if (std::abs(v) > top.first) top = {std::abs(v), i};
  }
  return top;
}

/// Raises for a non-finite expected logit of key j under query head qh (sinks, which the softmax
/// leaves out, are exempt): it names the window query with the largest element (counted from
/// `first_query`) when the query statistics `stats` themselves overflowed, else the key, with the
/// queries' largest element.
template <row_source R>
void on_logit_overflow(const const_tensor_view& q, std::int64_t first_query, const R& keys, std::int32_t qh,
                       std::int64_t j, const std::int64_t* order, std::int64_t sinks, std::span<const float> stats) {
  if (std::find(order, order + sinks, j) != order + sinks) return;
  auto [qmax, qi] = largest(q, qh, q.n_slots);
  qi += first_query;  // as the caller counts the queries
  if (!all_finite(stats.data(), std::int64_t(stats.size())))
    infkv::detail::fail("infkv: queries[slot ", qi, ", head ", qh, "] (largest |element| ", qmax,
                        "): the mean and covariance of expected_attention's window overflow f32: queries must be "
                        "small enough for their sums and squares");
  const std::int32_t h = std::int32_t(qh / (q.n_heads / keys.n_heads));
  const auto [kmax, kj] = largest(keys, h, keys.n_slots);
  infkv::detail::fail(
      "infkv: keys[slot ", j, ", head ", h, "]: expected_attention's logit under the window queries of ", "head ", qh,
      " overflows f32 (largest |element|: keys ", kmax, " at slot ", kj, ", queries ", qmax, " at queries[slot ", qi,
      ", head ", qh, "]): keys and queries must be small enough that s^2 ", "(q.k)^2 / 2 stays finite");
}

}  // namespace detail

/// Expected Attention scores [Hkv][n_slots] of `in` (every query of `in` is a window query; see
/// the file comment) into `out`; `order` is the slots' time order. `scratch`:
/// detail::expected_layout{workers(ex, Hkv), G, n_q, d, n}.bytes() bytes, 64-byte aligned. Non-finite keys or queries,
/// and keys or queries so large that a logit overflows f32, raise naming slot and head (queries counted from
/// `first_query`, for a window cut from a longer query view).
template <row_source R>
void expected_attention_into(const layer_inputs<R>& in, const expectation& e, const std::int64_t* order, score_view out,
                             std::byte* scratch, const executor& ex = {}, std::int64_t first_query = 0) {
  detail::check_attention_inputs(in);
  const R& keys = in.keys;
  const const_tensor_view& q = in.queries;
  const std::int64_t n = keys.n_slots, d = keys.head_dim, m = q.n_slots, group = q.n_heads / keys.n_heads;
  INFKV_REQUIRE(out.rows == keys.n_heads && out.cols == n, "out.rows", out.rows, "must be ", keys.n_heads, " x ", n,
                "; out.cols = ", out.cols);
  const rope& rot = in.rotary ? *in.rotary : e.rotary;  // the layer's own RoPE wins
  const std::int32_t dims = in.rotary || e.rotated ? rot.checked_dims(std::int32_t(d)) : 0, half = dims / 2;
  const float scale = in.scale > 0.f ? in.scale : 1.f / std::sqrt(float(d));
  const float cov_coef = e.covariance ? scale * scale / (2.f * float(m)) : 0.f;
  const std::int64_t sinks = std::min(e.sinks, n);
  const detail::expected_layout lay{workers(ex, keys.n_heads), group, m, d, n};
  infkv::detail::carver shared{scratch};
  // Rotation tables: query i's cos / sin per pair, then the mean over the future positions.
  float* table = lay.shared(shared);
  std::int64_t t0 = 0;  // the first future position: after the newest window query
  for (std::size_t i = 0; i < in.query_pos.size(); ++i) {
    const std::int64_t p = in.query_pos[i];
    INFKV_REQUIRE(half == 0 || (p >= -max_position && p <= max_position), "query_pos[" + std::to_string(i) + "]", p,
                  "must be in [-2^62, 2^62]: expected_attention turns each query back by its position");
    t0 = std::max(t0, p + 1);
  }
  for (std::int32_t k = 0; k < half; ++k) {
    const double w = rope_frequency(rot, k, dims);
    for (std::int64_t i = 0; i < m; ++i) {
      const double a = double(in.query_pos[std::size_t(i)]) * w;
      table[i * d + k] = float(std::cos(a)), table[i * d + half + k] = float(std::sin(a));
    }
    double c = 0, s = 0;
    for (std::int64_t t = t0; t < t0 + e.future; ++t) c += std::cos(double(t) * w), s += std::sin(double(t) * w);
    table[m * d + k] = float(c / double(e.future)), table[m * d + half + k] = float(s / double(e.future));
  }
  std::byte* workers_base = scratch + shared.size();
  const std::size_t per_worker = lay.worker_bytes();
  parallel_for_workers(ex, keys.n_heads, [&](std::int64_t w, std::int64_t h) {
    infkv::detail::carver mine{workers_base + std::size_t(w) * per_worker};
    const auto pieces = lay.worker(mine);
    float *const stats = pieces.stats, *const k = pieces.k, *const z = pieces.z;  // stats per query head: mu', c'_1..m
    for (std::int64_t g = 0; g < group; ++g) {
      const auto qh = std::int32_t(h * group + g);
      float* mu = stats + g * (m + 1) * d;
      float* c = mu + d;
      std::fill(mu, mu + d, 0.f);
      for (std::int64_t i = 0; i < m; ++i) {
        float* x = c + i * d;
        to_f32(q.type, q.row(i, qh), x, d);
        if (!detail::all_finite(x, d)) [[unlikely]]
          detail::fail_query_not_finite(q, first_query, i, qh);
        for (std::int32_t p = 0; p < half; ++p) {  // rotate back by -pos_i
          std::int32_t a = 0, b = 0;
          rope_pair(rot.style, p, dims, a, b);
          detail::turn(x, a, b, table[i * d + p], -table[i * d + half + p]);
        }
        for (std::int64_t el = 0; el < d; ++el) mu[el] += x[el];
      }
      for (std::int64_t el = 0; el < d; ++el) mu[el] /= float(m);
      for (std::int64_t i = e.covariance ? 0 : m; i <= m; ++i) {  // c'_i = R (x_i - mu), then mu' = R mu
        float* x = i == m ? mu : c + i * d;
        if (i < m)
          for (std::int64_t el = 0; el < d; ++el) x[el] -= mu[el];
        for (std::int32_t p = 0; p < half; ++p) {
          std::int32_t a = 0, b = 0;
          rope_pair(rot.style, p, dims, a, b);
          detail::turn(x, a, b, table[m * d + p], table[m * d + half + p]);
        }
      }
    }
    for (std::int64_t j = 0; j < n; ++j) {
      to_f32(keys.type, keys.row(j, std::int32_t(h)), k, d);
      if (!detail::all_finite(k, d)) [[unlikely]]
        detail::fail_not_finite(keys, "keys", j, 1, std::int32_t(h));
      for (std::int64_t g = 0; g < group; ++g) {
        const float* mu = stats + g * (m + 1) * d;
        float quad = 0.f;
        if (e.covariance)
          for (std::int64_t i = 1; i <= m; ++i) {
            const float proj = detail::dot_of(mu + i * d, k, d);
            quad = detail::fmadd(proj, proj, quad);
          }
        const float zj = z[g * n + j] = scale * detail::dot_of(mu, k, d) + cov_coef * quad;
        if (!std::isfinite(zj)) [[unlikely]]
          detail::on_logit_overflow(q, first_query, keys, std::int32_t(h * group + g), j, order, sinks,
                                    {mu, std::size_t((e.covariance ? m + 1 : 1) * d)});
      }
    }
    float* row = out.row(h);
    std::fill(row, row + n, 0.f);
    for (std::int64_t g = 0; g < group; ++g) {
      float* zg = z + g * n;
      for (std::int64_t r = 0; r < sinks; ++r) zg[order[r]] = -std::numeric_limits<float>::infinity();
      if (sinks == n) break;
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, zg[j]);
      double sum = 0;
      for (std::int64_t j = 0; j < n; ++j) sum += std::exp(double(zg[j]) - double(mx));
      const double inv = 1.0 / (sum * double(group));
      for (std::int64_t j = 0; j < n; ++j) row[j] += float(std::exp(double(zg[j]) - double(mx)) * inv);
    }
    for (std::int64_t r = 0; r < sinks; ++r) row[order[r]] = 1.f;
  });
}

/// Multiplies every score row by the value norms of its KV head: row r belongs to head
/// r / (s.rows / values.n_heads) (KV-head rows, or the query heads of each group). A non-finite
/// value raises naming slot and head.
template <row_source R>
void value_norm_into(score_view s, const R& values) {
  validate(values, "values");
  INFKV_REQUIRE(s.cols == values.n_slots && s.rows % values.n_heads == 0, "values.n_slots", values.n_slots,
                "value norms weight ", s.rows, " score rows of ", s.cols, " slots; values.n_heads = ", values.n_heads);
  const std::int64_t per = s.rows / values.n_heads, dv = values.head_dim;
  for (std::int32_t h = 0; h < values.n_heads; ++h)
    for (std::int64_t j = 0; j < s.cols; ++j) {
      const std::byte* row = static_cast<const std::byte*>(values.row(j, h));
      double sum = 0;
      float x[64];
      for (std::int64_t e0 = 0; e0 < dv; e0 += 64) {
        const std::int64_t len = std::min<std::int64_t>(64, dv - e0);
        to_f32(values.type, row + e0 * std::int64_t(size_of(values.type)), x, len);
        for (std::int64_t el = 0; el < len; ++el) sum += double(x[el]) * double(x[el]);
      }
      if (!std::isfinite(sum)) [[unlikely]]
        detail::fail_not_finite(values, "values", j, 1, h);
      const auto norm = float(std::sqrt(sum));
      for (std::int64_t r = h * per; r < (h + 1) * per; ++r) s(r, j) *= norm;
    }
}

}  // namespace infkv::cpu
