// KeyDiff (Park et al., arXiv 2504.15364): keep the keys most different from the mean key.
// Score = -cos(k_j, anchor), anchor = mean of the length-normalised keys of the slots present,
// per KV head. Inputs: keys only (no queries, no probabilities): the query-agnostic rule of
// budgeted block-wise prefill. Granularity: per KV head. Cost: O(Hkv * n * d) per call.
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

struct keydiff {
  static constexpr std::string_view name = "keydiff";

  void validate() const {}
  policy_spec spec() const { return {.name = name, .source = score_source::key_diversity, .natural = granularity::per_head}; }
};

}  // namespace infkv
