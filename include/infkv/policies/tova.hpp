// TOVA (Oren et al., arXiv 2401.06104): once over capacity, keep the slots the last query attends
// to most, averaged over all heads of the layer. Inputs: keys, the last query. Granularity: per
// layer (one row). Cost per call and layer: O(Hq * n * d).
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

struct tova {
  static constexpr std::string_view name = "tova";

  void validate() const {}
  policy_spec spec() const {
    return {
        .name = name, .score = {.source = score_source::last_query, .queries = 1}, .natural = granularity::per_layer};
  }
};

}  // namespace infkv
