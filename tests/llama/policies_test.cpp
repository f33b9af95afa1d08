// llama.cpp adapter: eviction with every policy, the per-token selection it makes, and H2O's
// state mirroring the cache.
#include "llama_fixture.hpp"

#include <algorithm>
#include <set>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

/// Decodes 48 tokens in chunks, evicts with `p` to 24 slots, checks the cache, decodes on.
template <class P>
lc::eviction_result evict_and_go_on(lc::session& s, const P& p) {
  const auto toks = random_tokens(48, 51);
  for (std::size_t i = 0; i < toks.size(); i += 12)
    REQUIRE(s.decode(std::vector<llama_token>(toks.begin() + std::ptrdiff_t(i),
                                              toks.begin() + std::ptrdiff_t(i + 12))) == 0);
  const auto r = s.evict(p, {.capacity = 24, .sinks = 2, .recent = 4});
  CHECK(r.kept == 24);
  CHECK(r.evicted == 24);
  CHECK(s.size() == 24);
  check_memory_matches(s);
  std::int64_t removed = 0;
  for (const auto& run : r.removed) {
    CHECK(run.begin >= 2);  // sinks kept
    CHECK(run.end <= 44);   // recent kept
    removed += run.end - run.begin;
  }
  CHECK(removed == 24);
  REQUIRE(s.decode(std::vector<llama_token>{11, 12}) == 0);
  CHECK(s.size() == 26);
  check_memory_matches(s);
  return r;
}

}  // namespace

TEST_CASE("llama session: eviction works with every policy") {
  auto model = tiny_model(2);
  SUBCASE("streaming_llm keeps sinks and the newest tokens") {
    lc::session s(model.get());
    auto ctx = bound_context(model.get(), s);
    const auto r = evict_and_go_on(s, infkv::streaming_llm{});
    REQUIRE(r.removed.size() == 1);
    CHECK(r.removed[0] == infkv::position_run{2, 26});
  }
  SUBCASE("snapkv keeps its observation window") {
    lc::session s(model.get(), {.window = 16});
    auto ctx = bound_context(model.get(), s, {.flash_attn = true});
    const auto r = evict_and_go_on(s, infkv::snapkv{.window = 12});
    for (const auto& run : r.removed) CHECK(run.end <= 36);
  }
  SUBCASE("keydiff") {
    lc::session s(model.get(), {.key_type = infkv::dtype::f16, .reduce = infkv::reduction::max});
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, infkv::keydiff{});
  }
  SUBCASE("tova") {
    lc::session s(model.get(), {.reduce = infkv::reduction::sum});
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, infkv::tova{});
  }
  SUBCASE("h2o, its state mirroring the cache") {
    lc::session s(model.get(), {.track_h2o = infkv::h2o{.normalize_lifetime = true}});
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, infkv::h2o{.normalize_lifetime = true});
    for (int l = 0; l < 2; ++l) {
      CHECK(s.h2o_scores(l).n_slots() == s.size());
      CHECK(s.h2o_scores(l).n_heads() == 2);
    }
    // Each decode step spreads one unit of attention per query head over the visible keys:
    // the last two tokens' queries added mass 1 per KV head (mean of its 2 query heads) each.
    const auto sc = s.h2o_scores(0).scores();
    CHECK(sc(0, s.size() - 1) > 0.f);
  }
  SUBCASE("expected_attention reads the values the session captures, and asks for them") {
    lc::session none(model.get(), {.window = 16});
    auto c0 = bound_context(model.get(), none);
    REQUIRE(none.decode(random_tokens(30, 5)) == 0);
    CHECK_THROWS_WITH_AS(
        none.evict(infkv::expected_attention{.window = 16, .rotary = none.rope().params}, {.capacity = 20, .sinks = 2}),
        doctest::Contains("session_options.values = false"), infkv::invalid_argument);
    CHECK(none.size() == 30);
    lc::session s(model.get(), {.window = 16, .key_type = infkv::dtype::f16, .values = true});
    auto ctx = bound_context(model.get(), s, {.flash_attn = true});
    evict_and_go_on(s, infkv::expected_attention{.window = 16, .rotary = s.rope().params});
    lc::session v(model.get(), {.values = true});
    auto cv = bound_context(model.get(), v);
    evict_and_go_on(v, infkv::inf_mllm{.window = 8, .value_norm = true});
  }
  SUBCASE("inf_mllm with attention bias") {
    lc::session s(model.get());
    auto ctx = bound_context(model.get(), s, {.flash_attn = true});
    evict_and_go_on(s, infkv::inf_mllm{.window = 8, .bias = {.beta = 0.5}});
  }
  SUBCASE("the union of two selections: share 1 and 0 evict as each policy alone") {
    using u = infkv::union_of<infkv::inf_mllm, infkv::keydiff>;
    const infkv::inf_mllm first{.window = 4, .bias = {.beta = 0.5}};
    const auto runs_of = [&](const auto& p) {
      lc::session s(model.get(), lc::session_options::for_policy(p));
      auto ctx = bound_context(model.get(), s);
      return evict_and_go_on(s, p).removed;
    };
    CHECK(lc::session_options::for_policy(u{first, {}, 0.5}).window == 4);
    CHECK(runs_of(u{first, {}, 1.0}) == runs_of(first));
    CHECK(runs_of(u{first, {}, 0.0}) == runs_of(infkv::keydiff{}));
    const auto half = runs_of(u{first, {}, 0.5});
    CHECK(half != runs_of(first));
    CHECK(half != runs_of(infkv::keydiff{}));
  }
}

