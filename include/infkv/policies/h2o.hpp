// H2O (Zhang et al., arXiv 2306.14048): heavy hitters. Score = running sum over decode steps of
// the attention each cached key receives (GQA: mean over the G query heads of a KV head),
// optionally divided by the number of queries that could see the slot (lifetime) or with old
// mass forgotten (factor per step). Keep heavy hitters + a recent window.
// Inputs: attention probabilities of every step (recomputed from Q and K by the backend, so
// flash attention can stay on). Granularity: per KV head. State: one float pair per (head, slot).
// Cost: O(Hq * n * d) per decode step to observe, O(Hkv * n) to score. The accumulators belong to
// the backend that updates them (cpu::h2o_state on the host); the pipeline reads them as
// layer_inputs::accumulated.
#pragma once

#include <cmath>

#include "../error.hpp"
#include "../policy.hpp"

namespace infkv {

/// H2O configuration.
struct h2o {
  bool normalize_lifetime = false;  ///< divide by the number of queries that saw the slot
  double forgetting = 1.0;          ///< old mass is multiplied by this before each step, in (0, 1]

  void validate() const {
    INFKV_REQUIRE(std::isfinite(forgetting) && forgetting > 0.0 && forgetting <= 1.0, "h2o.forgetting", forgetting,
                  "must be in (0, 1]");
  }
};

/// What an engine must capture for H2O: the attention of every decoded query, accumulated
/// (cpu::observe after each decode, cpu::h2o_state scores).
inline capture_needs capture_needs_of(const h2o& config) {
  config.validate();
  return {.attention = true};
}

}  // namespace infkv
