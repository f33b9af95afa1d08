// infkv CPU backend: the arithmetic kernels under recomputed attention: fused multiply-add,
// a branch-free exp for non-positive arguments, vectorisable max / sum / dot reductions, the
// register-blocked GEMM block of the logits and an 8 x 8 transpose. AVX2/FMA intrinsics where the
// compiler targets them, portable loops with the same arithmetic otherwise.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace infkv::cpu::detail {

/// Asks for the cache lines of [p, p + bytes) ahead of their use (no-op without GCC builtins).
inline void prefetch(const void* p, std::int64_t bytes) {
#if defined(__GNUC__)
  for (std::int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
#else
  (void)p, (void)bytes;
#endif
}

/// Register block of the GEMM micro-kernel: query rows x keys.
inline constexpr std::int64_t kernel_rows = 4, kernel_keys = 24;
/// Keys per tile of the logits GEMM: a multiple of `kernel_keys`.
inline constexpr std::int64_t key_tile = 192;

/// a * b + c, fused when the target has FMA.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// e^x for x <= 0 (including -inf): Cody-Waite reduction by ln 2 and a degree-7 Taylor
/// polynomial on |r| <= ln(2)/2. Relative error below 2e-7 for x in [-87.33, 0] (exactly 1 at
/// 0); 0 below, where e^x would be subnormal. The clamp and the flush work on the bit patterns
/// (for x <= 0 a larger pattern is a smaller number), so loops over it stay branch-free and
/// vectorise even under -ftrapping-math.
inline float exp_nonpos(float x) {
  constexpr float lo = -87.33654f, log2e = 1.44269504f, shifter = 12582912.f;  // 1.5 * 2^23
  constexpr float ln2_hi = 0.693145751953125f, ln2_lo = 1.42860682e-6f;        // ln2_hi * n is exact
  constexpr std::uint32_t lo_bits = std::bit_cast<std::uint32_t>(lo);
  const std::uint32_t xb = std::bit_cast<std::uint32_t>(x);
  const float xc = std::bit_cast<float>(std::min(xb, lo_bits));  // max(x, lo)
  const float n = (xc * log2e + shifter) - shifter;              // round to nearest integer, in [-126, 0]
  const float r = fmadd(-n, ln2_lo, fmadd(-n, ln2_hi, xc));
  float p = fmadd(fmadd(fmadd(1.f / 5040.f, r, 1.f / 720.f), r, 1.f / 120.f), r, 1.f / 24.f);  // Horner
  p = fmadd(fmadd(fmadd(fmadd(p, r, 1.f / 6.f), r, 0.5f), r, 1.f), r, 1.f);
  const float y = p * std::bit_cast<float>(std::uint32_t(std::int32_t(n) + 127) << 23);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(y) & (xb <= lo_bits ? ~0u : 0u));
}

/// Largest of x[0, n) (-inf when n = 0). Vector maxima under AVX2 (any optimisation level);
/// otherwise eight partial maxima over whole chunks, so the loop vectorises.
inline float max_of(const float* x, std::int64_t n) {
  float m[8];
  std::fill(m, m + 8, -std::numeric_limits<float>::infinity());
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), v1 = v0, v2 = v0, v3 = v0;
  for (; j + 32 <= n; j += 32) {
    v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j)), v1 = _mm256_max_ps(v1, _mm256_loadu_ps(x + j + 8));
    v2 = _mm256_max_ps(v2, _mm256_loadu_ps(x + j + 16)), v3 = _mm256_max_ps(v3, _mm256_loadu_ps(x + j + 24));
  }
  for (; j + 8 <= n; j += 8) v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + j));
  _mm256_storeu_ps(m, _mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3)));
#endif
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
  for (; j < n; ++j) m[0] = x[j] > m[0] ? x[j] : m[0];
  for (int l = 1; l < 8; ++l) m[0] = m[l] > m[0] ? m[l] : m[0];
  return m[0];
}

