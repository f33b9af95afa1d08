// StreamingLLM (Xiao et al., arXiv 2309.17453): keep the first `sinks` tokens and the most
// recent ones. Inputs: token positions only. Granularity: per token. Cost: O(n log n) per call
// (time order). "Window without sinks" is the same policy with budget.sinks = 0.
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

/// Sinks + recent window. Scores every slot by its rank in time order (newer = higher), so the
/// budget's capacity beyond its sinks goes to the newest tokens.
struct streaming_llm {
  static constexpr std::string_view name = "streaming_llm";

  void validate() const {}
  policy_spec spec() const {
    return {.name = name, .score = {.source = score_source::recency}, .natural = granularity::per_token};
  }
};

}  // namespace infkv
