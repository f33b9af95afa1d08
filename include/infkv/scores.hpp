// infkv: scores (one row per decision unit, one column per slot, higher = keep): the
// non-owning `score_view` the pipeline and kernels take, the owning `score_matrix`, granularity,
// reductions across heads and layers, and pooling along time (host implementations).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "tokens.hpp"

namespace infkv {

/// Non-owning row-major scores: `rows` x `cols`, row r at `data + r * ld` (ld >= cols).
/// Trivially copyable: kernels take it by value. `T` is `float` for scores that may be written
/// (`score_view`) and `const float` for scores only read (`const_score_view`); a writable view
/// converts to a read-only one.
template <class T>
struct basic_score_view {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = 0;

  INFKV_HOST_DEVICE T* row(std::int64_t r) const { return data + r * ld; }
  INFKV_HOST_DEVICE T& operator()(std::int64_t r, std::int64_t c) const { return data[r * ld + c]; }
  /// Rows [first, first + count).
  INFKV_HOST_DEVICE basic_score_view rows_from(std::int64_t first, std::int64_t count) const {
    return {data + first * ld, count, cols, ld};
  }
  INFKV_HOST_DEVICE constexpr operator detail::read_only_view<std::is_const_v<T>, basic_score_view<const float>>()
      const {
    return {data, rows, cols, ld};
  }
};
using score_view = basic_score_view<float>;
using const_score_view = basic_score_view<const float>;

/// Dense row-major scores owning their storage: rows = decision units (KV heads, layers, ...),
/// cols = slots. A convenience over `score_view`.
struct score_matrix {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<float> data;

  score_matrix() = default;
  score_matrix(std::int64_t r, std::int64_t c, float fill = 0.f) : rows(r), cols(c), data(checked_size(r, c), fill) {}
  std::span<float> row(std::int64_t r) { return {data.data() + r * cols, std::size_t(cols)}; }
  std::span<const float> row(std::int64_t r) const { return {data.data() + r * cols, std::size_t(cols)}; }
  float& operator()(std::int64_t r, std::int64_t c) { return data[std::size_t(r * cols + c)]; }
  float operator()(std::int64_t r, std::int64_t c) const { return data[std::size_t(r * cols + c)]; }
  /// A view of the storage.
  score_view view() { return {data.data(), rows, cols, cols}; }
  const_score_view view() const { return {data.data(), rows, cols, cols}; }

 private:
  static std::size_t checked_size(std::int64_t r, std::int64_t c) {
    INFKV_REQUIRE(r >= 0 && c >= 0, "score_matrix.rows", r, "rows and cols must be >= 0; cols = ", c);
    return static_cast<std::size_t>(r * c);
  }
};

/// What one eviction decision covers.
enum class granularity : std::uint8_t {
  per_head,   ///< each KV head keeps its own slots
  per_layer,  ///< all heads of a layer keep the same slots
  per_token,  ///< all layers and heads keep the same slots (what llama.cpp and vLLM can free)
};

constexpr const char* to_string(granularity g) {
  return g == granularity::per_head ? "per_head" : g == granularity::per_layer ? "per_layer" : "per_token";
}

/// How per-head (or per-layer) scores are combined into one decision.
enum class reduction : std::uint8_t { sum, mean, max };

constexpr const char* to_string(reduction r) {
  return r == reduction::sum ? "sum" : r == reduction::mean ? "mean" : "max";
}

/// Folds every row of `s` into `acc` (one row of s.cols): sum or max (mean is a sum divided by
/// the row count at the end, see `finish_reduction`). `first` starts the fold.
inline void reduce_into(score_view acc, const_score_view s, reduction r, bool first) {
  float* a = acc.row(0);
  if (first) std::fill(a, a + s.cols, r == reduction::max ? -std::numeric_limits<float>::infinity() : 0.f);
  for (std::int64_t row = 0; row < s.rows; ++row) {
    const float* x = s.row(row);
    for (std::int64_t c = 0; c < s.cols; ++c) a[c] = r == reduction::max ? std::max(a[c], x[c]) : a[c] + x[c];
  }
}

/// Divides a mean reduction's sum by the number of rows folded.
inline void finish_reduction(score_view acc, reduction r, std::int64_t rows_folded) {
  if (r != reduction::mean || rows_folded == 0) return;
  for (std::int64_t c = 0; c < acc.cols; ++c) acc(0, c) /= float(rows_folded);
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

/// Pools one row along time, as SnapKV's reference pools `attn[..., :-window]`: `order` lists
/// the n slots in time order; the first n - tail of them (the prefix) are pooled with an odd
/// `kernel`, stride 1, padding at the prefix's two ends (zeros for avg and sum, counted by avg;
/// nothing for max). The last `tail` slots (the observation window, which the policy protects)
/// are left as they are (see `fill_tail`). Kernel 1 (or no pooling) leaves the row as it is.
/// `tmp` holds n floats. Allocates nothing.
inline void pool_row(float* row, const std::int64_t* order, std::int64_t n, std::int32_t kernel, pooling kind,
                     std::int64_t tail, float* tmp) {
  const std::int64_t len = n - std::min(tail, n), half = kernel / 2;
  if (kind == pooling::none || kernel == 1 || len == 0) return;  // kernel 1 is the identity
  for (std::int64_t i = 0; i < len; ++i) tmp[i] = row[order[i]];
  for (std::int64_t i = 0; i < len; ++i) {
    float acc = kind == pooling::max ? -std::numeric_limits<float>::infinity() : 0.f;
    for (std::int64_t j = std::max<std::int64_t>(0, i - half); j <= std::min(len - 1, i + half); ++j)
      acc = kind == pooling::max ? std::max(acc, tmp[j]) : acc + tmp[j];
    row[order[i]] = kind == pooling::avg ? acc / float(kernel) : acc;
  }
}

/// Gives the last `tail` slots of a pooled row (in time order) the mean score of the rest. The
/// window is protected, so its scores never decide what is kept; its raw mass, unpooled, would
/// not be comparable with pooled scores, and the mean leaves the row's mean (which the attention
/// bias divides by) that of the pooled slots. No-op when no prefix remains or nothing is left out.
inline void fill_tail(float* row, const std::int64_t* order, std::int64_t n, std::int64_t tail) {
  const std::int64_t len = n - std::min(tail, n);
  if (len == 0 || len == n) return;
  double sum = 0;
  for (std::int64_t i = 0; i < len; ++i) sum += row[order[i]];
  const auto mean = float(sum / double(len));
  for (std::int64_t i = len; i < n; ++i) row[order[i]] = mean;
}

/// Throws `infkv::invalid_argument` naming the first NaN score.
inline void check_scores(const_score_view s, const char* name = "scores") {
  for (std::int64_t r = 0; r < s.rows; ++r)
    for (std::int64_t c = 0; c < s.cols; ++c)
      if (std::isnan(s(r, c))) [[unlikely]]
        detail::fail("infkv: ", name, "[", r, ", ", c, "] = nan: scores must not be NaN");
}
inline void check_scores(const score_matrix& s, const char* name = "scores") { check_scores(s.view(), name); }

}  // namespace infkv
