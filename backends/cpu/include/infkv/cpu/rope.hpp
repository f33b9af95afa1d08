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

/// Turns rows of one RoPE by a position delta: the frequencies once, then per delta one cos /
/// sin table (vectorised polynomials while every angle is below rope_fast_angle, the C library
/// beyond; interleaved for the normal style, as rope_rotate takes them), kept while the delta
/// does not change.
class rope_turner {
 public:
  rope_turner(const rope& r, std::int32_t head_dim)
      : style_(r.style), dims_(r.checked_dims(head_dim)), half_(dims_ / 2), padded_((half_ + 3) / 4 * 4) {
    freq_.assign(std::size_t(padded_), 0.0);
    for (std::int32_t i = 0; i < half_; ++i) {
      freq_[std::size_t(i)] = rope_frequency(r, i, dims_);
      fmax_ = std::max(fmax_, std::abs(freq_[std::size_t(i)]));
    }
    c_.resize(std::size_t(padded_)), s_.resize(std::size_t(padded_));
    if (style_ == rope_style::normal) ci_.resize(std::size_t(dims_)), si_.resize(std::size_t(dims_));
  }
  /// The tables for a turn by `dp` positions (nothing to do when they hold it already).
  void set(std::int64_t dp) {
    if (ready_ && dp == last_) return;
    float *c = c_.data(), *s = s_.data();
    if (std::abs(double(dp)) * fmax_ < rope_fast_angle) {
      rope_sincos(freq_.data(), half_, dp, c, s);
    } else {
      for (std::int32_t i = 0; i < half_; ++i) {
        const double a = double(dp) * freq_[std::size_t(i)];
        c[i] = float(std::cos(a)), s[i] = float(std::sin(a));
      }
    }
    if (style_ == rope_style::normal)
      for (std::int32_t i = 0; i < half_; ++i)
        ci_[std::size_t(2 * i)] = ci_[std::size_t(2 * i + 1)] = c[i], si_[std::size_t(2 * i)] = -s[i],
                            si_[std::size_t(2 * i + 1)] = s[i];
    last_ = dp, ready_ = true;
  }
  /// y = x's first dims() turned by the delta of the last set() (x and y distinct).
  void turn(const float* x, float* y) const {
    const bool normal = style_ == rope_style::normal;
    rope_rotate(style_, dims_, x, normal ? ci_.data() : c_.data(), normal ? si_.data() : s_.data(), y);
  }

 private:
  rope_style style_;
  std::int32_t dims_, half_, padded_;
  double fmax_ = 0.0;
  std::int64_t last_ = 0;  // the tables' delta
  bool ready_ = false;
  std::vector<double> freq_;
  std::vector<float> c_, s_, ci_, si_;
};

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
  const std::int64_t n = keys.n_slots, nw = workers(ex, std::max<std::int64_t>(n, 1));
  parallel_for_workers(ex, nw, [&](std::int64_t w, std::int64_t) {
    detail::rope_turner turner(r, keys.head_dim);
    std::vector<float> x(static_cast<std::size_t>(dims)), y(x.size());
    for (std::int64_t j = n * w / nw; j < n * (w + 1) / nw; ++j) {
      const std::int64_t dp = delta[std::size_t(j)];
      if (dp == 0) continue;
      turner.set(dp);
      for (std::int32_t h = 0; h < keys.n_heads; ++h) {
        void* row = keys.row(j, h);
        to_f32(keys.type, row, x.data(), dims);
        turner.turn(x.data(), y.data());
        from_f32(keys.type, y.data(), row, dims);
      }
    }
  });
}

}  // namespace infkv::cpu
