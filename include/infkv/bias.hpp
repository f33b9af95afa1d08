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
};

}  // namespace infkv
