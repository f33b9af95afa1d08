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
// blocks of queries (O(m d^2 + n d^2)), or the sum of squared projections (1/m) sum_i (c'_i . k_j)^2
// (O(n m d)), for short windows. Either way the keys are scored a transposed tile at a time by one
// GEMM per query head, whose rows are mu' and Sigma' (matrix) or mu' and the c'_i (projections).
// Sums over the queries (the mean, the matrix), over the projections' squares and k' (Sigma' k)
// accumulate in double, the logits too.
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
/// logits (double), each query head's mean and one mean after the rotation (double), a query
/// row, each query head's GEMM rows (`rows()` of d floats: mu', then the s^2 / (2m) scaled rows of
/// Sigma' or the centred queries c'_i, zero-padded), a transposed key tile (or, for the matrix, a
/// block of centred queries) with 8 rows of conversion scratch, a tile of GEMM output (d_pad rows
/// for the covariance's), and for the matrix form its double accumulator, the group's queries
/// turned back, and a block of centred queries transposed (and as rows where d exceeds a tile).
struct expected_layout {
  std::int64_t workers, group, m, d, n;
  bool covariance = true, matrix = false;  // matrix: the covariance term as a matrix
  struct worker_pieces {
    double *z, *mu, *mur, *acc;
    float *x, *a, *kt, *rows8, *tout, *xs, *ct, *cb;
  };
  std::int64_t rows() const {
    const std::int64_t r = 1 + (!covariance ? 0 : matrix ? d : m);
    return (r + kernel_rows - 1) / kernel_rows * kernel_rows;
  }
  std::int64_t d_pad() const { return (d + kernel_rows - 1) / kernel_rows * kernel_rows; }
  float* shared(infkv::detail::carver& c) const { return c.take<float>((m + 1) * d); }
  worker_pieces worker(infkv::detail::carver& c) const {
    worker_pieces w{};
    w.z = c.take<double>(group * n), w.mu = c.take<double>(group * d), w.mur = c.take<double>(d),
    w.x = c.take<float>(d);
    w.a = c.take<float>(group * rows() * d);
    w.kt = c.take<float>(std::max(d_pad(), key_tile) * key_tile), w.rows8 = c.take<float>(8 * d),
    w.tout = c.take<float>(std::max(d_pad(), key_tile) * key_tile);
    if (matrix) {
      w.acc = c.take<double>(d * d), w.xs = c.take<float>(group * m * d), w.ct = c.take<float>(d_pad() * key_tile);
      if (d > key_tile) w.cb = c.take<float>(key_tile * d);
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

/// dst[e * ldd + i] = src[i * lds + e] for i < rows, e < d (8 x 8 blocks in registers under AVX2).
inline void transpose_rows(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t d, float* dst,
                           std::int64_t ldd) {
  std::int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= rows; i += 8) {
    const float* r[8];
    for (int k = 0; k < 8; ++k) r[k] = src + (i + k) * lds;
    std::int64_t e = 0;
    for (; e + 8 <= d; e += 8) transpose8(r, e, dst + e * ldd + i, ldd);
    for (; e < d; ++e)
      for (int k = 0; k < 8; ++k) dst[e * ldd + i + k] = r[k][e];
  }
#endif
  for (; i < rows; ++i)
    for (std::int64_t e = 0; e < d; ++e) dst[e * ldd + i] = src[i * lds + e];
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
    infkv::fail("infkv: queries[slot ", qi, ", head ", qh, "] (largest |element| ", qmax,
                "): the mean and covariance of expected_attention's window overflow f32: queries must be "
                "small enough for their sums and squares");
  const std::int32_t h = std::int32_t(qh / (q.n_heads / keys.n_heads));
  const auto [kmax, kj] = largest(keys, h, keys.n_slots);
  infkv::fail("infkv: keys[slot ", j, ", head ", h, "]: expected_attention's logit under the window queries of ",
              "head ", qh, " overflows f32 (largest |element|: keys ", kmax, " at slot ", kj, ", queries ", qmax,
              " at queries[slot ", qi, ", head ", qh, "]): keys and queries must be small enough that s^2 ",
              "(q.k)^2 / 2 stays finite");
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
  using detail::kernel_rows, detail::kernel_keys, detail::key_tile;
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
    // Each position's angle from sincos, or, after the position before it, by turning the
    // previous (cos, sin) by w in double (error ~1e-16 a step), anew every 256 positions.
    const double cw = std::cos(w), sw = std::sin(w);
    double c = 0, s = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      const std::int64_t p = in.query_pos[std::size_t(i)];
      if (i % 256 != 0 && p == in.query_pos[std::size_t(i - 1)] + 1) {
        const double cn = c * cw - s * sw;
        s = s * cw + c * sw, c = cn;
      } else {
        c = std::cos(double(p) * w), s = std::sin(double(p) * w);
      }
      table[i * d + k] = float(c), table[i * d + half + k] = float(s);
    }
    double mc = 0, ms = 0;  // the mean over the future positions, turned the same way
    for (std::int64_t t = 0; t < e.future; ++t) {
      if (t % 256 != 0) {
        const double cn = c * cw - s * sw;
        s = s * cw + c * sw, c = cn;
      } else {
        c = std::cos(double(t0 + t) * w), s = std::sin(double(t0 + t) * w);
      }
      mc += c, ms += s;
    }
    table[m * d + k] = float(mc / double(e.future)), table[m * d + half + k] = float(ms / double(e.future));
  }
  // Turns x (a query turned back, or the mean) by the table's row `row` (the mean rotation: m).
  const auto rotate = [&](auto* x, std::int64_t row, bool back) {
    using T = std::remove_reference_t<decltype(*x)>;
    const float *cs = table + row * d, *sn = cs + half;
    const T sign = back ? T(-1) : T(1);
    const auto turn = [&](T* xa, T* xb, std::int32_t p) {  // (a, b) -> (a c - b s, a s + b c)
      const T c = cs[p], s = sign * T(sn[p]), u = *xa, v = *xb;
      *xa = u * c - v * s, *xb = u * s + v * c;
    };
    if (rot.style == rope_style::neox)  // pairs (p, p + half): two contiguous halves
      for (std::int32_t p = 0; p < half; ++p) turn(x + p, x + half + p, p);
    else
      for (std::int32_t p = 0; p < half; ++p) turn(x + 2 * p, x + 2 * p + 1, p);
  };
  std::byte* workers_base = scratch + shared.size();
  const std::size_t per_worker = lay.worker_bytes();
  parallel_for_workers(ex, keys.n_heads, [&](std::int64_t w, std::int64_t h) {
    infkv::detail::carver mine{workers_base + std::size_t(w) * per_worker};
    const auto pc = lay.worker(mine);
    const std::int64_t rows = lay.rows(), d_pad = lay.d_pad();
    // The group's window queries turned back to before RoPE, a row of the group at a time (its
    // heads are adjacent in nhd), kept for the covariance (as the projections' rows 1 .. m, or in
    // xs), and each query head's mean.
    const auto turned = [&](std::int64_t g, std::int64_t i) {
      return !e.covariance ? pc.x : lay.matrix ? pc.xs + (g * m + i) * d : pc.a + (g * rows + 1 + i) * d;
    };
    std::fill(pc.a, pc.a + group * rows * d, 0.f);
    std::fill(pc.mu, pc.mu + group * d, 0.0);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t g = 0; g < group; ++g) {
        const auto qh = std::int32_t(h * group + g);
        float* x = turned(g, i);
        to_f32(q.type, q.row(i, qh), x, d);
        if (!detail::all_finite(x, d)) [[unlikely]]
          detail::fail_query_not_finite(q, first_query, i, qh);
        rotate(x, i, true);
        for (std::int64_t el = 0; el < d; ++el) pc.mu[g * d + el] += x[el];
      }
    for (std::int64_t g = 0; g < group; ++g) {
      float* a = pc.a + g * rows * d;  // this query head's GEMM rows
      double* mu = pc.mu + g * d;
      for (std::int64_t el = 0; el < d; ++el) mu[el] /= double(m);
      std::copy(mu, mu + d, pc.mur);  // mu' = R mu, turned in double
      rotate(pc.mur, m, false);
      for (std::int64_t el = 0; el < d; ++el) a[el] = float(pc.mur[el]);
      if (!e.covariance) continue;
      if (!lay.matrix) {  // rows 1 .. m: c'_i = R (x_i - mu)
        for (std::int64_t i = 0; i < m; ++i) {
          float* c = turned(g, i);
          for (std::int64_t el = 0; el < d; ++el) c[el] = float(double(c[el]) - mu[el]);
          rotate(c, m, false);
        }
        continue;
      }
      // Sigma = (1/m) sum_i c_i c_i', c_i = x_i - mu, accumulated in double over blocks of up to
      // key_tile queries, each block's C' C by GEMM (its upper triangle): the rows are the d
      // columns of C (ct, d_pad x B), the transposed "key tile" C itself (in kt when d fits one
      // tile, else a chunk of key_tile columns at a time through cb). Then Sigma' = R Sigma R'.
      const bool one_chunk = d <= key_tile;
      std::fill(pc.acc, pc.acc + d * d, 0.0);
      for (std::int64_t i0 = 0; i0 < m; i0 += key_tile) {
        const std::int64_t bn = std::min(key_tile, m - i0);
        float* const cr = one_chunk ? pc.kt : pc.cb;
        const std::int64_t ldc = one_chunk ? key_tile : d;
        for (std::int64_t i = 0; i < bn; ++i) {
          const float* x = turned(g, i0 + i);
          for (std::int64_t el = 0; el < d; ++el) cr[i * ldc + el] = float(double(x[el]) - mu[el]);
        }
        detail::transpose_rows(cr, ldc, bn, d, pc.ct, bn);
        std::fill(pc.ct + d * bn, pc.ct + d_pad * bn, 0.f);
        for (std::int64_t c0 = 0; c0 < d; c0 += key_tile) {
          const std::int64_t cw = std::min(key_tile, d - c0);
          if (!one_chunk)
            for (std::int64_t i = 0; i < bn; ++i) std::copy_n(pc.cb + i * d + c0, cw, pc.kt + i * key_tile);
          for (std::int64_t s0 = 0; s0 < cw; s0 += kernel_keys)  // register blocks that reach column >= row
            for (std::int64_t r0 = 0; r0 < d_pad && r0 < c0 + s0 + kernel_keys; r0 += kernel_rows)
              detail::dot_block(pc.ct + r0 * bn, bn, pc.kt + s0, 1.f, pc.tout + r0 * key_tile + s0, key_tile);
          for (std::int64_t r = 0; r < d; ++r)
            for (std::int64_t b = std::max<std::int64_t>(0, r - c0); b < cw; ++b)
              pc.acc[r * d + c0 + b] += pc.tout[r * key_tile + b];
        }
      }
      for (std::int64_t r = 0; r < d; ++r)  // the lower triangle mirrors the upper
        for (std::int64_t b = 0; b < r; ++b) pc.acc[r * d + b] = pc.acc[b * d + r];
      // R Sigma R': every row turned (Sigma R'), transposed (R Sigma), every row turned again.
      for (std::int64_t r = 0; r < d; ++r) rotate(pc.acc + r * d, m, false);
      for (std::int64_t r = 0; r < d; ++r)
        for (std::int64_t b = r + 1; b < d; ++b) std::swap(pc.acc[r * d + b], pc.acc[b * d + r]);
      for (std::int64_t r = 0; r < d; ++r) rotate(pc.acc + r * d, m, false);
      for (std::int64_t r = 0; r < d; ++r)  // rows 1 .. d: s^2 / (2m) Sigma'
        for (std::int64_t b = 0; b < d; ++b) a[(1 + r) * d + b] = float(pc.acc[r * d + b] * cov_coef);
    }
    // A transposed tile of keys against each query head's rows, by GEMM in blocks of key_tile
    // rows: row 0 gives mu'.k_j; the matrix form's rows 1 .. d give Sigma' k_j (then k_j' Sigma'
    // k_j), the projections' rows c'_i . k_j (then their squares).
    for (std::int64_t j0 = 0; j0 < n; j0 += key_tile) {
      const std::int64_t tn = std::min(key_tile, n - j0);
      detail::load_key_tile(keys, std::int32_t(h), j0, tn, pc.kt, pc.rows8);
      for (std::int64_t g = 0; g < group; ++g) {
        const float* a = pc.a + g * rows * d;
        double mean[key_tile], quad[key_tile] = {};
        for (std::int64_t r0 = 0; r0 < rows; r0 += key_tile) {
          const std::int64_t br = std::min(key_tile, rows - r0);
          detail::tile_logits(a + r0 * d, br, d, pc.kt, tn, 1.f, pc.tout);
          if (r0 == 0)
            for (std::int64_t j = 0; j < tn; ++j) mean[j] = pc.tout[j];
          for (std::int64_t r = r0 == 0 ? 1 : 0; r < br; ++r) {  // zero-padded rows add nothing
            const float* o = pc.tout + r * key_tile;
            if (lay.matrix) {
              const std::int64_t el = r0 + r - 1;  // k_j[el] (Sigma' k_j)[el]
              if (el >= d) break;
              const float* k = pc.kt + el * key_tile;
              for (std::int64_t j = 0; j < tn; ++j) quad[j] += double(k[j]) * double(o[j]);
            } else {
              for (std::int64_t j = 0; j < tn; ++j) quad[j] += double(o[j]) * double(o[j]);
            }
          }
        }
        const double qc = lay.matrix ? 1.0 : cov_coef;
        for (std::int64_t j = 0; j < tn; ++j) {
          const double zj = pc.z[g * n + j0 + j] = scale * mean[j] + qc * quad[j];
          if (!std::isfinite(float(zj))) [[unlikely]]  // logits must fit f32, as on every backend
            detail::on_logit_overflow(q, first_query, keys, std::int32_t(h * group + g), j0 + j, order, sinks,
                                      {a, std::size_t(rows * d)});
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