TEST_CASE("llama session: session_options::for_policy captures what the policy reads, and nothing more") {
  auto model = tiny_model(2);
  const lc::session_options base{.key_type = infkv::dtype::f16, .reduce = infkv::reduction::max};
  SUBCASE("streaming_llm: no capture at all") {
    const auto o = lc::session_options::for_policy(infkv::streaming_llm{}, base);
    CHECK_FALSE(o.capture);
    CHECK_FALSE(o.values);
    CHECK(o.key_type == infkv::dtype::f16);  // the rest of the base stays
    CHECK(o.reduce == infkv::reduction::max);
    lc::session s(model.get(), o);
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, infkv::streaming_llm{});
  }
  SUBCASE("snapkv: its window of queries") {
    const infkv::snapkv p{.window = 12};
    const auto o = lc::session_options::for_policy(p, base);
    CHECK((o.capture && !o.values && o.window == 12 && !o.track_h2o));
    lc::session s(model.get(), o);
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, p);
    CHECK_THROWS_WITH_AS(s.evict(infkv::snapkv{.window = 13}, {.capacity = 20}),
                         doctest::Contains("snapkv.window = 13"), infkv::invalid_argument);
  }
  SUBCASE("expected_attention: values too") {
    lc::session probe(model.get());
    const infkv::expected_attention p{.window = 16, .rotary = probe.rope().params};
    const auto o = lc::session_options::for_policy(p, base);
    CHECK((o.capture && o.values && o.window == 16));
    lc::session s(model.get(), o);
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, p);
  }
  SUBCASE("h2o: the attention of every decode") {
    const infkv::h2o p{.forgetting = 0.9};
    const auto o = lc::session_options::for_policy(p, base);
    REQUIRE(o.track_h2o);
    CHECK((o.capture && !o.values && o.track_h2o->forgetting == 0.9));
    lc::session s(model.get(), o);
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, p);
  }
  SUBCASE("a union with h2o: the attention of every decode and the other policy's window") {
    const infkv::union_of<infkv::h2o, infkv::snapkv> u{{.normalize_lifetime = true}, {.window = 6}, 0.5};
    const auto o = lc::session_options::for_policy(u, base);
    REQUIRE(o.track_h2o);
    CHECK((o.capture && o.window == 6 && o.track_h2o->normalize_lifetime));
    lc::session s(model.get(), o);
    auto ctx = bound_context(model.get(), s);
    evict_and_go_on(s, u);
    // H2O's settings must be the session's: its state accumulated with them.
    CHECK_THROWS_WITH_AS(s.evict(infkv::h2o{}, {.capacity = 20}), doctest::Contains("h2o.forgetting"),
                         infkv::invalid_argument);
  }
}

TEST_CASE("llama session: the per-token choice is the top of the layers' combined scores") {
  auto model = tiny_model(2);
  lc::session s(model.get(), {.window = 8, .positions = lc::position_mode::keep});
  auto ctx = bound_context(model.get(), s);
  REQUIRE(s.decode(random_tokens(40, 61)) == 0);
  const infkv::snapkv p{.window = 8, .kernel = 3};
  // Expected: mean over every head row of both layers, computed here from the layer scores.
  std::vector<float> mean(40, 0.f);
  int rows = 0;
  for (int l = 0; l < 2; ++l) {
    const auto sc = infkv::cpu::layer_scores(p, s.inputs(l));
    for (std::int64_t r = 0; r < sc.rows; ++r, ++rows)
      for (std::int64_t j = 0; j < 40; ++j) mean[std::size_t(j)] += sc(r, j);
  }
  REQUIRE(rows == 4);
  std::vector<std::int64_t> cand;  // positions 1..31: not sink (0), not window (32..39)
  for (std::int64_t j = 1; j < 32; ++j) cand.push_back(j);
  std::stable_sort(cand.begin(), cand.end(),
                   [&](auto a, auto b) { return mean[std::size_t(a)] > mean[std::size_t(b)]; });
  std::set<std::int64_t> want{0};
  for (std::int64_t j = 32; j < 40; ++j) want.insert(j);
  for (int i = 0; i < 11; ++i) want.insert(cand[std::size_t(i)]);
  s.evict(p, {.capacity = 20, .sinks = 1});
  std::set<std::int64_t> got;
  for (const auto& t : s.tokens()) got.insert(t.pos);
  CHECK(got == want);
  check_memory_matches(s);
}

