// infkv: element types of cached keys and values (f32, f16, bf16) and their conversion to f32.
#pragma once

#include <cstdint>
#include <cstring>

#include "config.hpp"

// x86 intrinsics only for host compilers that target F16C (never in nvcc's device pass).
#if defined(__F16C__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
#include <immintrin.h>
#define INFKV_HAVE_F16C 1
#endif

namespace infkv {

/// Element type of a cache tensor.
enum class dtype : std::uint8_t { f32, f16, bf16 };

/// Bytes per element.
INFKV_HOST_DEVICE constexpr std::size_t size_of(dtype t) { return t == dtype::f32 ? 4 : 2; }

INFKV_HOST_DEVICE constexpr const char* to_string(dtype t) {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}

/// IEEE binary16 -> binary32 (exact). No branches, so loops over it vectorise.
INFKV_HOST_DEVICE inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t o = std::uint32_t(h & 0x7fffu) << 13, e = o & 0x0f800000u;
  std::uint32_t bits = o + 0x38000000u;         // rebias the exponent: 2^(127 - 15)
  bits += e == 0x0f800000u ? 0x38000000u : 0u;  // Inf / NaN: exponent 255
  // zero or subnormal: 1.mantissa x 2^-14 minus 2^-14, exact in f32
  const std::uint32_t biased = bits + 0x00800000u, min_normal = 0x38800000u;
  float sub, b, m;
  memcpy(&b, &biased, 4);
  memcpy(&m, &min_normal, 4);
  sub = b - m;
  std::uint32_t sub_bits;
  memcpy(&sub_bits, &sub, 4);
  bits = (e == 0 ? sub_bits : bits) | sign;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/// binary32 -> binary16, round to nearest even, overflow to infinity, NaN quiet. No branches,
/// so loops over it vectorise.
INFKV_HOST_DEVICE inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t x;
  memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  // normal range: rebias, round to nearest even on the 13 dropped bits
  const std::uint32_t normal = (ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13;
  // below 2^-14: adding 0.5 makes the FPU round the value to a multiple of 2^-24 (f16's subnormal step)
  float a;
  memcpy(&a, &ax, 4);
  a += 0.5f;
  std::uint32_t sub;
  memcpy(&sub, &a, 4);
  sub -= 0x3f000000u;
  std::uint32_t r = ax < 0x38800000u ? sub : normal;
  r = ax >= 0x477ff000u ? 0x7c00u : r;  // rounds to >= 65520: infinity
  r = ax > 0x7f800000u ? 0x7e00u : r;   // NaN
  return std::uint16_t(r | sign);
}

/// bfloat16 -> binary32 (exact).
INFKV_HOST_DEVICE inline float bf16_to_f32(std::uint16_t b) {
  const std::uint32_t bits = std::uint32_t(b) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/// binary32 -> bfloat16, round to nearest even, NaN kept.
INFKV_HOST_DEVICE inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t x;
  memcpy(&x, &f, 4);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16, quiet = (x >> 16) | 0x40u;
  return std::uint16_t((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);  // NaN stays NaN
}

namespace detail {
/// The i-th 16-bit element at `p`, at any alignment (buffers read from files need not be aligned).
inline std::uint16_t load_u16(const void* p, std::int64_t i) {
  std::uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(p) + 2 * i, 2);
  return v;
}
inline void store_u16(void* p, std::int64_t i, std::uint16_t v) {
  std::memcpy(static_cast<unsigned char*>(p) + 2 * i, &v, 2);
}
}  // namespace detail

/// Converts n elements of type t at src (any alignment) to f32: F16C for f16 where the
/// compiler targets it, otherwise the branch-free conversions over whole chunks of 8 (known trip
/// counts, so GCC vectorises them at -O2 as well as -O3).
inline void to_f32(dtype t, const void* src, float* dst, std::int64_t n) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  std::int64_t i = 0;
  switch (t) {
    case dtype::f32: std::memcpy(dst, src, std::size_t(n) * 4); return;
    case dtype::f16:
#ifdef INFKV_HAVE_F16C
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 2 * i))));
#endif
      for (; i + 8 <= n; i += 8) {
        std::uint16_t h[8];
        std::memcpy(h, bytes + 2 * i, sizeof h);
        for (int l = 0; l < 8; ++l) dst[i + l] = f16_to_f32(h[l]);
      }
      for (; i < n; ++i) dst[i] = f16_to_f32(detail::load_u16(src, i));
      return;
    case dtype::bf16:
      for (; i + 8 <= n; i += 8) {
        std::uint16_t h[8];
        std::memcpy(h, bytes + 2 * i, sizeof h);
        for (int l = 0; l < 8; ++l) dst[i + l] = bf16_to_f32(h[l]);
      }
      for (; i < n; ++i) dst[i] = bf16_to_f32(detail::load_u16(src, i));
      return;
  }
}

/// Converts n f32 values to type t at dst (any alignment), rounding to nearest even (F16C, or
/// the branch-free conversions over chunks of 8, as to_f32).
inline void from_f32(dtype t, const float* src, void* dst, std::int64_t n) {
  auto* bytes = static_cast<unsigned char*>(dst);
  std::int64_t i = 0;
  switch (t) {
    case dtype::f32: std::memcpy(dst, src, std::size_t(n) * 4); return;
    case dtype::f16:
#ifdef INFKV_HAVE_F16C
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i + 8 <= n; i += 8) {
        std::uint16_t h[8];
        for (int l = 0; l < 8; ++l) h[l] = f32_to_f16(src[i + l]);
        std::memcpy(bytes + 2 * i, h, sizeof h);
      }
      for (; i < n; ++i) detail::store_u16(dst, i, f32_to_f16(src[i]));
      return;
    case dtype::bf16:
      for (; i + 8 <= n; i += 8) {
        std::uint16_t h[8];
        for (int l = 0; l < 8; ++l) h[l] = f32_to_bf16(src[i + l]);
        std::memcpy(bytes + 2 * i, h, sizeof h);
      }
      for (; i < n; ++i) detail::store_u16(dst, i, f32_to_bf16(src[i]));
      return;
  }
}

}  // namespace infkv
