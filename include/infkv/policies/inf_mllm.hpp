// Inf-MLLM-style policy (Ning et al., arXiv 2409.09086; window, pooling and bias defined by
// infkv): keep sinks + the recent window + "attention saddles", the older tokens with the
// highest local sum of attention from a retrieval window of recent queries, with an attention
// bias toward newer tokens so the cache renews itself as the stream moves on.
// Inputs: keys, window queries (post-RoPE). Granularity: per KV head (reducible per layer or
// token). Cost per call and layer: O(Hq * window * n * d) + O(Hkv * n * kernel).
#pragma once

#include <string_view>

#include "../policy.hpp"
#include "attention_bias.hpp"

namespace infkv {

struct inf_mllm {
  static constexpr std::string_view name = "inf_mllm";
  static constexpr unsigned needs = needs_keys | needs_queries;
  static constexpr granularity natural_granularity = granularity::per_head;

  std::int64_t window = 32;        ///< retrieval window: recent queries that score the cache
  std::int32_t kernel = 5;         ///< local-sum width (odd): saddles come with their neighbours
  pooling pool = pooling::sum;
  attention_bias bias{};

  void validate() const {
    detail::require(window >= 1, "inf_mllm.window", window, "must be >= 1");
    detail::require(kernel >= 1 && kernel % 2 == 1, "inf_mllm.kernel", kernel, "must be odd and >= 1");
    bias.validate();
  }
  void finish(score_matrix& s, std::span<const token> t) const {
    pool_along_time(s, t, kernel, pool);
    bias.apply(s, t);
  }
  budget protect(budget b) const { return b; }
};

}  // namespace infkv
