// H2O (Zhang et al., arXiv 2306.14048): heavy hitters. Score = running sum over decode steps of
// the attention each cached key receives (GQA: mean over the G query heads of a KV head),
// optionally divided by the number of queries that could see the slot (lifetime) or with old
// mass forgotten (factor per step). Keep heavy hitters + a recent window.
// Inputs: attention probabilities of every step (recomputed from Q and K by the backend, so
// flash attention can stay on). Granularity: per KV head. State: one float pair per (head, slot).
// Cost: O(Hq * n * d) per decode step to observe, O(Hkv * n) to score. The accumulators belong to
// the engine's side, kept by the backend that updates them (cpu::h2o_state and cpu::observe on the
// host, cuda::h2o_observe on a GPU); the pipeline reads them as layer_inputs::accumulated.
#pragma once

#include <string_view>

#include "../policy.hpp"

namespace infkv {

/// H2O: a policy whose score source is the accumulated attention (score_source::accumulated).
struct h2o {
  static constexpr std::string_view name = "h2o";

  bool normalize_lifetime = false;  ///< divide by the number of queries that saw the slot
  double forgetting = 1.0;          ///< old mass is multiplied by this before each step, in (0, 1]

  void validate() const { spec().score.validate(name); }
  /// No protection of its own: its recent window is the budget's.
  policy_spec spec() const {
    return {.name = name,
            .score = {.source = score_source::accumulated, .accumulate = {normalize_lifetime, forgetting}},
            .natural = granularity::per_head};
  }
};

}  // namespace infkv
