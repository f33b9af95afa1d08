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

/// IEEE binary16 -> binary32 (exact).
INFKV_HOST_DEVICE inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/// binary32 -> binary16, round to nearest even, overflow to infinity, NaN kept.
INFKV_HOST_DEVICE inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t x;
  memcpy(&x, &f, 4);
  const std::uint16_t sign = std::uint16_t((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520
  if (ax < 0x38800000u) {                         // subnormal or zero in f16
    if (ax < 0x33000000u) return sign;            // < 2^-25 rounds to 0
    const std::uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;          // 14..24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | std::uint16_t(r);
  }
  std::uint32_t r = ((ax - 0x38000000u) >> 13);
  const std::uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | std::uint16_t(r);
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
  if ((x & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return std::uint16_t(x >> 16);
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

/// Converts n elements of type t at src (any alignment) to f32 (F16C path when the compiler
/// targets it).
inline void to_f32(dtype t, const void* src, float* dst, std::int64_t n) {
  switch (t) {
    case dtype::f32: std::memcpy(dst, src, std::size_t(n) * 4); return;
    case dtype::f16: {
      std::int64_t i = 0;
#ifdef INFKV_HAVE_F16C
      const auto* bytes = static_cast<const unsigned char*>(src);
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 2 * i))));
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(detail::load_u16(src, i));
      return;
    }
    case dtype::bf16: {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(detail::load_u16(src, i));
      return;
    }
  }
}

/// Converts n f32 values to type t at dst (any alignment), rounding to nearest even.
inline void from_f32(dtype t, const float* src, void* dst, std::int64_t n) {
  switch (t) {
    case dtype::f32: std::memcpy(dst, src, std::size_t(n) * 4); return;
    case dtype::f16: {
      std::int64_t i = 0;
#ifdef INFKV_HAVE_F16C
      auto* bytes = static_cast<unsigned char*>(dst);
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i < n; ++i) detail::store_u16(dst, i, f32_to_f16(src[i]));
      return;
    }
    case dtype::bf16: {
      for (std::int64_t i = 0; i < n; ++i) detail::store_u16(dst, i, f32_to_bf16(src[i]));
      return;
    }
  }
}

}  // namespace infkv
