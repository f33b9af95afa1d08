// Expected Attention (Devoto et al., arXiv 2510.00636; kvpress's default press): score each cached
// key by the attention that future queries are expected to give it, in closed form from the
// statistics of a window of recent queries (mean and covariance per query head, taken before
// RoPE), with RoPE averaged over the next `future` positions; optionally times |v_j| (kvpress's
// use_vnorm, on by default there and here). Query-agnostic about the next question: nothing of it
// needs to have been asked yet. Inputs: keys, window queries (post-RoPE; turned back with the
// model's RoPE), values for the value norm. Granularity: per KV head.
// Cost per call and layer: O(Hq * min(n * window * d, (window + n) * d^2)): the covariance term
// k' Sigma' k as squared projections on the window's centred queries for short windows, as a
// d x d matrix per query head for long ones (kvpress's whole-prefill statistics), whichever costs
// less (covariance_as_matrix).
#pragma once

#include <optional>
#include <string_view>

#include "../policy.hpp"

namespace infkv {

struct expected_attention {
  static constexpr std::string_view name = "expected_attention";

  std::int64_t window = 64;             ///< recent queries whose statistics model the future ones
  std::optional<rope> rotary = rope{};  ///< the model's RoPE; nullopt for a model without RoPE
  std::int64_t future = 512;            ///< future positions RoPE is averaged over (kvpress: 512)
  std::int64_t sinks = 4;               ///< first slots left out of the softmax and always kept (kvpress: n_sink = 4)
  bool covariance = true;               ///< the covariance term (kvpress: use_covariance)
  bool value_norm = true;               ///< times |v_j| (kvpress: use_vnorm)

  void validate() const { spec().score.validate(name); }
  expectation expect() const {
    return {.rotary = rotary.value_or(rope{}),
            .rotated = rotary.has_value(),
            .future = future,
            .sinks = sinks,
            .covariance = covariance};
  }
  policy_spec spec() const {
    return {.name = name,
            .score = {.source = score_source::expected_attention,
                      .queries = window,
                      .value_norm = value_norm,
                      .expect = expect()},
            .protect_sinks = sinks,
            .natural = granularity::per_head};
  }
};

}  // namespace infkv
