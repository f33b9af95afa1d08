// Attention bias (Inf-MLLM, Ning et al., arXiv 2409.09086; formula defined by infkv): push the
// choice toward newer tokens so that a streaming cache keeps renewing itself across rounds.
// Inputs: scores and token positions or segments. Granularity: any (applied per row).
// Cost: O(rows * cols) per call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../error.hpp"
#include "../scores.hpp"
#include "../tokens.hpp"

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
    detail::require(std::isfinite(beta) && beta >= 0.0, "bias.beta", beta, "must be finite and >= 0");
    detail::require(std::isfinite(rate) && rate > 0.0, "bias.rate", rate, "must be finite and > 0");
  }

  /// Recency term in [0, 1] for a normalised age a in [0, 1].
  double recency(double a) const {
    if (shape == decay::linear) return 1.0 - a;
    return (std::exp(-rate * a) - std::exp(-rate)) / (1.0 - std::exp(-rate));
  }

  void apply(score_matrix& s, std::span<const token> tokens) const {
    validate();
    if (beta == 0.0 || s.cols == 0) return;
    validate_tokens(tokens, s.cols);
    std::vector<double> when(tokens.size());  // larger = newer
    if (unit == age_unit::ranks) {
      std::vector<std::int64_t> distinct(tokens.size());
      for (std::size_t i = 0; i < tokens.size(); ++i) distinct[i] = tokens[i].pos;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      for (std::size_t i = 0; i < tokens.size(); ++i)
        when[i] = double(std::lower_bound(distinct.begin(), distinct.end(), tokens[i].pos) - distinct.begin());
    } else {
      for (std::size_t i = 0; i < tokens.size(); ++i)
        when[i] = unit == age_unit::positions ? double(tokens[i].pos) : double(tokens[i].segment);
    }
    const auto [oldest, newest] = std::minmax_element(when.begin(), when.end());
    const double top = *newest, span = *newest - *oldest;
    for (std::int64_t r = 0; r < s.rows; ++r) {
      auto row = s.row(r);
      double mean = 0;
      for (float v : row) mean += v;
      mean /= double(s.cols);
      const double inv = mean > 0 ? 1.0 / mean : 1.0;
      for (std::int64_t c = 0; c < s.cols; ++c) {
        const double a = span > 0 ? (top - when[std::size_t(c)]) / span : 0.0;
        row[std::size_t(c)] = float(row[std::size_t(c)] * inv + beta * recency(a));
      }
    }
  }
};

}  // namespace infkv
