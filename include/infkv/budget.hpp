// infkv: cache budgets: an absolute slot count or a ratio of the current slots, plus the
// protected sinks (first positions) and recent window (last positions).
#pragma once

#include <cmath>
#include <cstdint>

#include "error.hpp"

namespace infkv {

/// How many slots one decision unit keeps. Exactly one of `capacity` (absolute) and `ratio`
/// (fraction of the slots present, rounded up) is set. `sinks` first and `recent` last positions
/// are always kept; a budget that cannot hold them is an error, never a silent clamp.
struct budget {
  std::int64_t capacity = 0;
  double ratio = 0.0;
  std::int64_t sinks = 0;
  std::int64_t recent = 0;

  /// Throws `infkv::error` naming the first invalid field.
  void validate() const {
    INFKV_REQUIRE(capacity >= 0, "budget.capacity", capacity, "must be >= 0");
    INFKV_REQUIRE(std::isfinite(ratio) && ratio >= 0.0 && ratio <= 1.0, "budget.ratio", ratio, "must be in [0, 1]");
    INFKV_REQUIRE((capacity > 0) != (ratio > 0.0), "budget.capacity", capacity,
                  "set exactly one of capacity (> 0) and ratio (> 0); ratio = ", ratio);
    constexpr std::int64_t most = std::int64_t(1) << 62;  // sinks + recent never overflows
    INFKV_REQUIRE(sinks >= 0 && sinks < most, "budget.sinks", sinks, "must be in [0, 2^62)");
    INFKV_REQUIRE(recent >= 0 && recent < most, "budget.recent", recent, "must be in [0, 2^62)");
    if (capacity > 0)
      INFKV_REQUIRE(capacity >= sinks + recent, "budget.capacity", capacity,
                    "cannot hold its protected tokens: sinks (", sinks, ") + recent (", recent, ")");
  }

  /// Slots to keep out of `n_slots` present: min(n_slots, capacity or ceil(ratio * n_slots)).
  std::int64_t keep_count(std::int64_t n_slots) const {
    validate();
    INFKV_REQUIRE(n_slots >= 0, "n_slots", n_slots, "must be >= 0");
    const std::int64_t cap = capacity > 0 ? capacity : std::int64_t(std::ceil(ratio * double(n_slots) - 1e-9));
    if (cap >= n_slots) return n_slots;
    INFKV_REQUIRE(cap >= sinks + recent, "budget.ratio", ratio, "keeps ", cap, " of ", n_slots,
                  " slots, fewer than its protected sinks (", sinks, ") + recent (", recent, ")");
    return cap;
  }
};

}  // namespace infkv
