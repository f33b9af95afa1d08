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

  /// Optional pooling along time (not in the paper; the default is its rule): with max pooling
  /// over `kernel` neighbours a slot scores as its most distinctive neighbour, so a statement that
  /// stands out is kept whole rather than token by token.
  pooling pool = pooling::none;
  std::int32_t kernel = 1;

  void validate() const { spec().score.validate(name); }
  policy_spec spec() const {
    return {.name = name,
            .score = {.source = score_source::key_diversity, .pool = pool, .kernel = kernel},
            .natural = granularity::per_head};
  }
};

}  // namespace infkv
