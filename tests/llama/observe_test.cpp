// llama.cpp adapter: what a session observes and where its policies read the keys. Scoring
// llama.cpp's own cache (key_source::engine) keeps what scoring the session's copies keeps;
// observing queries only before an eviction (evicts_above) keeps it too; what cannot be read is
// refused with the reason; the session holds no key copy where it reads the engine's.
#include "llama_fixture.hpp"

#include <infkv/cpu/score.hpp>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

/// The positions a session holds, in slot order.
std::vector<std::int64_t> slot_positions(const lc::session& s) {
  std::vector<std::int64_t> p;
  for (const auto& t : s.tokens()) p.push_back(t.pos);
  return p;
}

/// Streams `n` random tokens through `s` (a few multi-token decodes among single ones), evicting
/// with `p` to `b` whenever the size exceeds `above`; returns the slot positions after every
/// eviction.
template <class P>
std::vector<std::vector<std::int64_t>> stream(lc::session& s, const P& p, const infkv::budget& b, std::int64_t above,
                                              std::int64_t n, unsigned seed) {
  const auto toks = random_tokens(std::size_t(n), seed);
  std::vector<std::vector<std::int64_t>> out;
  for (std::int64_t i = 0; i < n;) {
    const std::int64_t step = i % 23 == 0 ? std::min<std::int64_t>(5, n - i) : 1;
    REQUIRE(s.decode(std::span(toks).subspan(std::size_t(i), std::size_t(step))) == 0);
    i += step;
    if (s.size() > above) {
      s.evict(p, b);
      out.push_back(slot_positions(s));
      check_memory_matches(s);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("llama session: scoring llama.cpp's own cache keeps what scoring the copies keeps") {
  auto model = tiny_model(2);
  const infkv::budget b{.capacity = 40, .sinks = 2};
  ggml_type type = GGML_TYPE_F32;
  lc::position_mode mode = lc::position_mode::compact;
  SUBCASE("f32 cache, compact positions") {}
  SUBCASE("f32 cache, positions kept") { mode = lc::position_mode::keep; }
  SUBCASE("f16 cache, compact positions") { type = GGML_TYPE_F16; }
  SUBCASE("f16 cache, positions kept") { type = GGML_TYPE_F16, mode = lc::position_mode::keep; }
  const auto check = [&](const auto& policy) {
    CAPTURE(policy.spec().name);
    auto opt = lc::session_options::for_policy(policy, {.positions = mode});
    auto copy_opt = opt;
    copy_opt.keys = lc::key_source::copy;
    lc::session engine(model.get(), opt), copy(model.get(), copy_opt);
    auto c1 = bound_context(model.get(), engine, {.n_ubatch = 16, .type_k = type});
    auto c2 = bound_context(model.get(), copy, {.n_ubatch = 16, .type_k = type});
    const auto a = stream(engine, policy, b, 47, 150, 7), c = stream(copy, policy, b, 47, 150, 7);
    CHECK(engine.keys() == lc::key_source::engine);
    CHECK(copy.keys() == lc::key_source::copy);
    REQUIRE(a.size() >= 10);
    CHECK(a == c);
    // The scores themselves: the same rows, up to llama.cpp's and infkv's re-rotation rounding.
    for (std::int32_t l = 0; l < 2; ++l) {
      const auto x = infkv::cpu::layer_scores(policy, engine.inputs(l)),
                 y = infkv::cpu::layer_scores(policy, copy.inputs(l));
      REQUIRE(x.data.size() == y.data.size());
      float worst = 0, mag = 0;
      for (std::size_t i = 0; i < x.data.size(); ++i)
        worst = std::max(worst, std::fabs(x.data[i] - y.data[i])), mag = std::max(mag, std::fabs(y.data[i]));
      CHECK(mag > 0);
      CHECK(worst <= (mode == lc::position_mode::keep ? 0.f : 1e-3f * mag));
    }
  };
  check(infkv::snapkv{.window = 8});
  check(infkv::inf_mllm{.window = 8, .bias = {.beta = 8.0}});
  check(infkv::keydiff{});
  check(infkv::tova{});
}

TEST_CASE("llama session: observing queries only before an eviction keeps the same keep sets") {
  auto model = tiny_model(2);
  const infkv::budget b{.capacity = 40, .sinks = 2};
  const infkv::snapkv p{.window = 8};
  auto base = lc::session_options::for_policy(p);
  auto gated_opt = base;
  gated_opt.evicts_above = 47;
  lc::session all(model.get(), base), gated(model.get(), gated_opt);
  auto c1 = bound_context(model.get(), all);
  auto c2 = bound_context(model.get(), gated);
  const auto a = stream(all, p, b, 47, 200, 8), g = stream(gated, p, b, 47, 200, 8);
  REQUIRE(a.size() >= 15);
  CHECK(a == g);
  CHECK(all.stats().observed == all.stats().decodes);
  // After each eviction to 40 the stream decodes 8 tokens before the next; the window reads the
  // last 8, so a single-token decode before size 40 + 8 - 8 is not observed.
  CHECK(gated.stats().observed < gated.stats().decodes);
  CHECK(gated.stats().observed > a.size());
  const auto m = gated.memory();
  CHECK(m.keys == 0);
  CHECK(m.values == 0);
  CHECK(m.queries <= 2 * (8 + 5) * 4 * 16 * 4 + 2 * 16 * 4);  // the window, one batch's landing rows, a row

  SUBCASE("an eviction before the declared one reads queries nobody observed: refused") {
    REQUIRE(gated.size() <= 47);
    while (gated.size() > 41) {  // back to just above the budget, then one unobserved decode
      gated.evict(p, {.capacity = gated.size() - 1, .sinks = 2});
      REQUIRE(gated.decode(random_tokens(1, 3)) == 0);
    }
    const auto before = slot_positions(gated);
    if (gated.size() + 1 <= 47 - 8) {
      REQUIRE(gated.decode(random_tokens(1, 4)) == 0);
      CHECK_THROWS_WITH_AS(gated.evict(p, {.capacity = 30, .sinks = 2}),
                           doctest::Contains("session_options.evicts_above = 47"), infkv::error);
      CHECK(gated.size() == std::int64_t(before.size()) + 1);
      check_memory_matches(gated);
    }
  }
  SUBCASE("a policy that reads no queries evicts whenever it is asked") {
    REQUIRE(gated.decode(random_tokens(1, 5)) == 0);
    CHECK_NOTHROW(gated.evict(infkv::keydiff{}, {.capacity = 30, .sinks = 2}));
    CHECK(gated.size() == 30);
  }
}

TEST_CASE("llama session: where llama.cpp's cache cannot be read, the copies serve or the reason is given") {
  auto model = tiny_model(2);
  SUBCASE("copies of another type than the cache's: copies; key_source::engine is refused at bind") {
    // (a quantized cache is refused alike; the tiny model's head_dim 16 admits no q8_0 cache)
    lc::session s(model.get(),
                  lc::session_options::for_policy(infkv::snapkv{.window = 8}, {.key_type = infkv::dtype::f16}));
    auto ctx = bound_context(model.get(), s);
    REQUIRE(s.decode(random_tokens(20, 1)) == 0);
    CHECK(s.keys() == lc::key_source::copy);
    CHECK(s.memory().keys > 0);
    lc::session e(model.get(), {.key_type = infkv::dtype::f16, .keys = lc::key_source::engine});
    auto p = context_params({});
    e.attach(p);
    context_ptr c(llama_init_from_model(model.get(), p));
    CHECK_THROWS_WITH_AS(e.bind(c.get()),
                         doctest::Contains("session_options.keys = engine: key_type differs from the cache's"),
                         infkv::invalid_argument);
  }
  SUBCASE("H2O observes every decode against the copies") {
    lc::session s(model.get(), lc::session_options::for_policy(infkv::h2o{}));
    auto ctx = bound_context(model.get(), s);
    REQUIRE(s.decode(random_tokens(20, 2)) == 0);
    CHECK(s.keys() == lc::key_source::copy);
  }
  SUBCASE("values stored transposed (flash attention off): copies; engine is refused at the first decode") {
    const infkv::inf_mllm p{.window = 8, .value_norm = true};
    lc::session s(model.get(), lc::session_options::for_policy(p));
    auto ctx = bound_context(model.get(), s, {.flash_attn = false});
    REQUIRE(s.decode(random_tokens(20, 3)) == 0);
    CHECK(s.keys() == lc::key_source::copy);
    lc::session f(model.get(), lc::session_options::for_policy(p));
    auto fctx = bound_context(model.get(), f, {.flash_attn = true});
    REQUIRE(f.decode(random_tokens(20, 3)) == 0);
    CHECK(f.keys() == lc::key_source::engine);
    CHECK(f.memory().values == 0);
    auto opt = lc::session_options::for_policy(p);
    opt.keys = lc::key_source::engine;
    lc::session e(model.get(), opt);
    auto ectx = bound_context(model.get(), e, {.flash_attn = false});
    CHECK_THROWS_WITH_AS(e.decode(random_tokens(20, 3)), doctest::Contains("V cache holds no rows"),
                         infkv::engine_error);
    CHECK(e.size() == 0);
    check_memory_matches(e);
    CHECK_THROWS_WITH_AS(e.decode(random_tokens(4, 3)), doctest::Contains("V cache holds no rows"),
                         infkv::engine_error);  // refused again, never copies in its place
    CHECK(e.size() == 0);
  }
  SUBCASE("a sliding-window model: copies") {
    auto gemma = tiny_gemma3();
    lc::session s(gemma.get(), lc::session_options::for_policy(infkv::snapkv{.window = 8}));
    auto ctx = bound_context(gemma.get(), s);
    REQUIRE(s.decode(random_tokens(20, 4)) == 0);
    CHECK(s.keys() == lc::key_source::copy);
  }
  SUBCASE("two evictions without a decode between: llama.cpp has not turned its keys yet") {
    lc::session s(model.get(), lc::session_options::for_policy(infkv::snapkv{.window = 8}));
    auto ctx = bound_context(model.get(), s);
    REQUIRE(s.decode(random_tokens(60, 5)) == 0);
    REQUIRE(s.evict(infkv::snapkv{.window = 8}, {.capacity = 40, .sinks = 2}).shifted);
    CHECK_THROWS_WITH_AS(s.evict(infkv::snapkv{.window = 8}, {.capacity = 30, .sinks = 2}),
                         doctest::Contains("decode before evicting again"), infkv::error);
    CHECK(s.size() == 40);
    REQUIRE(s.decode(random_tokens(1, 6)) == 0);
    CHECK(s.evict(infkv::snapkv{.window = 8}, {.capacity = 30, .sinks = 2}).kept == 30);
    check_memory_matches(s);
  }
}

namespace {

/// A scattered keep set over `n` slots: the first two, then about two in three, drawn from `seed`.
infkv::keep_set scattered_keep(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::int64_t> slots;
  for (std::int64_t i = 0; i < n; ++i)
    if (i < 2 || rng() % 3 != 0) slots.push_back(i);
  infkv::keep_set keep(n);
  keep.add_unit(slots);
  return keep;
}

/// True when `cells` are consecutive from `first` on.
bool one_run_from(const std::vector<std::int64_t>& cells, std::int64_t first) {
  for (std::size_t i = 0; i < cells.size(); ++i)
    if (cells[i] != first + std::int64_t(i)) return false;
  return !cells.empty();
}

}  // namespace

TEST_CASE("llama session: gather_cells puts the next decode into one run of cells and changes no result") {
  auto model = tiny_model(2);
  ctx_config cfg{.n_ubatch = 16};
  lc::position_mode mode = lc::position_mode::compact;
  SUBCASE("f32 cache, compact positions") {}
  SUBCASE("f32 cache, positions kept") { mode = lc::position_mode::keep; }
  SUBCASE("f16 cache, flash attention, compact positions") { cfg.type_k = GGML_TYPE_F16, cfg.flash_attn = true; }
  // Cells in another order change llama.cpp's sums only by rounding: f32 on the first two; flash
  // attention over an f16 cache accumulates in f16 (about 1e-3).
  const float tol = cfg.flash_attn ? 5e-3f : 1e-4f;
  const infkv::keydiff policy{};
  auto opt = lc::session_options::for_policy(policy, {.positions = mode});
  opt.scratch_seq = 1;
  auto gopt = opt;
  gopt.gather_cells = true;
  lc::session plain(model.get(), opt), gathered(model.get(), gopt);
  auto c1 = shared_context(model.get(), plain, cfg);
  lc::graph_observer watch(2);  // behind the session's observer: where each decode's K rows go
  auto p = context_params(cfg);
  p.n_seq_max = 2, p.kv_unified = true;
  gathered.attach(p);
  watch.install(p);
  context_ptr c2(llama_init_from_model(model.get(), p));
  REQUIRE(c2 != nullptr);
  gathered.bind(c2.get());

  const auto decode_both = [&](const std::vector<llama_token>& t) {
    REQUIRE(plain.decode(t) == 0);
    watch.begin({.queries = false, .keys = false, .values = false, .cells = true});
    REQUIRE(gathered.decode(t) == 0);
    watch.end();
  };
  decode_both(random_tokens(16, 1));
  decode_both(random_tokens(16, 2));
  decode_both(random_tokens(16, 3));
  REQUIRE(gathered.keys() == lc::key_source::engine);
  // Explicit scattered keep sets: the same slots leave both sessions.
  for (unsigned round = 0; round < 4; ++round) {
    CAPTURE(round);
    const auto keep = scattered_keep(plain.size(), 10 + round);
    plain.apply(keep);
    gathered.apply(keep);
    CHECK(slot_positions(gathered) == slot_positions(plain));
    check_memory_matches(gathered);
    const std::int64_t n = gathered.size();
    decode_both(random_tokens(12, 20 + round));
    CHECK(one_run_from(watch.layers()[0].cells, n));  // right after the cached cells 0..n-1
    const auto want = last_logits(c1.get()), got = last_logits(c2.get());
    float scale = 0.f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    REQUIRE(scale > 0.1f);
    CHECK(max_abs_diff(got, want) <= tol * std::max(1.f, scale));
  }
  CHECK(gathered.stats().gathered > 0);
  CHECK(plain.stats().gathered == 0);
  CHECK(gathered.memory().gather > 0);  // the moved cells' state, counted
  CHECK(plain.memory().gather == 0);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(c2.get()), 1) == -1);  // the scratch sequence is left empty
  // The policy scores the moved rows as it scored them where they were.
  const auto x = infkv::cpu::layer_scores(policy, gathered.inputs(1)),
             y = infkv::cpu::layer_scores(policy, plain.inputs(1));
  REQUIRE(x.data.size() == y.data.size());
  float worst = 0, mag = 0;
  for (std::size_t i = 0; i < x.data.size(); ++i)
    worst = std::max(worst, std::fabs(x.data[i] - y.data[i])), mag = std::max(mag, std::fabs(y.data[i]));
  CHECK(mag > 0);
  CHECK(worst <= tol * mag);
}

TEST_CASE("llama session: gather_cells is refused without a scratch sequence and on M-RoPE") {
  auto model = tiny_model(1);
  auto opt = lc::session_options::for_policy(infkv::keydiff{});
  opt.gather_cells = true;
  CHECK_THROWS_WITH_AS(lc::session(model.get(), opt), doctest::Contains("session_options.scratch_seq = -1"),
                       infkv::invalid_argument);
  opt.scratch_seq = 1;
  lc::session s(model.get(), opt);
  CHECK_THROWS_WITH_AS(bound_context(model.get(), s), doctest::Contains("must be below the context's n_seq_max = 1"),
                       infkv::invalid_argument);
  auto mrope = infkv::llama_cpp::load_model(std::string(INFKV_TEST_MODEL_DIR) + "/tiny-qwen2vl.gguf");
  CHECK_THROWS_WITH_AS(lc::session(mrope.get(), opt), doctest::Contains("session_options.gather_cells = true"),
                       infkv::invalid_argument);
}
