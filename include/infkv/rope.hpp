// infkv: RoPE parameters and the compact position mode, backend-neutral: after an eviction the
// kept slots get positions first, first + 1, ... in time order, and every backend re-rotates
// its post-RoPE keys by the returned deltas (rotating by delta moves a key from p to p + delta).
// Normal layout (GPT-J / llama.cpp "norm"): pairs (2i, 2i+1); NeoX layout: pairs (i, i + dims/2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "tokens.hpp"

namespace infkv {

/// Which dimensions a rotation pairs: normal (2i, 2i+1) or NeoX (i, i + dims/2).
enum class rope_style : std::uint8_t { normal, neox };

/// RoPE parameters: frequency of pair i is freq_scale * theta^(-2i / dims); `dims` rotary
/// dimensions (0 = head_dim), the rest pass through.
struct rope {
  double theta = 10000.0;
  std::int32_t dims = 0;
  rope_style style = rope_style::normal;
  double freq_scale = 1.0;

  /// Checks the parameters that do not depend on the head size.
  void validate() const {
    INFKV_REQUIRE(dims >= 0 && dims % 2 == 0, "rope.dims", dims, "must be even and >= 0");
    INFKV_REQUIRE(std::isfinite(theta) && theta > 0, "rope.theta", theta, "must be > 0");
    INFKV_REQUIRE(std::isfinite(freq_scale) && freq_scale > 0, "rope.freq_scale", freq_scale, "must be > 0");
  }
  /// Checks the parameters for keys of `head_dim` and returns the rotary dimensions.
  std::int32_t checked_dims(std::int32_t head_dim) const {
    const std::int32_t d = dims == 0 ? head_dim : dims;
    INFKV_REQUIRE(d > 0 && d <= head_dim && d % 2 == 0, "rope.dims", dims,
                  "must be even and in [0, head_dim = ", head_dim, "]");
    validate();
    return d;
  }
};

/// Frequency (radians per position) of rotary pair i of `dims` rotary dimensions.
INFKV_HOST_DEVICE inline double rope_frequency(const rope& r, std::int32_t i, std::int32_t dims) {
  return r.freq_scale * ::pow(r.theta, -2.0 * double(i) / double(dims));
}

/// The two dimensions rotary pair i of `dims` rotary dimensions turns: (2i, 2i + 1) or (i, i + dims / 2).
INFKV_HOST_DEVICE inline void rope_pair(rope_style s, std::int32_t i, std::int32_t dims, std::int32_t& a,
                                        std::int32_t& b) {
  a = s == rope_style::normal ? 2 * i : i;
  b = s == rope_style::normal ? a + 1 : i + dims / 2;
}

/// Compact position mode: gives the slots positions first, first + 1, ... in time order and
/// returns each slot's delta (new - old) for `rerotate`. Slots sharing a position keep sharing it.
/// With `max_gap` > 0 a gap between two consecutive positions is narrowed to at most `max_gap`
/// free positions instead of closed (a gap that size or smaller stays as it is), so kept runs far
/// apart in the stream stay apart.
inline std::vector<std::int64_t> compact_positions(std::span<token> tokens, std::int64_t first = 0,
                                                   std::int64_t max_gap = 0) {
  INFKV_REQUIRE(max_gap >= 0, "compact_positions: max_gap", max_gap, "must be >= 0");
  std::vector<std::int64_t> delta(tokens.size(), 0);
  const auto order = time_order(tokens);
  std::int64_t next = first - 1, last_old = -1;
  for (std::size_t i = 0; i < order.size(); ++i) {
    token& t = tokens[std::size_t(order[i])];
    if (i == 0)
      next = first;
    else if (t.pos != last_old)
      next += std::min(t.pos - last_old - 1, max_gap) + 1;  // no overflow for any max_gap
    last_old = t.pos;
    delta[std::size_t(order[i])] = next - t.pos;
    t.pos = next;
  }
  return delta;
}

}  // namespace infkv
