#include <cmath>
#include <cstdint>
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
  CHECK(f16_to_f32(f32_to_f16(1.0f + 1.0f / 2048)) == 1.0f);              // halfway: down to even
  CHECK(f16_to_f32(f32_to_f16(1.0f + 3.0f / 2048)) == 1.0f + 1.0f / 512);  // halfway: up to even
  CHECK(std::isinf(f16_to_f32(f32_to_f16(70000.f))));
  CHECK(f16_to_f32(f32_to_f16(5.9604645e-8f)) == 5.9604645e-8f);    // smallest subnormal
  CHECK(f16_to_f32(f32_to_f16(2.0e-8f)) == 0.0f);
}

TEST_CASE("bf16 conversion rounds to nearest even") {
  CHECK(bf16_to_f32(f32_to_bf16(1.0f)) == 1.0f);
  CHECK(bf16_to_f32(f32_to_bf16(1.00390625f)) == 1.0f);        // 1 + 2^-8: halfway, even
  CHECK(bf16_to_f32(f32_to_bf16(1.01171875f)) == 1.015625f);   // 1 + 3*2^-8: halfway, up to even
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
        const float expect = t == dtype::f32 ? src[std::size_t(i)]
                             : t == dtype::f16 ? f16_to_f32(f32_to_f16(src[std::size_t(i)]))
                                               : bf16_to_f32(f32_to_bf16(src[std::size_t(i)]));
        CHECK(back[std::size_t(i)] == expect);
      }
    }
}
