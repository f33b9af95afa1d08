// infkv: scores (one row per decision unit, one column per slot, higher = keep): the
// non-owning `score_view` the pipeline and kernels take, the owning `score_matrix`, granularity,
// reductions across heads and layers, and pooling along time (the kinds; backends implement them).
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

/// Throws `infkv::invalid_argument` naming the first NaN score.
inline void check_scores(const_score_view s, const char* name = "scores") {
  for (std::int64_t r = 0; r < s.rows; ++r)
    for (std::int64_t c = 0; c < s.cols; ++c)
      if (std::isnan(s(r, c))) [[unlikely]]
        infkv::fail("infkv: ", name, "[", r, ", ", c, "] = nan: scores must not be NaN");
}
inline void check_scores(const score_matrix& s, const char* name = "scores") { check_scores(s.view(), name); }

}  // namespace infkv