#if defined(__AVX2__) && defined(__FMA__)
/// exp_nonpos of eight lanes (same arithmetic as the scalar version).
inline __m256 exp_nonpos8(__m256 x) {
  const __m256i lo_bits = _mm256_set1_epi32(std::int32_t(std::bit_cast<std::uint32_t>(-87.33654f)));
  const __m256i xb = _mm256_castps_si256(x);
  const __m256i xcb = _mm256_min_epu32(xb, lo_bits);
  const __m256 xc = _mm256_castsi256_ps(xcb);
  const __m256 shifter = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504f), shifter), shifter);
  const __m256 r =
      _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.f / 5040.f), r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  const __m256i keep = _mm256_cmpeq_epi32(xcb, xb);  // x >= lo (as bit patterns: xb <= lo_bits)
  return _mm256_and_ps(y, _mm256_castsi256_ps(keep));
}
#endif

/// x[j] = exp_nonpos(x[j] - m) for j in [0, n) (m >= every x[j]).
inline void exp_shifted(float* x, std::int64_t n, float m) {
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_ps(x + j, exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
    _mm256_storeu_ps(x + j + 8, exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), mv)));
  }
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
#else
  for (; j + 8 <= n; j += 8)  // whole chunks: a known trip count for the vectoriser
    for (int l = 0; l < 8; ++l) x[j + l] = exp_nonpos(x[j + l] - m);
#endif
  for (; j < n; ++j) x[j] = exp_nonpos(x[j] - m);
}

/// y[j] = a * x[j] + y[j] (fused when the target has FMA) for j in [0, n).
inline void axpy(float a, const float* __restrict x, float* __restrict y, std::int64_t n) {
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 av = _mm256_set1_ps(a);
  for (; j + 16 <= n; j += 16) {
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
    _mm256_storeu_ps(y + j + 8, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + j + 8), _mm256_loadu_ps(y + j + 8)));
  }
#endif
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) y[j + l] = fmadd(a, x[j + l], y[j + l]);
  for (; j < n; ++j) y[j] = fmadd(a, x[j], y[j]);
}

/// x[j] /= q for j in [0, n).
inline void divide(float* x, std::int64_t n, float q) {
  std::int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) x[j + l] /= q;
  for (; j < n; ++j) x[j] /= q;
}

/// Sum of a[j] * b[j] over [0, n), or of a[j] when b is null: 32 interleaved partial sums (four
/// 8-wide accumulators, so the loop runs at FMA throughput rather than latency).
inline float sum_of(const float* a, const float* b, std::int64_t n) {
  float s[32] = {};
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // four named accumulators (an array would live on the stack at -O2), one loop per case
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  if (b != nullptr)
    for (; j + 32 <= n; j += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24), a3);
    }
  else
    for (; j + 32 <= n; j += 32) {  // fma(x, 1, acc) == x + acc
      a0 = _mm256_add_ps(_mm256_loadu_ps(a + j), a0), a1 = _mm256_add_ps(_mm256_loadu_ps(a + j + 8), a1);
      a2 = _mm256_add_ps(_mm256_loadu_ps(a + j + 16), a2), a3 = _mm256_add_ps(_mm256_loadu_ps(a + j + 24), a3);
    }
  if (j == n) {  // no tail: the pairwise total below, in registers
    const __m256 h8 = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
  }
  _mm256_storeu_ps(s, a0), _mm256_storeu_ps(s + 8, a1), _mm256_storeu_ps(s + 16, a2), _mm256_storeu_ps(s + 24, a3);
#endif
  if (b != nullptr)  // whole chunks of 32: known trip counts, so the loops vectorise at -O2 too
    for (; j + 32 <= n; j += 32)
      for (int l = 0; l < 32; ++l) s[l] = fmadd(a[j + l], b[j + l], s[l]);
  else
    for (; j + 32 <= n; j += 32)
      for (int l = 0; l < 32; ++l) s[l] += a[j + l];
  for (; j < n; ++j) s[j % 32] = fmadd(a[j], b ? b[j] : 1.f, s[j % 32]);
  // pairwise total: s[l] += s[l + w] for w = 16, 8, 4, 2, 1 (fixed trip counts, so it vectorises)
  for (int l = 0; l < 16; ++l) s[l] += s[l + 16];
  for (int l = 0; l < 8; ++l) s[l] += s[l + 8];
  for (int l = 0; l < 4; ++l) s[l] += s[l + 4];
  for (int l = 0; l < 2; ++l) s[l] += s[l + 2];
  return s[0] + s[1];
}

