// infkv fuzz targets: reads the fuzzer's bytes as a stream of choices. Integers come in ranges
// (a byte or eight at a time), floats from a hostile mix (NaN, +-Inf, denormals, +-0, huge and
// tiny scales, plain values); an exhausted input reads as zeros, so every input is valid.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace infkv_fuzz {

class input {
 public:
  input(const std::uint8_t* data, std::size_t size) : p_(data), end_(data + size) {}

  std::uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  std::uint64_t u64() {
    std::uint64_t x = 0;
    for (int i = 0; i < 8; ++i) x = (x << 8) | byte();
    return x;
  }
  /// An integer in [lo, hi] (one byte for small ranges).
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    const auto span = std::uint64_t(hi - lo) + 1;
    const std::uint64_t x = span <= 256 ? byte() : u64();
    return lo + std::int64_t(x % span);
  }
  bool flag() { return byte() & 1; }
  /// Any 64-bit integer, biased toward the edges (0, -1, limits, small values).
  std::int64_t hostile_int() {
    switch (byte() % 8) {
      case 0: return 0;
      case 1: return -1;
      case 2: return std::numeric_limits<std::int64_t>::max();
      case 3: return std::numeric_limits<std::int64_t>::min();
      case 4: return std::int64_t(std::numeric_limits<std::int32_t>::max()) + range(-2, 2);
      case 5: return std::int64_t(u64());
      default: return range(-8, 300);
    }
  }
  /// A float from the hostile mix.
  float hostile_float() {
    switch (byte() % 12) {
      case 0: return std::numeric_limits<float>::quiet_NaN();
      case 1: return std::numeric_limits<float>::infinity();
      case 2: return -std::numeric_limits<float>::infinity();
      case 3: return std::numeric_limits<float>::denorm_min() * float(range(1, 1000));
      case 4: return -0.f;
      case 5: return 0.f;
      case 6: return std::ldexp(float(range(-100, 100)), int(range(60, 127)));    // huge
      case 7: return std::ldexp(float(range(-100, 100)), int(range(-149, -60)));  // tiny
      default: return float(range(-1000, 1000)) / 97.f;
    }
  }
  /// A finite float (plain values, zeros, denormals, large and small scales).
  float finite_float() {
    const float x = hostile_float();
    return std::isfinite(x) ? x : float(range(-50, 50)) / 7.f;
  }
  bool empty() const { return p_ >= end_; }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
};

/// Aborts with a message: a property the library promises does not hold (libFuzzer keeps the input).
[[noreturn]] inline void violated(const char* what) {
  std::fputs("infkv fuzz: property violated: ", stderr);
  std::fputs(what, stderr);
  std::fputs("\n", stderr);
  std::abort();
}
#define INFKV_FUZZ_ASSERT(cond) ((cond) ? void(0) : ::infkv_fuzz::violated(#cond))

}  // namespace infkv_fuzz
