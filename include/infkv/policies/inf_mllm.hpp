// Inf-MLLM-style policy (Ning et al., arXiv 2409.09086; window, pooling and bias defined by
// infkv): keep sinks + the recent window + "attention saddles", the older tokens with the
// highest local sum of attention from a retrieval window of recent queries, with an attention
// bias toward newer tokens so the cache renews itself as the stream moves on.
// Inputs: keys, window queries (post-RoPE). Granularity: per KV head (reducible per layer or
// token). Cost per call and layer: O(Hq * window * n * d) + O(Hkv * n * kernel).
#pragma once

#include <string_view>

#include "../bias.hpp"
#include "../policy.hpp"

namespace infkv {

struct inf_mllm {
  static constexpr std::string_view name = "inf_mllm";

  std::int64_t window = 32;  ///< retrieval window: recent queries that score the cache
  std::int32_t kernel = 5;   ///< local-sum width (odd): saddles come with their neighbours
  pooling pool = pooling::sum;
  attention_bias bias{};
  bool value_norm = false;  ///< attention times |v_j| before the local sum (value-aware saddles)

  void validate() const { spec().score.validate(name); }
  /// As SnapKV: the local sum covers the slots before the retrieval window, which is always
  /// kept; then the attention bias.
  policy_spec spec() const {
    return {.name = name,
            .score = {.source = score_source::window_attention,
                      .queries = window,
                      .pool = pool,
                      .kernel = kernel,
                      .pool_tail = window,
                      .bias = bias,
                      .value_norm = value_norm},
            .protect_recent = window,
            .natural = granularity::per_head};
  }
};

}  // namespace infkv
