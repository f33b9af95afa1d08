// TOVA (Oren et al., arXiv 2401.06104): once over capacity, keep the slots the last query attends
// to most, averaged over all heads of the layer. Inputs: keys, the last query. Granularity: per
// layer (one row). Cost per call and layer: O(Hq * n * d).
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

struct tova {
  static constexpr std::string_view name = "tova";
  static constexpr unsigned needs = needs_keys | needs_queries;
  static constexpr granularity natural_granularity = granularity::per_layer;

  void validate() const {}
  void finish(score_matrix&, std::span<const token>) const {}
  budget protect(budget b) const { return b; }
};

}  // namespace infkv
