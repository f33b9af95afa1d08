// SnapKV (Li et al., arXiv 2404.14469): score each cached key by the attention it receives from
// an observation window of the last `window` queries, smoothed by 1-D pooling along time; keep
// the top scores plus the whole window. Inputs: keys, window queries (post-RoPE).
// Granularity: per KV head (the G query heads of a group are averaged). Cost per call and layer:
// O(Hq * window * n * d) for the logits (a small GEMM per head) + O(Hkv * n * kernel) pooling.
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

struct snapkv {
  static constexpr std::string_view name = "snapkv";

  std::int64_t window = 32;     ///< observation window (queries); also kept as recent tokens
  std::int32_t kernel = 5;      ///< pooling width (odd)
  pooling pool = pooling::avg;  ///< avg (paper default) or max (LongBench config)

  void validate() const { spec().score.validate(name); }
  /// Pooling covers the slots before the observation window (SnapKV's `attn[..., :-window]`);
  /// the window is always kept: recent = max(budget.recent, window). Max pooling runs per query
  /// head, then the G heads of a group are averaged.
  policy_spec spec() const {
    return {.name = name,
            .score = {.source = score_source::window_attention,
                      .queries = window,
                      .pool = pool,
                      .kernel = kernel,
                      .pool_tail = window},
            .protect_recent = window,
            .natural = granularity::per_head};
  }
};

}  // namespace infkv
