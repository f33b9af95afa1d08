#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/dtype.hpp>

using namespace infkv;

TEST_CASE("f16 round trip is exact for every half value") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = f16_to_f32(std::uint16_t(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    REQUIRE(f32_to_f16(f) == std::uint16_t(h));
  }
}

TEST_CASE("f16 conversion rounds to nearest even and saturates to infinity") {
  CHECK(f16_to_f32(f32_to_f16(1.0f + 1.0f / 2048)) == 1.0f);               // halfway: down to even
  CHECK(f16_to_f32(f32_to_f16(1.0f + 3.0f / 2048)) == 1.0f + 1.0f / 512);  // halfway: up to even
  CHECK(std::isinf(f16_to_f32(f32_to_f16(70000.f))));
  CHECK(f16_to_f32(f32_to_f16(5.9604645e-8f)) == 5.9604645e-8f);  // smallest subnormal
  CHECK(f16_to_f32(f32_to_f16(2.0e-8f)) == 0.0f);
}

TEST_CASE("bf16 conversion rounds to nearest even") {
  CHECK(bf16_to_f32(f32_to_bf16(1.0f)) == 1.0f);
  CHECK(bf16_to_f32(f32_to_bf16(1.00390625f)) == 1.0f);       // 1 + 2^-8: halfway, even
  CHECK(bf16_to_f32(f32_to_bf16(1.01171875f)) == 1.015625f);  // 1 + 3*2^-8: halfway, up to even
  CHECK(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("row conversion agrees with the scalar conversion for every type and length") {
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (int n : {1, 7, 8, 9, 31}) {
      std::vector<float> src(static_cast<std::size_t>(n)), back(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) src[std::size_t(i)] = float(i) * 0.37f - 3.1f;
      std::vector<std::uint8_t> buf(static_cast<std::size_t>(n) * size_of(t));
      from_f32(t, src.data(), buf.data(), n);
      to_f32(t, buf.data(), back.data(), n);
      for (int i = 0; i < n; ++i) {
        const float expect = t == dtype::f32   ? src[std::size_t(i)]
                             : t == dtype::f16 ? f16_to_f32(f32_to_f16(src[std::size_t(i)]))
                                               : bf16_to_f32(f32_to_bf16(src[std::size_t(i)]));
        CHECK(back[std::size_t(i)] == expect);
      }
    }
}

/// The value of half-precision bits from the format's definition, in double.
double half_value(std::uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0    ? std::ldexp(double(m), -24)
                     : e == 31 ? (m ? std::nan("") : INFINITY)
                               : std::ldexp(1.0 + m / 1024.0, e - 15);
  return sign ? -mag : mag;
}

TEST_CASE("f16 -> f32 matches the format's definition for every half value") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const double want = half_value(std::uint16_t(h));
    const float got = f16_to_f32(std::uint16_t(h));
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else {
      REQUIRE(double(got) == want);
      CHECK(std::signbit(got) == bool(h & 0x8000u));  // -0 stays -0
    }
  }
}

TEST_CASE("f32 -> f16 is the nearest half (ties to even) for a million f32 values, subnormals and overflow included") {
  std::vector<double> grid;  // every finite non-negative half value, ascending (bits 0..0x7bff)
  for (std::uint32_t h = 0; h <= 0x7bffu; ++h) grid.push_back(half_value(std::uint16_t(h)));
  const auto nearest = [&](float f) -> std::uint16_t {  // the reference: search the grid
    const double a = std::fabs(double(f));
    const std::uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
    if (std::isnan(f)) return 0x7e00u;
    if (a >= 65520.0) return sign | 0x7c00u;  // halfway to 2^16 and beyond: infinity
    const auto it = std::lower_bound(grid.begin(), grid.end(), a);
    std::size_t hi = std::size_t(it - grid.begin());
    if (hi == grid.size()) return sign | 0x7bffu;
    if (grid[hi] == a || hi == 0) return sign | std::uint16_t(hi);
    const std::size_t lo = hi - 1;
    const double dl = a - grid[lo], dh = grid[hi] - a;
    return sign | std::uint16_t(dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi));
  };
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 1'000'000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::uint32_t bits = std::uint32_t(state >> 32);
    if (i % 2) bits = (bits & 0x80000000u) | (0x33000000u + bits % (0x47800000u - 0x33000000u));  // the half range
    float f;
    std::memcpy(&f, &bits, 4);
    const std::uint16_t got = f32_to_f16(f), want = nearest(f);
    if (std::isnan(f)) {
      CHECK((got & 0x7fffu) > 0x7c00u);
      continue;
    }
    if (got != want) FAIL("f32 bits 0x" << std::hex << bits << ": got 0x" << got << ", want 0x" << want);
  }
}
