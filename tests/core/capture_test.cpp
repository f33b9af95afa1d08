// capture_needs_of: the one answer to "what must my engine capture for this policy", written out
// per policy here by hand (the pipeline test checks that it is also enough to score).
#include <optional>

#include <doctest/doctest.h>
#include <infkv/infkv.hpp>

using namespace infkv;

TEST_CASE("capture_needs_of names what each policy reads") {
  CHECK(capture_needs_of(streaming_llm{}) == capture_needs{});
  CHECK_FALSE(capture_needs_of(streaming_llm{}).observes());
  CHECK(capture_needs_of(keydiff{}) == capture_needs{.keys = true});
  CHECK(capture_needs_of(tova{}) == capture_needs{.keys = true, .queries = 1});
  CHECK(capture_needs_of(snapkv{.window = 12}) == capture_needs{.keys = true, .queries = 12});
  CHECK(capture_needs_of(inf_mllm{}) == capture_needs{.keys = true, .queries = 32});
  CHECK(capture_needs_of(inf_mllm{.window = 8, .value_norm = true}) ==
        capture_needs{.keys = true, .values = true, .queries = 8});
  CHECK(capture_needs_of(expected_attention{}) ==
        capture_needs{.keys = true, .values = true, .queries = 64, .rope = true});
  CHECK(capture_needs_of(expected_attention{.window = 5, .rotary = std::nullopt, .value_norm = false}) ==
        capture_needs{.keys = true, .queries = 5});
  CHECK(capture_needs_of(h2o{}) == capture_needs{.attention = true});
  CHECK(capture_needs_of(h2o{.forgetting = 0.5}) == capture_needs{.attention = true});
  for (const capture_needs& c : {capture_needs{.keys = true}, capture_needs{.values = true},
                                 capture_needs{.queries = 1}, capture_needs{.attention = true}})
    CHECK(c.observes());
  CHECK_FALSE(capture_needs{.rope = true}.observes());  // RoPE is a parameter, not something captured per token
}

TEST_CASE("capture_needs_of checks the policy first") {
  CHECK_THROWS_WITH_AS(capture_needs_of(snapkv{.window = 0}), doctest::Contains("snapkv.window = 0"), invalid_argument);
  CHECK_THROWS_WITH_AS(capture_needs_of(h2o{.forgetting = 2}), doctest::Contains("h2o.forgetting = 2"),
                       invalid_argument);
}
