// Every policy configuration the suite runs, one line each. The conformance, allocation,
// bad-input and semantics tests iterate over this list (and the CUDA parity tests will), so a
// new policy or parameter set is tested everywhere by adding one line here.
#pragma once

#include <string>

#include <infkv/cpu.hpp>

#include "added_policy.hpp"

namespace infkv_test {

/// What a registered policy reads besides the layer: H2O's accumulated scores, attached to a
/// layer's inputs by `operator()` (any other policy's inputs are returned unchanged).
struct state_of {
  const infkv::cpu::h2o_state* h2o = nullptr;
  template <class R>
  infkv::layer_inputs<R> operator()(infkv::layer_inputs<R> in) const {
    return h2o != nullptr ? h2o->attach(in) : in;
  }
};

/// Calls f(label, policy, with) for every registered configuration, `with(inputs)` giving the
/// inputs the policy scores from. H2O's states are fed the attention of `observed` (one step)
/// first, so their scores are not all zero.
template <class R, class F>
void for_each_policy(const infkv::layer_inputs<R>& observed, F&& f) {
  using namespace infkv;
  const state_of none{};
  f("streaming_llm", streaming_llm{}, none);
  f("tova", tova{}, none);
  f("keydiff", keydiff{}, none);
  f("keydiff max 5", keydiff{.pool = pooling::max, .kernel = 5}, none);
  f("snapkv avg", snapkv{.window = 4, .kernel = 3, .pool = pooling::avg}, none);
  f("snapkv max", snapkv{.window = 3, .kernel = 5, .pool = pooling::max}, none);
  f("snapkv no pooling", snapkv{.window = 2, .kernel = 1}, none);
  f("inf_mllm", inf_mllm{.window = 4, .kernel = 3}, none);
  f("inf_mllm bias", inf_mllm{.window = 4, .kernel = 3, .bias = {.beta = 0.5}}, none);
  f("inf_mllm segment bias",
    inf_mllm{.window = 4, .kernel = 5, .bias = {.beta = 1.0, .shape = decay::exponential, .unit = age_unit::segments}},
    none);
  f("inf_mllm rank bias", inf_mllm{.window = 3, .kernel = 3, .bias = {.beta = 8.0, .unit = age_unit::ranks}}, none);
  f("expected_attention",
    expected_attention{.window = 4, .rotary = rope{.dims = 4}, .future = 16, .sinks = 2, .value_norm = false}, none);
  f("expected_attention neox, mean only",
    expected_attention{.window = 3,
                       .rotary = rope{.theta = 500.0, .dims = 4, .style = rope_style::neox},
                       .future = 7,
                       .sinks = 0,
                       .covariance = false,
                       .value_norm = false},
    none);
  f("renewing_tova (added by one file)", renewing_tova{}, none);
  for (const h2o cfg : {h2o{}, h2o{.normalize_lifetime = true, .forgetting = 0.8}}) {
    cpu::h2o_state st(cfg, observed.keys.n_heads);
    st.append(observed.keys.n_slots);
    cpu::observe(st, observed);
    f(cfg.normalize_lifetime ? "h2o lifetime + forgetting" : "h2o", cfg, state_of{&st});
  }
}

}  // namespace infkv_test
