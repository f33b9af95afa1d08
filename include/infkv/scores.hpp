// infkv: score matrices (one row per decision unit, one column per slot, higher = keep),
// granularity, reductions across heads and layers, and pooling along time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "error.hpp"
#include "tokens.hpp"

namespace infkv {

/// Dense row-major scores: rows = decision units (KV heads, layers, ...), cols = slots.
struct score_matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<float> data;

  score_matrix() = default;
  score_matrix(std::int64_t r, std::int64_t c, float fill = 0.f)
      : rows(r), cols(c),
        data((detail::require(r >= 0 && c >= 0, "score_matrix.rows", r, "rows and cols must be >= 0; cols = ", c),
              static_cast<std::size_t>(r * c)),
             fill) {}
  std::span<float> row(std::int64_t r) { return {data.data() + r * cols, std::size_t(cols)}; }
  std::span<const float> row(std::int64_t r) const { return {data.data() + r * cols, std::size_t(cols)}; }
  float& operator()(std::int64_t r, std::int64_t c) { return data[std::size_t(r * cols + c)]; }
  float operator()(std::int64_t r, std::int64_t c) const { return data[std::size_t(r * cols + c)]; }
};

/// What one eviction decision covers.
enum class granularity : std::uint8_t {
  per_head,   ///< each KV head keeps its own slots
  per_layer,  ///< all heads of a layer keep the same slots
  per_token,  ///< all layers and heads keep the same slots (what llama.cpp and vLLM can free)
};

/// How per-head (or per-layer) scores are combined into one decision.
enum class reduction : std::uint8_t { sum, mean, max };

constexpr const char* to_string(reduction r) {
  return r == reduction::sum ? "sum" : r == reduction::mean ? "mean" : "max";
}

/// Combines score rows column by column: add() any number of matrices with the same cols, then
/// result() gives one row. Use it across heads (per layer) and across layers (per token).
class score_reducer {
 public:
  explicit score_reducer(reduction r) : r_(r) {}
  void add(const score_matrix& s) {
    if (count_ == 0) acc_.assign(std::size_t(s.cols), r_ == reduction::max ? -std::numeric_limits<float>::infinity() : 0.f);
    detail::require(std::int64_t(acc_.size()) == s.cols, "scores.cols", s.cols,
                    "must match the columns added before (", acc_.size(), ")");
    for (std::int64_t r = 0; r < s.rows; ++r)
      for (std::int64_t c = 0; c < s.cols; ++c) {
        float& a = acc_[std::size_t(c)];
        a = r_ == reduction::max ? std::max(a, s(r, c)) : a + s(r, c);
      }
    count_ += s.rows;
  }
  score_matrix result() const {
    score_matrix out(1, std::int64_t(acc_.size()));
    for (std::size_t c = 0; c < acc_.size(); ++c)
      out.data[c] = r_ == reduction::mean && count_ ? acc_[c] / float(count_) : acc_[c];
    return out;
  }

 private:
  reduction r_;
  std::vector<float> acc_;
  std::int64_t count_ = 0;
};

/// One row combining all rows of `s`.
inline score_matrix reduce_rows(const score_matrix& s, reduction r) {
  score_reducer red(r);
  red.add(s);
  return red.result();
}

/// 1-D pooling kinds along time.
enum class pooling : std::uint8_t {
  none,
  avg,  ///< mean over the kernel, zero padding counted (as SnapKV's avg_pool1d)
  max,  ///< max over the kernel
  sum,  ///< local sum over the kernel (Inf-MLLM-style relevance)
};

constexpr const char* to_string(pooling p) {
  switch (p) {
    case pooling::none: return "none";
    case pooling::avg: return "avg";
    case pooling::max: return "max";
    case pooling::sum: return "sum";
  }
  return "?";
}

/// Pools every row of `s` along time order (slots sorted by position), stride 1, "same"
/// padding; `kernel` must be odd. O(rows * cols * kernel).
inline void pool_along_time(score_matrix& s, std::span<const token> tokens, std::int32_t kernel, pooling kind) {
  if (kind == pooling::none || kernel == 1) return;
  detail::require(kernel >= 1 && kernel % 2 == 1, "kernel", kernel, "pooling kernel must be odd and >= 1");
  validate_tokens(tokens, s.cols);
  const auto order = time_order(tokens);
  const std::int64_t n = s.cols, half = kernel / 2;
  std::vector<float> t(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < s.rows; ++r) {
    auto row = s.row(r);
    for (std::int64_t i = 0; i < n; ++i) t[std::size_t(i)] = row[std::size_t(order[std::size_t(i)])];
    for (std::int64_t i = 0; i < n; ++i) {
      float acc = kind == pooling::max ? -std::numeric_limits<float>::infinity() : 0.f;
      for (std::int64_t j = std::max<std::int64_t>(0, i - half); j <= std::min(n - 1, i + half); ++j)
        acc = kind == pooling::max ? std::max(acc, t[std::size_t(j)]) : acc + t[std::size_t(j)];
      row[std::size_t(order[std::size_t(i)])] = kind == pooling::avg ? acc / float(kernel) : acc;
    }
  }
}

/// Throws `infkv::error` naming the first NaN score.
inline void check_scores(const score_matrix& s, const char* name = "scores") {
  for (std::int64_t r = 0; r < s.rows; ++r)
    for (std::int64_t c = 0; c < s.cols; ++c)
      if (std::isnan(s(r, c)))
        detail::fail("infkv: ", name, "[", r, ", ", c, "] = nan: scores must not be NaN");
}

}  // namespace infkv
