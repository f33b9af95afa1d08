// A policy added the way docs/design.md's walk-through adds one: this file and its line in
// policy_registry.hpp, nothing else. Every test that runs the registry then covers it (the
// float64 reference through the spec, conformance, properties, the allocation-free run, the CUDA
// steps against the CPU), and so would every engine-facing call.
#pragma once

#include <string_view>

#include <infkv/infkv.hpp>

namespace infkv_test {

/// TOVA with the attention bias: the slots the last query attends to most, pulled toward newer
/// ones so that the choice renews as a stream moves on; the newest `recent` always kept.
struct renewing_tova {
  static constexpr std::string_view name = "renewing_tova";

  infkv::attention_bias bias{.beta = 0.5, .unit = infkv::age_unit::ranks};
  std::int64_t recent = 4;

  void validate() const {
    bias.validate();
    INFKV_REQUIRE(recent >= 0, "renewing_tova.recent", recent, "must be >= 0");
  }
  infkv::policy_spec spec() const {
    return {.name = name,
            .score = {.source = infkv::score_source::last_query, .queries = 1, .bias = bias},
            .protect_recent = recent,
            .natural = infkv::granularity::per_layer};
  }
};

}  // namespace infkv_test
