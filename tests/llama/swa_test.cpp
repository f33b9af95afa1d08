// llama.cpp adapter on a model with sliding-window layers (a tiny random-weight Gemma 3: layers 0
// and 2 slide over 16 positions with RoPE base 100, layers 1 and 3 are global with base 10000):
// llama.cpp's iSWA cache made full-size by attach(), each layer's RoPE read from its key node,
// host keys re-rotated with it, bookkeeping equal to the engine's through many evictions.
#include "llama_fixture.hpp"

#include <algorithm>
#include <set>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

TEST_CASE("llama session, sliding-window model: each layer's RoPE comes from the graph") {
  auto model = tiny_gemma3();
  REQUIRE(llama_model_n_swa(model.get()) == 16);
  lc::session s(model.get(), {.window = 8});
  auto ctx = bound_context(model.get(), s);
  CHECK(s.mode() == lc::position_mode::compact);  // llama.cpp shifts an iSWA cache only when full-size
  CHECK(s.rope().params.theta == doctest::Approx(10000.0));
  REQUIRE(s.decode(random_tokens(20, 3)) == 0);
  for (int l = 0; l < 4; ++l) {
    CAPTURE(l);
    CHECK(s.layer_rope(l).supported);
    CHECK(s.layer_rope(l).params.dims == 16);
    CHECK(s.layer_rope(l).params.theta == doctest::Approx(l % 2 == 0 ? 100.0 : 10000.0));
    CHECK(s.inputs(l).rotary->theta == s.layer_rope(l).params.theta);
  }
}

TEST_CASE("llama session, sliding-window model: re-rotated keys are the keys at their new positions") {
  // Layer 0's keys depend on the token and its position only: after eviction and compaction the
  // session's copy (re-rotated with base 100) must equal what a fresh session computes for the
  // kept tokens at positions 0..n-1. With the model's base (10000) it would not.
  auto model = tiny_gemma3();
  const auto toks = random_tokens(40, 5);
  lc::session s(model.get(), {.window = 8});
  auto ctx = bound_context(model.get(), s);
  REQUIRE(s.decode(toks) == 0);
  const auto r = s.evict(infkv::inf_mllm{.window = 8}, {.capacity = 20, .sinks = 2, .recent = 4});
  REQUIRE(r.shifted);
  std::vector<llama_token> kept;
  for (std::int64_t p = 0; p < 40; ++p)
    if (std::none_of(r.removed.begin(), r.removed.end(),
                     [&](const auto& run) { return p >= run.begin && p < run.end; }))
      kept.push_back(toks[std::size_t(p)]);
  REQUIRE(kept.size() == 20);
  lc::session fresh(model.get(), {.window = 8});
  auto c2 = bound_context(model.get(), fresh);
  REQUIRE(fresh.decode(kept) == 0);
  const auto a = s.inputs(0).keys, b = fresh.inputs(0).keys;
  float diff = 0, mag = 0;
  for (std::int64_t j = 0; j < 20; ++j) {
    const auto slot = std::int64_t(
        std::find_if(s.tokens().begin(), s.tokens().end(), [&](auto& t) { return t.pos == j; }) - s.tokens().begin());
    for (std::int32_t h = 0; h < 2; ++h) {
      const auto* x = static_cast<const float*>(a.row(slot, h));
      const auto* y = static_cast<const float*>(b.row(j, h));
      for (int e = 0; e < 16; ++e) diff = std::max(diff, std::abs(x[e] - y[e])), mag = std::max(mag, std::abs(y[e]));
    }
  }
  CHECK(mag > 0.1f);
  CHECK(diff < 1e-4f * mag);
}

