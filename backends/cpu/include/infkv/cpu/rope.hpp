// infkv CPU backend: RoPE re-rotation of cached (post-RoPE) keys by a position delta, for the
// compact position mode: rotating by delta moves a key from position p to p + delta. The RoPE
// parameters and the position compaction are the core's (infkv/rope.hpp).
// Cost: O(n * heads * d) plus one sin/cos pair per distinct delta and frequency.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <infkv/kv_view.hpp>
#include <infkv/rope.hpp>
#include <infkv/tokens.hpp>

#include "executor.hpp"

namespace infkv::cpu {

// The core's RoPE parameters and position compaction, also reachable as cpu::rope etc.
using infkv::compact_positions;
using infkv::rope;
using infkv::rope_style;

/// Rotates every head of slot j by delta[j] positions (keys only), in place.
template <row_source R>
void rerotate(const R& keys, std::span<const std::int64_t> delta, const rope& r, const executor& ex = {}) {
  validate(keys, "keys");
  INFKV_REQUIRE(std::int64_t(delta.size()) == keys.n_slots, "delta.size()", delta.size(),
                "must equal keys.n_slots (", keys.n_slots, ")");
  const std::int32_t dims = r.checked_dims(keys.head_dim);
  const std::int32_t half = dims / 2;
  std::vector<double> freq(static_cast<std::size_t>(half));
  for (std::int32_t i = 0; i < half; ++i) freq[std::size_t(i)] = rope_frequency(r, i, dims);
  parallel_for(ex, keys.n_slots, [&](std::int64_t j) {
    const std::int64_t dp = delta[std::size_t(j)];
    if (dp == 0) return;
    std::vector<float> c(static_cast<std::size_t>(half)), s(static_cast<std::size_t>(half)), x(static_cast<std::size_t>(keys.head_dim));
    for (std::int32_t i = 0; i < half; ++i) {
      const double a = double(dp) * freq[std::size_t(i)];
      c[std::size_t(i)] = float(std::cos(a)), s[std::size_t(i)] = float(std::sin(a));
    }
    for (std::int32_t h = 0; h < keys.n_heads; ++h) {
      void* row = keys.row(j, h);
      to_f32(keys.type, row, x.data(), keys.head_dim);
      for (std::int32_t i = 0; i < half; ++i) {
        std::int32_t a = 0, b = 0;
        rope_pair(r.style, i, dims, a, b);
        const float x0 = x[std::size_t(a)], x1 = x[std::size_t(b)];
        x[std::size_t(a)] = x0 * c[std::size_t(i)] - x1 * s[std::size_t(i)];
        x[std::size_t(b)] = x0 * s[std::size_t(i)] + x1 * c[std::size_t(i)];
      }
      from_f32(keys.type, x.data(), row, keys.head_dim);
    }
  });
}

}  // namespace infkv::cpu