TEST_CASE("llama session: h2o accumulates the attention of every decode") {
  auto model = tiny_model(1);
  lc::session s(model.get(), {.track_h2o = infkv::h2o{}});
  auto ctx = bound_context(model.get(), s);
  REQUIRE(s.decode(random_tokens(10, 71)) == 0);
  // Ten causal queries: each KV head's row sums to 10 (one unit of probability per query).
  auto sc = s.h2o_scores(0).scores();
  for (std::int64_t h = 0; h < 2; ++h) {
    float sum = 0.f;
    for (std::int64_t j = 0; j < 10; ++j) sum += sc(h, j);
    CHECK(sum == doctest::Approx(10.f).epsilon(1e-4));
  }
  // The first token is seen by all ten queries, the last by one: its mass is at most 1.
  CHECK(sc(0, 9) <= 1.f + 1e-5f);
  REQUIRE(s.decode(std::vector<llama_token>{4}) == 0);
  sc = s.h2o_scores(0).scores();
  float sum = 0.f;
  for (std::int64_t j = 0; j < 11; ++j) sum += sc(1, j);
  CHECK(sum == doctest::Approx(11.f).epsilon(1e-4));
  const auto r = s.evict(infkv::h2o{}, {.capacity = 6, .sinks = 1, .recent = 2});
  CHECK(r.kept == 6);
  CHECK(s.h2o_scores(0).n_slots() == 6);
  check_memory_matches(s);
}

TEST_CASE("llama session: whole_segments keeps what select_whole_segments keeps of the decision scores") {
  auto model = tiny_model(2);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 30, .sinks = 2};
  auto opt = lc::session_options::for_policy(policy);
  opt.whole_segments = true;
  lc::session s(model.get(), opt);
  auto ctx = bound_context(model.get(), s);
  const auto toks = random_tokens(64, 17);
  std::vector<std::int32_t> seg(toks.size());
  for (std::size_t i = 0; i < seg.size(); ++i) seg[i] = std::int32_t(i / 7 + (i > 30 ? 1 : 0));  // "sentences"
  for (std::size_t i = 0; i < toks.size(); i += 16)
    REQUIRE(s.decode(std::span(toks).subspan(i, 16), {.segments = std::span(seg).subspan(i, 16)}) == 0);
  for (std::size_t i = 0; i < seg.size(); ++i) CHECK(s.tokens()[i].segment == seg[i]);

  // The session's own route: the plan's per-token scores, then whole segments first.
  std::vector<infkv::layer_inputs<infkv::const_paged_rows>> in;
  for (std::int32_t l = 0; l < s.n_layers(); ++l) in.push_back(s.inputs(l));
  const infkv::cpu::backend be{};
  const auto pl = infkv::make_plan(be, policy.spec(), b, infkv::shape_of(in.front()),
                                   {.g = infkv::granularity::per_token, .r = opt.reduce, .n_layers = s.n_layers()});
  infkv::cpu::workspace ws(pl.workspace_bytes);
  const auto sc =
      infkv::run_decision_scores(pl, be, std::span<const infkv::layer_inputs<infkv::const_paged_rows>>(in), ws.span());
  const auto want = infkv::cpu::select_whole_segments({sc.data, std::size_t(sc.cols)}, s.tokens(), pl.keep_per_unit,
                                                      pl.effective.sinks, pl.effective.recent);
  std::set<std::int64_t> want_pos;
  for (const auto k : want.unit(0)) want_pos.insert(s.tokens()[std::size_t(k)].pos);
  infkv::score_matrix row(1, sc.cols);
  std::copy(sc.data, sc.data + sc.cols, row.data.begin());
  const auto top = infkv::cpu::select_top(row, s.tokens(), std::vector<std::int64_t>{pl.keep_per_unit},
                                          pl.effective.sinks, pl.effective.recent);
  CHECK(want.unit(0).size() == top.unit(0).size());
  CHECK(!std::ranges::equal(want.unit(0), top.unit(0)));  // segments change the choice here

  const auto before = positions(s);
  const auto r = s.evict(policy, b);
  CHECK(not_removed(before, r.removed) == want_pos);
  check_memory_matches(s);

  CHECK_THROWS_WITH_AS(s.decode(toks, {.segments = std::span(seg).first(3)}),
                       doctest::Contains("meta.segments.size() = 3"), infkv::invalid_argument);
  using u = infkv::union_of<infkv::snapkv, infkv::keydiff>;
  CHECK_THROWS_WITH_AS(s.evict(u{policy, {}, 0.5}, {.capacity = 10}), doctest::Contains("whole_segments"),
                       infkv::invalid_argument);
}
