// infkv CPU backend: Expected Attention's score source (policies/expected_attention.hpp) and the
// value-norm weighting any per-KV-head score can take.
//
// Expected Attention per KV head h, for each query head of its group: the m window queries are
// turned back to before RoPE (rotation by -pos), mu = their mean, c_i = q_i - mu; with R the mean
// rotation over the next `future` positions, mu' = R mu and c'_i = R c_i, the covariance term is
// k' (R Sigma R') k with Sigma the window's covariance (divided by m, as kvpress), and
// z_j = s mu'.k_j + s^2/2 k_j' Sigma' k_j; a softmax over the keys (the first `sinks` in time
// order left out, scored 1, above every probability), the mean over the group.
// The covariance term is computed in whichever of two forms costs less for the shapes
// (covariance_as_matrix): Sigma' = (1/m) sum_i c'_i c'_i' as a d x d matrix, formed by GEMMs over
// blocks of queries and applied to a tile of keys at a time by GEMM (O(m d^2 + n d^2)), or the sum
// of squared projections (1/m) sum_i (c'_i . k_j)^2 (O(n m d)), for short windows. Sums over the
// queries (the mean, the matrix) and over the projections accumulate in double, the logits too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
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
/// rotary pair, then the mean rotation's ((m + 1) rows of d floats); per worker, the G rows of
/// logits (double), the mean before and after the rotation (double), a query row, mu' of each
/// query head, and
/// for the covariance term either the m centred queries of each query head (projections) or the
/// matrix form's pieces: the double accumulator, each query head's scaled Sigma' as GEMM tiles, a
/// block of centred queries (rows and transposed), the block's GEMM output, a key tile and its
/// output.
struct expected_layout {
  std::int64_t workers, group, m, d, n;
  bool covariance = true, matrix = false;
  struct worker_pieces {
    double *z, *mu, *mur, *acc;
    float *x, *mup, *c, *sk, *ct, *cb, *sout, *keys, *tout;
  };
  std::int64_t chunks() const { return (d + key_tile - 1) / key_tile; }
  std::int64_t d_pad() const { return (d + kernel_rows - 1) / kernel_rows * kernel_rows; }
  float* shared(infkv::detail::carver& c) const { return c.take<float>((m + 1) * d); }
  worker_pieces worker(infkv::detail::carver& c) const {
    worker_pieces w{};
    w.z = c.take<double>(group * n), w.mu = c.take<double>(d), w.mur = c.take<double>(d), w.x = c.take<float>(d);
    w.mup = c.take<float>(group * d);
    if (covariance && !matrix) w.c = c.take<float>(group * m * d);
    if (covariance && matrix) {
      w.acc = c.take<double>(d * d);
      w.sk = c.take<float>(group * chunks() * d * key_tile);
      w.ct = c.take<float>(d_pad() * key_tile), w.cb = c.take<float>(key_tile * d);
      w.sout = c.take<float>(d_pad() * key_tile);
      w.keys = c.take<float>(key_tile * d), w.tout = c.take<float>(key_tile * key_tile);
    }
    return w;
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
template <class T>
void turn(T* x, std::int32_t a, std::int32_t b, T c, T s) {
  const T xa = x[a], xb = x[b];
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
/// detail::expected_layout{workers(ex, Hkv), G, n_q, d, n, e.covariance, e.matrix(n_q, d, n)}.bytes()
/// bytes, 64-byte aligned. Non-finite keys or queries, and keys or queries so large that a logit
/// overflows f32, raise naming slot and head (queries counted from `first_query`, for a window cut
/// from a longer query view).
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
  const double scale = in.scale > 0.f ? in.scale : 1.0 / std::sqrt(double(d));
  const double cov_coef = scale * scale / (2.0 * double(m));
  const std::int64_t sinks = std::min(e.sinks, n);
  const detail::expected_layout lay{workers(ex, keys.n_heads), group, m, d, n, e.covariance, e.matrix(m, d, n)};
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
  // Turns x (a query turned back, or the mean) by the table's row `row` (the mean rotation: m).
  const auto rotate = [&](auto* x, std::int64_t row, bool back) {
    using T = std::remove_reference_t<decltype(*x)>;
    for (std::int32_t p = 0; p < half; ++p) {
      std::int32_t a = 0, b = 0;
      rope_pair(rot.style, p, dims, a, b);
      const T sn = table[row * d + half + p];
      detail::turn(x, a, b, T(table[row * d + p]), back ? -sn : sn);
    }
  };
  std::byte* workers_base = scratch + shared.size();
  const std::size_t per_worker = lay.worker_bytes();
  parallel_for_workers(ex, keys.n_heads, [&](std::int64_t w, std::int64_t h) {
    infkv::detail::carver mine{workers_base + std::size_t(w) * per_worker};
    const auto pc = lay.worker(mine);
    // Query i of query head qh, turned back to before RoPE, into pc.x.
    const auto query = [&](std::int64_t i, std::int32_t qh) {
      to_f32(q.type, q.row(i, qh), pc.x, d);
      if (!detail::all_finite(pc.x, d)) [[unlikely]]
        detail::fail_query_not_finite(q, first_query, i, qh);
      rotate(pc.x, i, true);
    };
    // Query i's centred row under the mean rotation, c'_i = R (x_i - mu), into `c`.
    const auto centred = [&](std::int64_t i, std::int32_t qh, float* c) {
      query(i, qh);
      for (std::int64_t el = 0; el < d; ++el) c[el] = float(double(pc.x[el]) - pc.mu[el]);
      rotate(c, m, false);
    };
    const std::int64_t chunks = lay.chunks(), d_pad = lay.d_pad();
    for (std::int64_t g = 0; g < group; ++g) {
      const auto qh = std::int32_t(h * group + g);
      std::fill(pc.mu, pc.mu + d, 0.0);
      for (std::int64_t i = 0; i < m; ++i) {
        query(i, qh);
        for (std::int64_t el = 0; el < d; ++el) pc.mu[el] += pc.x[el];
      }
      for (std::int64_t el = 0; el < d; ++el) pc.mu[el] /= double(m);
      std::copy(pc.mu, pc.mu + d, pc.mur);  // mu' = R mu, turned in double
      rotate(pc.mur, m, false);
      for (std::int64_t el = 0; el < d; ++el) pc.mup[g * d + el] = float(pc.mur[el]);
      if (!e.covariance) continue;
      if (!lay.matrix) {
        for (std::int64_t i = 0; i < m; ++i) centred(i, qh, pc.c + (g * m + i) * d);
        continue;
      }
      // Sigma' accumulated in double over blocks of up to key_tile queries, each block's
      // C' C'^T by GEMM: "rows" are the d columns of C' (ct, d_pad x B), the "key tile" C' itself.
      std::fill(pc.acc, pc.acc + d * d, 0.0);
      for (std::int64_t i0 = 0; i0 < m; i0 += key_tile) {
        const std::int64_t bn = std::min(key_tile, m - i0);
        for (std::int64_t i = 0; i < bn; ++i) {
          centred(i0 + i, qh, pc.cb + i * d);
          for (std::int64_t el = 0; el < d; ++el) pc.ct[el * bn + i] = pc.cb[i * d + el];
        }
        std::fill(pc.ct + d * bn, pc.ct + d_pad * bn, 0.f);
        for (std::int64_t cc = 0; cc < chunks; ++cc) {
          const std::int64_t c0 = cc * key_tile, cw = std::min(key_tile, d - c0);
          float* kt = pc.tout;  // C' columns [c0, c0 + cw) as a key tile
          for (std::int64_t i = 0; i < bn; ++i) std::copy_n(pc.cb + i * d + c0, cw, kt + i * key_tile);
          detail::tile_logits(pc.ct, d_pad, bn, kt, cw, 1.f, pc.sout);
          for (std::int64_t a = 0; a < d; ++a)
            for (std::int64_t b = 0; b < cw; ++b) pc.acc[a * d + c0 + b] += pc.sout[a * key_tile + b];
        }
      }
      for (std::int64_t cc = 0; cc < chunks; ++cc) {  // s^2 / (2m) Sigma' as key tiles, column chunk cc
        const std::int64_t c0 = cc * key_tile, cw = std::min(key_tile, d - c0);
        float* sk = pc.sk + (g * chunks + cc) * d * key_tile;
        for (std::int64_t a = 0; a < d; ++a) {
          for (std::int64_t b = 0; b < cw; ++b) sk[a * key_tile + b] = float(pc.acc[a * d + c0 + b] * cov_coef);
          std::fill(sk + a * key_tile + cw, sk + (a + 1) * key_tile, 0.f);
        }
      }
    }
    // The logits of every key under each query head of the group.
    float* krow = pc.x;
    const auto logit = [&](std::int64_t j, std::int64_t g, double quad) {
      const double zj = pc.z[g * n + j] = scale * double(detail::dot_of(pc.mup + g * d, krow, d)) + quad;
      if (!std::isfinite(float(zj))) [[unlikely]] {  // logits must fit f32, as on every backend
        const float* st = lay.matrix ? pc.sk + g * chunks * d * key_tile : pc.c ? pc.c + g * m * d : pc.mup + g * d;
        const std::size_t count = lay.matrix ? std::size_t(chunks * d * key_tile)
                                  : pc.c     ? std::size_t(m * d)
                                             : std::size_t(d);
        detail::on_logit_overflow(q, first_query, keys, std::int32_t(h * group + g), j, order, sinks, {st, count});
      }
    };
    if (lay.matrix) {
      for (std::int64_t j0 = 0; j0 < n; j0 += key_tile) {  // k' Sigma' k for a tile of keys: T = K Sigma' by GEMM
        const std::int64_t tn = std::min(key_tile, n - j0), rows = (tn + kernel_rows - 1) / kernel_rows * kernel_rows;
        for (std::int64_t r = 0; r < tn; ++r) {
          float* kr = pc.keys + r * d;
          to_f32(keys.type, keys.row(j0 + r, std::int32_t(h)), kr, d);
          if (!detail::all_finite(kr, d)) [[unlikely]]
            detail::fail_not_finite(keys, "keys", j0 + r, 1, std::int32_t(h));
        }
        std::fill(pc.keys + tn * d, pc.keys + rows * d, 0.f);
        for (std::int64_t g = 0; g < group; ++g) {
          double quad[key_tile] = {};
          for (std::int64_t cc = 0; cc < chunks; ++cc) {
            const std::int64_t c0 = cc * key_tile, cw = std::min(key_tile, d - c0);
            detail::tile_logits(pc.keys, rows, d, pc.sk + (g * chunks + cc) * d * key_tile, cw, 1.f, pc.tout);
            for (std::int64_t r = 0; r < tn; ++r)
              quad[r] += double(detail::dot_of(pc.tout + r * key_tile, pc.keys + r * d + c0, cw));
          }
          for (std::int64_t r = 0; r < tn; ++r) {
            std::copy_n(pc.keys + r * d, d, krow);
            logit(j0 + r, g, quad[r]);
          }
        }
      }
    } else {
      for (std::int64_t j = 0; j < n; ++j) {
        to_f32(keys.type, keys.row(j, std::int32_t(h)), krow, d);
        if (!detail::all_finite(krow, d)) [[unlikely]]
          detail::fail_not_finite(keys, "keys", j, 1, std::int32_t(h));
        for (std::int64_t g = 0; g < group; ++g) {
          double quad = 0.0;
          if (e.covariance)
            for (std::int64_t i = 0; i < m; ++i) {
              const double proj = detail::dot_of(pc.c + (g * m + i) * d, krow, d);
              quad += proj * proj;
            }
          logit(j, g, quad * cov_coef);
        }
      }
    }
    float* row = out.row(h);
    std::fill(row, row + n, 0.f);
    for (std::int64_t g = 0; g < group; ++g) {
      double* zg = pc.z + g * n;
      for (std::int64_t r = 0; r < sinks; ++r) zg[order[r]] = -std::numeric_limits<double>::infinity();
      if (sinks == n) break;
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, zg[j]);
      double sum = 0;
      for (std::int64_t j = 0; j < n; ++j) sum += std::exp(zg[j] - mx);
      const double inv = 1.0 / (sum * double(group));
      for (std::int64_t j = 0; j < n; ++j) row[j] += float(std::exp(zg[j] - mx) * inv);
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
