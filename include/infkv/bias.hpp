// Attention bias (Inf-MLLM, Ning et al., arXiv 2409.09086; formula defined by infkv): push the
// choice toward newer tokens so that a streaming cache keeps renewing itself across rounds.
// Inputs: scores and token positions or segments. Granularity: any (applied per row).
// Cost: O(rows * cols) per call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

/// Shape of the recency term f(a), a = age / oldest age in [0, 1]; f(0) = 1, f(1) = 0.
enum class decay : std::uint8_t {
  linear,       ///< f = 1 - a
  exponential,  ///< f = (exp(-rate a) - exp(-rate)) / (1 - exp(-rate))
};

/// What age is counted in.
enum class age_unit : std::uint8_t {
  positions,  ///< position differences: in compact mode (positions 0..n-1) the same as ranks
  segments,   ///< frames, tiles or turns
  ranks,      ///< distinct cached positions newer than the token: a cache whose positions keep
              ///< growing (keep mode) ages its tokens as a compacted one would
};

/// Each row is divided by its mean (scores become "times an average slot's relevance", free of
/// cache size), then `beta * f(age)` is added. beta = 0 leaves the ranking unchanged.
struct attention_bias {
  double beta = 0.0;
  decay shape = decay::linear;
  age_unit unit = age_unit::positions;
  double rate = 4.0;  ///< steepness of the exponential shape

  void validate() const {
    INFKV_REQUIRE(std::isfinite(beta) && beta >= 0.0, "bias.beta", beta, "must be finite and >= 0");
    INFKV_REQUIRE(std::isfinite(rate) && rate > 0.0, "bias.rate", rate, "must be finite and > 0");
  }

  /// Recency term in [0, 1] for a normalised age a in [0, 1] (host and device).
  INFKV_HOST_DEVICE double recency(double a) const {
    if (shape == decay::linear) return 1.0 - a;
    return (::exp(-rate * a) - ::exp(-rate)) / (1.0 - ::exp(-rate));
  }

  /// Applies the bias to every row of `s`. `order` lists the slots in time order; `when` holds
  /// s.cols doubles of scratch. Allocates nothing.
  void apply(score_view s, std::span<const token> tokens, const std::int64_t* order, double* when) const {
    if (beta == 0.0 || s.cols == 0) return;
    const auto n = std::int64_t(tokens.size());
    std::int64_t rank = -1;  // ranks: index among the distinct cached positions, oldest = 0
    for (std::int64_t i = 0; i < n; ++i) {
      const token& t = tokens[std::size_t(order[i])];
      if (i == 0 || t.pos != tokens[std::size_t(order[i - 1])].pos) ++rank;
      when[order[i]] = unit == age_unit::ranks       ? double(rank)
                       : unit == age_unit::positions ? double(t.pos)
                                                     : double(t.segment);
    }
    const auto [oldest, newest] = std::minmax_element(when, when + n);
    const double top = *newest, span = *newest - *oldest;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      float* row = s.row(r);
      double mean = 0;
      for (std::int64_t c = 0; c < s.cols; ++c) mean += row[c];
      mean /= double(s.cols);
      const double inv = mean > 0 ? 1.0 / mean : 1.0;
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double a = span > 0 ? (top - when[c]) / span : 0.0;
        row[c] = float(row[c] * inv + beta * recency(a));
      }
    }
  }

  /// Applies the bias to every row of `s` (allocating its scratch).
  void apply(score_matrix& s, std::span<const token> tokens) const {
    validate();
    if (beta == 0.0 || s.cols == 0) return;
    validate_tokens(tokens, s.cols);
    const auto order = time_order(tokens);
    std::vector<double> when(tokens.size());
    apply(s.view(), tokens, order.data(), when.data());
  }
};

}  // namespace infkv