/// True when every x[0, n) is finite: x * 0 is 0 for finite x and NaN for inf or NaN (eight
/// partial sums, so the loop vectorises).
inline bool all_finite(const float* x, std::int64_t n) {
  float z[8] = {};
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero;
  for (; j + 16 <= n; j += 16) {
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(x + j), zero));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(x + j + 8), zero));
  }
  _mm256_storeu_ps(z, _mm256_add_ps(a0, a1));
#endif
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) z[l] += x[j + l] * 0.f;
  for (; j < n; ++j) z[0] += x[j] * 0.f;
  float t = 0.f;
  for (int l = 0; l < 8; ++l) t += z[l];
  return t == 0.f;
}

/// Dot product of a[0, n) and b[0, n).
inline float dot_of(const float* a, const float* b, std::int64_t n) { return sum_of(a, b, n); }

/// out[r * ldo + c] = scale * sum_e q[r * d + e] * kt[e * key_tile + c] for one register block
/// of kernel_rows query rows and kernel_keys keys (12 accumulators of 8 lanes). Written out with
/// intrinsics under AVX2/FMA so the blocking survives any optimisation level; same arithmetic as
/// the portable loop.
inline void dot_block(const float* q, std::int64_t d, const float* kt, float scale, float* out, std::int64_t ldo) {
#if defined(__AVX2__) && defined(__FMA__)
  static_assert(kernel_rows == 4 && kernel_keys == 24);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
  __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
  for (std::int64_t e = 0; e < d; ++e) {
    const float* k = kt + e * key_tile;
    const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8), k2 = _mm256_loadu_ps(k + 16);
    __m256 a = _mm256_broadcast_ss(q + e);
    c00 = _mm256_fmadd_ps(a, k0, c00), c01 = _mm256_fmadd_ps(a, k1, c01), c02 = _mm256_fmadd_ps(a, k2, c02);
    a = _mm256_broadcast_ss(q + d + e);
    c10 = _mm256_fmadd_ps(a, k0, c10), c11 = _mm256_fmadd_ps(a, k1, c11), c12 = _mm256_fmadd_ps(a, k2, c12);
    a = _mm256_broadcast_ss(q + 2 * d + e);
    c20 = _mm256_fmadd_ps(a, k0, c20), c21 = _mm256_fmadd_ps(a, k1, c21), c22 = _mm256_fmadd_ps(a, k2, c22);
    a = _mm256_broadcast_ss(q + 3 * d + e);
    c30 = _mm256_fmadd_ps(a, k0, c30), c31 = _mm256_fmadd_ps(a, k1, c31), c32 = _mm256_fmadd_ps(a, k2, c32);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256 acc[4][3] = {{c00, c01, c02}, {c10, c11, c12}, {c20, c21, c22}, {c30, c31, c32}};
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < 3; ++v) _mm256_storeu_ps(out + r * ldo + 8 * v, _mm256_mul_ps(acc[r][v], sc));
#else
  float acc[kernel_rows][kernel_keys] = {};
  for (std::int64_t e = 0; e < d; ++e) {
    const float* k = kt + e * key_tile;
    for (std::int64_t r = 0; r < kernel_rows; ++r) {
      const float qe = q[r * d + e];
      for (std::int64_t c = 0; c < kernel_keys; ++c) acc[r][c] = fmadd(qe, k[c], acc[r][c]);
    }
  }
  for (std::int64_t r = 0; r < kernel_rows; ++r)
    for (std::int64_t c = 0; c < kernel_keys; ++c) out[r * ldo + c] = acc[r][c] * scale;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/// Transposes the 8 x 8 block src[i][e0 + c] (i, c < 8) into dst[c * ldd + i].
inline void transpose8(const float* const* src, std::int64_t e0, float* dst, std::int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i] + e0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // per lane: a_i0 a_(i+1)0 a_i1 a_(i+1)1
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // per lane: a_i2 a_(i+1)2 a_i3 a_(i+1)3
  }
  for (int i = 0; i < 8; i += 4) {  // columns c | c + 4 of rows i .. i + 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#endif

}  // namespace infkv::cpu::detail
