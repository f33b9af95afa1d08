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

#include <infkv/kv_view.hpp>
#include <infkv/policy.hpp>
#include <infkv/rope.hpp>
#include <infkv/scores.hpp>

#include "attention.hpp"
#include "executor.hpp"
#include "kernels.hpp"

namespace infkv::cpu {

namespace detail {

/// Floats shared by the workers: each window query's cos and sin per rotary pair, then the mean
/// rotation's ((m + 1) rows of d floats).
inline std::int64_t expected_shared_floats(std::int64_t m, std::int64_t d) { return lines((m + 1) * d); }
/// Floats per worker: mu' and the m centred queries of each of the G query heads, a key row,
/// the G rows of logits.
inline std::int64_t expected_worker_floats(std::int64_t group, std::int64_t m, std::int64_t d, std::int64_t n) {
  return lines(group * (m + 1) * d) + lines(d) + lines(group * n);
}

/// Rotates pair (a, b) of x by (c, s): x_a c - x_b s, x_a s + x_b c.
inline void turn(float* x, std::int32_t a, std::int32_t b, float c, float s) {
  const float xa = x[a], xb = x[b];
  x[a] = xa * c - xb * s;
  x[b] = xa * s + xb * c;
}

}  // namespace detail

/// Scratch floats of expected_attention_into for `workers` workers.
inline std::int64_t expected_scratch_floats(std::int64_t workers, std::int64_t group, std::int64_t m, std::int64_t d,
                                            std::int64_t n) {
  return detail::expected_shared_floats(m, d) + workers * detail::expected_worker_floats(group, m, d, n);
}

/// Expected Attention scores [Hkv][n_slots] of `in` (every query of `in` is a window query; see
/// the file comment) into `out`; `order` is the slots' time order. `scratch`:
/// expected_scratch_floats(workers(ex, Hkv), G, n_q, d, n) floats. Non-finite keys or queries
/// raise naming slot and head.
template <row_source R>
void expected_attention_into(const layer_inputs<R>& in, const expectation& e, const std::int64_t* order, score_view out,
                             float* scratch, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  const R& keys = in.keys;
  const tensor_view& q = in.queries;
  const std::int64_t n = keys.n_slots, d = keys.head_dim, m = q.n_slots, group = q.n_heads / keys.n_heads;
  INFKV_REQUIRE(out.rows == keys.n_heads && out.cols == n, "out.rows", out.rows, "must be ", keys.n_heads, " x ", n,
                "; out.cols = ", out.cols);
  const rope& rot = in.rotary ? *in.rotary : e.rotary;  // the layer's own RoPE wins
  const std::int32_t dims = in.rotary || e.rotated ? rot.checked_dims(std::int32_t(d)) : 0, half = dims / 2;
  const float scale = in.scale > 0.f ? in.scale : 1.f / std::sqrt(float(d));
  const float cov_coef = e.covariance ? scale * scale / (2.f * float(m)) : 0.f;
  const std::int64_t sinks = std::min(e.sinks, n);
  // Rotation tables: query i's cos / sin per pair, then the mean over the future positions.
  float* table = scratch;
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
  float* workers_base = scratch + detail::expected_shared_floats(m, d);
  const std::int64_t per_worker = detail::expected_worker_floats(group, m, d, n);
  parallel_for_workers(ex, keys.n_heads, [&](std::int64_t w, std::int64_t h) {
    float* stats = workers_base + w * per_worker;  // per query head: mu', then c'_1 .. c'_m
    float* k = stats + detail::lines(group * (m + 1) * d);
    float* z = k + detail::lines(d);
    for (std::int64_t g = 0; g < group; ++g) {
      const auto qh = std::int32_t(h * group + g);
      float* mu = stats + g * (m + 1) * d;
      float* c = mu + d;
      std::fill(mu, mu + d, 0.f);
      for (std::int64_t i = 0; i < m; ++i) {
        float* x = c + i * d;
        to_f32(q.type, q.row(i, qh), x, d);
        if (!detail::all_finite(x, d)) [[unlikely]] detail::fail_not_finite(q, "queries", i, 1, qh);
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
      if (!detail::all_finite(k, d)) [[unlikely]] detail::fail_not_finite(keys, "keys", j, 1, std::int32_t(h));
      for (std::int64_t g = 0; g < group; ++g) {
        const float* mu = stats + g * (m + 1) * d;
        float quad = 0.f;
        if (e.covariance)
          for (std::int64_t i = 1; i <= m; ++i) {
            const float proj = detail::dot_of(mu + i * d, k, d);
            quad = detail::fmadd(proj, proj, quad);
          }
        z[g * n + j] = scale * detail::dot_of(mu, k, d) + cov_coef * quad;
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
      if (!std::isfinite(sum)) [[unlikely]] detail::fail_not_finite(values, "values", j, 1, h);
      const auto norm = float(std::sqrt(sum));
      for (std::int64_t r = h * per; r < (h + 1) * per; ++r) s(r, j) *= norm;
    }
}

}  // namespace infkv::cpu
