// infkv CPU backend: RoPE re-rotation of cached (post-RoPE) keys by a position delta, for the
// compact position mode: rotating by delta moves a key from position p to p + delta. The RoPE
// parameters and the position compaction are the core's (infkv/rope.hpp).
// Cost: O(n * heads * d) plus one sin/cos pair per distinct delta and frequency.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <infkv/kv_view.hpp>
#include <infkv/rope.hpp>
#include <infkv/tokens.hpp>

#include "detail/kernels.hpp"
#include "executor.hpp"

namespace infkv::cpu {

// The core's RoPE parameters and position compaction, also reachable as cpu::rope etc.
using infkv::compact_positions;
using infkv::rope;
using infkv::rope_style;

namespace detail {

/// cos and sin of dp * freq[i] for i in [0, count), rounded to f32, where every |dp * freq[i]|
/// is below `rope_fast_angle`: Cody-Waite reduction by pi/2 in double (a 33-bit first part,
/// so k * part is exact for k < 2^20) and Taylor polynomials to degree 12 / 13 on
/// |r| <= pi/4 (error below 1e-11 before the rounding to f32). Branch-free over chunks of 4
/// frequencies, so it vectorises. The last chunk reads up to 3 entries of `freq` past count
/// (the caller pads it).
inline constexpr double rope_fast_angle = 1.5e6;
inline void rope_sincos(const double* freq, std::int32_t count, std::int64_t dp, float* c, float* s) {
  constexpr double two_over_pi = 0.63661977236758134308, shifter = 6755399441055744.0;  // 1.5 * 2^52
  constexpr double p1 = 1.57079632673412561417e+00, p2 = 6.07710050630396597660e-11,
                   p3 = 2.02226624871116645580e-21;  // pi/2 = p1 + p2 + p3 (33 + 33 + 53 bits)
  const double x = double(dp);
  for (std::int32_t i0 = 0; i0 < count; i0 += 4) {
    double cv[4], sv[4];
    for (int l = 0; l < 4; ++l) {
      const double a = x * freq[i0 + l];
#ifdef __FAST_MATH__  // (x + shifter) - shifter would fold to x
      const double k = std::nearbyint(a * two_over_pi), kb = k + shifter;
#else
      const double kb = a * two_over_pi + shifter;  // k + 1.5 * 2^52: k = round(a * 2 / pi)
      const double k = kb - shifter;
#endif
      const double r = ((a - k * p1) - k * p2) - k * p3;
      const double r2 = r * r;
      const double sp =
          r + r * r2 *
                  (-1.0 / 6 +
                   r2 * (1.0 / 120 +
                         r2 * (-1.0 / 5040 + r2 * (1.0 / 362880 + r2 * (-1.0 / 39916800 + r2 * (1.0 / 6227020800))))));
      const double cp =
          1.0 +
          r2 * (-0.5 + r2 * (1.0 / 24 +
                             r2 * (-1.0 / 720 + r2 * (1.0 / 40320 + r2 * (-1.0 / 3628800 + r2 * (1.0 / 479001600))))));
      const std::uint64_t q = std::bit_cast<std::uint64_t>(kb);  // low bits: k mod 4
      const double sw = (q & 1u) ? cp : sp, cw = (q & 1u) ? sp : cp;
      sv[l] = std::bit_cast<double>(std::bit_cast<std::uint64_t>(sw) ^ ((q & 2u) << 62));
      cv[l] = std::bit_cast<double>(std::bit_cast<std::uint64_t>(cw) ^ (((q + 1u) & 2u) << 62));
    }
    for (int l = 0; l < 4; ++l) c[i0 + l] = float(cv[l]), s[i0 + l] = float(sv[l]);
  }
}

/// Rotates the first `dims` of x into y with per-pair cos / sin: pairs (2i, 2i + 1) (normal) or
/// (i, i + dims / 2) (NeoX). For normal, c and s are interleaved: c[2i] = c[2i + 1] = cos,
/// s[2i] = -sin, s[2i + 1] = sin.
inline void rope_rotate(rope_style style, std::int32_t dims, const float* __restrict x, const float* __restrict c,
                        const float* __restrict s, float* __restrict y) {
  const std::int32_t half = dims / 2;
  std::int32_t i = 0;
  if (style == rope_style::normal) {
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= dims; i += 8) {  // the pair swap is one in-lane permute
      const __m256 v = _mm256_loadu_ps(x + i), swapped = _mm256_permute_ps(v, 0xb1);
      _mm256_storeu_ps(y + i,
                       _mm256_fmadd_ps(swapped, _mm256_loadu_ps(s + i), _mm256_mul_ps(v, _mm256_loadu_ps(c + i))));
    }
#endif
    for (; i + 8 <= dims; i += 8)
      for (int l = 0; l < 8; ++l) y[i + l] = x[i + l] * c[i + l] + x[i + (l ^ 1)] * s[i + l];
    for (; i < dims; ++i) y[i] = x[i] * c[i] + x[i ^ 1] * s[i];
  } else {
    const float *x0 = x, *x1 = x + half;
    float *y0 = y, *y1 = y + half;
    for (; i + 8 <= half; i += 8)
      for (int l = 0; l < 8; ++l) {
        y0[i + l] = x0[i + l] * c[i + l] - x1[i + l] * s[i + l];
        y1[i + l] = x0[i + l] * s[i + l] + x1[i + l] * c[i + l];
      }
    for (; i < half; ++i) {
      y0[i] = x0[i] * c[i] - x1[i] * s[i];
      y1[i] = x0[i] * s[i] + x1[i] * c[i];
    }
  }
}

}  // namespace detail

