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
  static constexpr unsigned needs = needs_keys | needs_queries;
  static constexpr granularity natural_granularity = granularity::per_head;

  std::int64_t window = 32;         ///< observation window (queries); also kept as recent tokens
  std::int32_t kernel = 5;          ///< pooling width (odd)
  pooling pool = pooling::avg;      ///< avg (paper default) or max (LongBench config)

  void validate() const {
    detail::require(window >= 1, "snapkv.window", window, "must be >= 1");
    detail::require(kernel >= 1 && kernel % 2 == 1, "snapkv.kernel", kernel, "must be odd and >= 1");
  }
  void finish(score_matrix& s, std::span<const token> t) const { pool_along_time(s, t, kernel, pool); }
  /// The observation window is always kept: recent = max(budget.recent, window).
  budget protect(budget b) const {
    b.recent = std::max(b.recent, window);
    return b;
  }
};

}  // namespace infkv
