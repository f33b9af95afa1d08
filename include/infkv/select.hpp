// infkv: the order of selection. Every backend keeps the protected sinks and recent tokens, then
// the highest scores in this one total order (see `keep_before`); cpu::select_top is the host's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "budget.hpp"
#include "config.hpp"
#include "keep_set.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

/// The total order of selection: slot a is kept before slot b when its score is higher; equal
/// scores (-0 and +0 are equal) go to the newer position, then to the lower slot. NaN never
/// reaches it (selection raises first). Every backend keeps exactly the set this order gives.
INFKV_HOST_DEVICE inline bool keep_before(float sa, std::int64_t pos_a, std::int64_t slot_a, float sb,
                                          std::int64_t pos_b, std::int64_t slot_b) {
  if (sa != sb) return sa > sb;
  if (pos_a != pos_b) return pos_a > pos_b;
  return slot_a < slot_b;
}

}  // namespace infkv