TEST_CASE("llama session, sliding-window model: bookkeeping follows the engine through many evictions") {
  auto model = tiny_gemma3();
  for (const bool fa : {false, true}) {
    CAPTURE(fa);
    lc::session s(model.get(), {.window = 16, .key_type = infkv::dtype::f16, .values = true});
    auto ctx = bound_context(model.get(), s, {.flash_attn = fa});
    const auto stream = random_tokens(240, 9);
    for (std::size_t at = 0; at < stream.size(); at += 16) {
      REQUIRE(s.decode(std::vector<llama_token>(stream.begin() + std::ptrdiff_t(at),
                                                stream.begin() + std::ptrdiff_t(at + 16))) == 0);
      check_memory_matches(s);
      if (s.size() > 48) {
        const auto r = at % 32 == 0 ? s.evict(infkv::expected_attention{.window = 16, .rotary = s.rope().params},
                                              {.capacity = 48, .sinks = 4, .recent = 8})
                                    : s.evict(infkv::streaming_llm{}, {.capacity = 48, .sinks = 4});
        CHECK(r.kept == 48);
        check_memory_matches(s);
      }
    }
    CHECK(positions(s) == range_set(48));
    check_room(s);  // llama.cpp's cache holds exactly the session's cells
  }
}

TEST_CASE("llama session, sliding-window model: score_global_layers scores layers 1 and 3 only") {
  // The tiny Gemma 3's global layers are 1 and 3; the session finds them from llama.cpp's state
  // (the global layers' cache matched against its key copies), and its keep set is the
  // pipeline's over those two layers' inputs, which differs from the one over all four.
  auto model = tiny_gemma3();
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2, .recent = 4};
  for (const bool fa : {false, true}) {
    CAPTURE(fa);
    auto opt = lc::session_options::for_policy(policy);
    opt.score_global_layers = true;
    lc::session s(model.get(), opt);
    auto ctx = bound_context(model.get(), s, {.flash_attn = fa, .type_k = fa ? GGML_TYPE_F16 : GGML_TYPE_F32});
    CHECK_THROWS_WITH(s.scored_layers(), doctest::Contains("decode first"));
    REQUIRE(s.decode(random_tokens(48, 21)) == 0);
    CHECK(s.scored_layers() == std::vector<std::int32_t>{1, 3});
    const auto keep_of = [&](const std::vector<std::int32_t>& layers) {
      std::vector<infkv::layer_inputs<infkv::const_paged_rows>> in;
      for (const auto l : layers) in.push_back(s.inputs(l));
      const infkv::cpu::backend be{};
      const auto pl =
          infkv::make_plan(be, policy.spec(), b, infkv::shape_of(in.front()),
                           {.g = infkv::granularity::per_token, .r = opt.reduce, .n_layers = std::int32_t(in.size())});
      infkv::cpu::workspace ws(pl.workspace_bytes);
      std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size())), slots(std::size_t(pl.kept_total));
      const infkv::keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
      infkv::run(pl, be, std::span<const infkv::layer_inputs<infkv::const_paged_rows>>(in), ws.span(), out);
      std::set<std::int64_t> pos;
      const auto keep = infkv::keep_set::from_view(out);
      for (const auto k : keep.unit(0)) pos.insert(s.tokens()[std::size_t(k)].pos);
      return pos;
    };
    const auto want = keep_of({1, 3});
    CHECK(want != keep_of({0, 1, 2, 3}));
    const auto before = positions(s);
    const auto r = s.evict(policy, b);
    CHECK(not_removed(before, r.removed) == want);
    check_memory_matches(s);
  }
  auto opt = lc::session_options::for_policy(policy);
  opt.score_global_layers = true;
  opt.capture = false;
  CHECK_THROWS_WITH(lc::session(model.get(), opt), doctest::Contains("session_options.score_global_layers = true"));
  // a model without sliding layers: every layer
  auto plain_model = tiny_model(2);
  auto o2 = lc::session_options::for_policy(policy);
  o2.score_global_layers = true;
  lc::session plain(plain_model.get(), o2);
  auto c2 = bound_context(plain_model.get(), plain);
  REQUIRE(plain.decode(random_tokens(8, 2)) == 0);
  CHECK(plain.scored_layers() == std::vector<std::int32_t>{0, 1});
}