/// Rotates every head of slot j by delta[j] positions (keys only), in place. Only the first
/// rope.dims dimensions of each row are read and written. Per slot one cos / sin table (reused
/// while consecutive slots share a delta; vectorised polynomials for angles below 1.5e6 rad,
/// the C library beyond), then each head's row is rotated in f32.
template <row_source R>
void rerotate(const R& keys, std::span<const std::int64_t> delta, const rope& r, const executor& ex = {}) {
  validate(keys, "keys");
  INFKV_REQUIRE(std::int64_t(delta.size()) == keys.n_slots, "delta.size()", delta.size(), "must equal keys.n_slots (",
                keys.n_slots, ")");
  const std::int32_t dims = r.checked_dims(keys.head_dim);
  const std::int32_t half = dims / 2, padded = (half + 3) / 4 * 4;
  std::vector<double> freq(static_cast<std::size_t>(padded), 0.0);
  double fmax = 0.0;
  for (std::int32_t i = 0; i < half; ++i) {
    freq[std::size_t(i)] = rope_frequency(r, i, dims);
    fmax = std::max(fmax, std::abs(freq[std::size_t(i)]));
  }
  const std::int64_t n = keys.n_slots, nw = workers(ex, std::max<std::int64_t>(n, 1));
  // per worker: cos, sin (padded), interleaved cos, sin (normal style), row in, row out
  const std::int64_t per_worker = 2 * padded + 2 * dims + 2 * std::int64_t(dims);
  std::vector<float> scratch(static_cast<std::size_t>(nw * per_worker));
  parallel_for_workers(ex, nw, [&](std::int64_t w, std::int64_t) {
    float* c = scratch.data() + w * per_worker;
    float *s = c + padded, *ci = s + padded, *si = ci + dims, *x = si + dims, *y = x + dims;
    const bool normal = r.style == rope_style::normal;
    std::int64_t last = 0;  // delta of the tables (0: none yet)
    for (std::int64_t j = n * w / nw; j < n * (w + 1) / nw; ++j) {
      const std::int64_t dp = delta[std::size_t(j)];
      if (dp == 0) continue;
      if (dp != last) {
        if (std::abs(double(dp)) * fmax < detail::rope_fast_angle) {
          detail::rope_sincos(freq.data(), half, dp, c, s);
        } else {
          for (std::int32_t i = 0; i < half; ++i) {
            const double a = double(dp) * freq[std::size_t(i)];
            c[i] = float(std::cos(a)), s[i] = float(std::sin(a));
          }
        }
        if (normal)
          for (std::int32_t i = 0; i < half; ++i)
            ci[2 * i] = ci[2 * i + 1] = c[i], si[2 * i] = -s[i], si[2 * i + 1] = s[i];
        last = dp;
      }
      for (std::int32_t h = 0; h < keys.n_heads; ++h) {
        void* row = keys.row(j, h);
        to_f32(keys.type, row, x, dims);
        detail::rope_rotate(r.style, dims, x, normal ? ci : c, normal ? si : s, y);
        from_f32(keys.type, y, row, dims);
      }
    }
  });
}

}  // namespace infkv::cpu
