// llama.cpp adapter: bookkeeping against the llama memory through decodes, evictions, position
// compaction and failing decodes; the captured queries and keys.
#include "llama_fixture.hpp"

#include <algorithm>
#include <set>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

TEST_CASE("llama session: bookkeeping follows decodes and evictions in compact mode") {
  auto model = tiny_model(2);
  bool fa = false;
  SUBCASE("flash attention off") { fa = false; }
  SUBCASE("flash attention on") { fa = true; }
  lc::session s(model.get(), {.key_type = infkv::dtype::f16});
  auto ctx = bound_context(model.get(), s, {.flash_attn = fa, .n_ubatch = 16});
  REQUIRE(s.mode() == lc::position_mode::compact);
  CHECK(s.rope().kind == "norm");
  CHECK(s.rope().params.theta == doctest::Approx(10000.0));

  REQUIRE(s.decode(random_tokens(40, 1)) == 0);
  CHECK(s.size() == 40);
  CHECK(positions(s) == range_set(40));
  check_memory_matches(s);
  CHECK(s.inputs(1).keys.n_slots == 40);
  CHECK(s.inputs(1).queries.n_slots == 32);  // the window
  CHECK(s.inputs(0).query_pos.back() == 39);

  const auto stream = random_tokens(60, 2);
  std::int64_t decoded = 40;
  for (int round = 0; round < 4; ++round) {
    const auto r = s.evict(infkv::snapkv{.window = 8}, {.capacity = 24, .sinks = 2});
    CHECK(r.kept == 24);
    CHECK(r.evicted == decoded - 24);
    CHECK(r.shifted);
    CHECK(s.size() == 24);
    CHECK(positions(s) == range_set(24));
    CHECK(s.next_pos() == 24);
    check_memory_matches(s);
    for (int l = 0; l < 2; ++l) CHECK(s.inputs(l).keys.n_slots == 24);
    for (int i = 0; i < 6; ++i) {
      REQUIRE(s.decode(std::vector<llama_token>{stream[std::size_t(round * 6 + i)]}) == 0);
      check_memory_matches(s);
    }
    decoded = 30;
    CHECK(s.size() == 30);
    CHECK(positions(s) == range_set(30));
  }
}

TEST_CASE("llama session: keep mode leaves holes and continues after the newest position") {
  auto model = tiny_model(2);
  lc::session s(model.get(), {.positions = lc::position_mode::keep});
  auto ctx = bound_context(model.get(), s);
  CHECK(s.mode() == lc::position_mode::keep);
  REQUIRE(s.decode(random_tokens(50, 3)) == 0);
  const auto r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 3, .recent = 5});
  CHECK_FALSE(r.shifted);
  CHECK(s.size() == 20);
  const auto p = positions(s);
  CHECK(p.size() == 20);
  for (std::int64_t i = 0; i < 3; ++i) CHECK(p.count(i) == 1);
  for (std::int64_t i = 45; i < 50; ++i) CHECK(p.count(i) == 1);
  check_memory_matches(s);
  // The removed runs and the kept positions partition [0, 50).
  std::int64_t removed = 0;
  for (const auto& run : r.removed) {
    for (std::int64_t q = run.begin; q < run.end; ++q) CHECK(p.count(q) == 0);
    removed += run.end - run.begin;
  }
  CHECK(removed == 30);
  CHECK(s.next_pos() == 50);
  REQUIRE(s.decode(random_tokens(3, 4)) == 0);
  CHECK(s.tokens().back().pos == 52);
  check_memory_matches(s);
  check_room(s);  // the engine holds exactly the session's cells
}

TEST_CASE("llama session: position_gap narrows the gaps between kept runs to at most that many positions") {
  auto model = tiny_model(2);
  lc::session s(model.get(), {.position_gap = 2});
  auto ctx = bound_context(model.get(), s);
  REQUIRE(s.mode() == lc::position_mode::compact);
  // the positions the rule gives the cached slots' origins: in time order, each step from the
  // previous origin at most 3 (2 free positions between two runs)
  const auto want = [&] {
    std::vector<std::int64_t> o(s.origins().begin(), s.origins().end());
    std::ranges::sort(o);
    std::set<std::int64_t> p;
    std::int64_t at = 0;
    for (std::size_t i = 0; i < o.size(); ++i)
      p.insert(at = i == 0 ? 0 : at + std::min<std::int64_t>(o[i] - o[i - 1], 3));
    return p;
  };
  REQUIRE(s.decode(random_tokens(50, 3)) == 0);
  bool closed_differs = false;
  for (int round = 0; round < 3; ++round) {
    const auto r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 3, .recent = 5});
    CHECK(r.shifted);
    CHECK(s.size() == 20);
    CHECK(positions(s) == want());
    closed_differs |= positions(s) != range_set(20);
    CHECK(s.next_pos() == *positions(s).rbegin() + 1);
    check_memory_matches(s);
    REQUIRE(s.decode(random_tokens(12, 10 + round)) == 0);
    check_memory_matches(s);
  }
  CHECK(closed_differs);                        // some gap was narrowed, not closed
  CHECK(*positions(s).rbegin() < 20 * 3 + 12);  // the span stays bounded by kept x (1 + gap)
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.position_gap = -1}),
                       doctest::Contains("session_options.position_gap"), infkv::error);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.positions = lc::position_mode::keep, .position_gap = 4}),
                       doctest::Contains("session_options.position_gap"), infkv::error);
}

TEST_CASE("llama session: position_span narrows the gaps as little as keeps the positions within the span") {
  auto model = tiny_model(2);
  const std::int64_t span = 40;
  lc::session s(model.get(), {.position_span = span});
  auto ctx = bound_context(model.get(), s);
  // by brute force: the largest gap g whose rule (each step from one origin to the next at most
  // g + 1) ends below the span, and the positions it gives
  const auto want = [&] {
    std::vector<std::int64_t> o(s.origins().begin(), s.origins().end());
    std::ranges::sort(o);
    const auto place = [&](std::int64_t g) {
      std::vector<std::int64_t> p;
      for (std::size_t i = 0; i < o.size(); ++i) p.push_back(i == 0 ? 0 : p.back() + std::min(o[i] - o[i - 1], g + 1));
      return p;
    };
    std::int64_t best = 0;
    for (std::int64_t g = 0; g <= o.back() - o.front(); ++g)
      if (place(g).back() < span) best = g;
    const auto p = place(best);
    return std::set<std::int64_t>(p.begin(), p.end());
  };
  REQUIRE(s.decode(random_tokens(30, 5)) == 0);
  auto r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 3, .recent = 5});
  CHECK_FALSE(r.shifted);  // 30 origins fit in 40 positions: every gap stays whole, as in keep mode
  CHECK(positions(s) == std::set<std::int64_t>(s.origins().begin(), s.origins().end()));
  check_memory_matches(s);
  for (int round = 0; round < 4; ++round) {
    REQUIRE(s.decode(random_tokens(12, 20 + round)) == 0);
    r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 3, .recent = 5});
    CHECK(positions(s) == want());
    CHECK(*positions(s).rbegin() < span);
    check_memory_matches(s);
  }
  CHECK(*positions(s).rbegin() > 19);  // not closed: the span is used
  const auto [lo, hi] = std::ranges::minmax(s.origins());
  CHECK(hi - lo >= span);  // and the cached origins spread wider than it
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.position_gap = 2, .position_span = 10}),
                       doctest::Contains("choose one"), infkv::error);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.position_span = -1}),
                       doctest::Contains("session_options.position_span"), infkv::error);
}

TEST_CASE("llama session: a failing decode leaves the bookkeeping and the memory unchanged") {
  auto model = tiny_model(2);
  lc::session s(model.get());
  auto ctx = bound_context(model.get(), s, {.n_ctx = 256, .n_ubatch = 8});
  REQUIRE(llama_n_ctx(ctx.get()) == 256);
  REQUIRE(s.decode(random_tokens(20, 5)) == 0);

  SUBCASE("token id outside the vocabulary") {
    auto bad = random_tokens(5, 6);
    bad[3] = 100000;
    CHECK(s.decode(bad) != 0);
  }
  SUBCASE("position that does not follow the newest one") {
    llama_batch b = llama_batch_init(2, 0, 1);
    for (int i = 0; i < 2; ++i)
      b.token[i] = 7, b.pos[i] = 25 + i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = 1;
    b.n_tokens = 2;
    CHECK(s.decode(b) != 0);
    llama_batch_free(b);
  }
  SUBCASE("no room left in the context") {
    CHECK(s.decode(random_tokens(240, 7)) == 1);  // 20 + 240 > 256 cells
    CHECK(s.size() == 20);
    check_memory_matches(s);
    s.evict(infkv::streaming_llm{}, {.capacity = 10, .sinks = 2});
    CHECK(s.size() == 10);
    REQUIRE(s.decode(random_tokens(240, 7)) == 0);  // fits now
    CHECK(s.size() == 250);
    check_memory_matches(s);
    return;
  }
  SUBCASE("another sequence id is refused before decoding") {
    llama_batch b = llama_batch_init(1, 0, 1);
    b.token[0] = 7, b.pos[0] = 20, b.n_seq_id[0] = 1, b.seq_id[0][0] = 3, b.logits[0] = 1;
    b.n_tokens = 1;
    CHECK_THROWS_WITH_AS(s.decode(b), doctest::Contains("batch.seq_id[0][0] = 3"), infkv::error);
    llama_batch_free(b);
  }
  CHECK(s.size() == 20);
  CHECK(positions(s) == range_set(20));
  CHECK(s.inputs(0).keys.n_slots == 20);
  check_memory_matches(s);
  REQUIRE(s.decode(random_tokens(2, 8)) == 0);
  CHECK(s.tokens().back().pos == 21);
  check_memory_matches(s);
  check_room(s);  // the engine holds exactly the session's cells
}

TEST_CASE("llama session: an aborted decode is rolled back and the caller's cb_eval still runs") {
  auto model = tiny_model(2);
  lc::session s(model.get(), {.window = 26});
  abort_after_first_ubatch user;
  auto p = context_params({.n_ubatch = 8});
  p.cb_eval = &abort_after_first_ubatch::eval;
  p.cb_eval_user_data = &user;
  p.abort_callback = &abort_after_first_ubatch::should_abort;
  p.abort_callback_data = &user;
  s.attach(p);
  context_ptr ctx(llama_init_from_model(model.get(), p));
  REQUIRE(ctx != nullptr);
  s.bind(ctx.get());

  REQUIRE(s.decode(random_tokens(4, 9)) == 0);  // one micro-batch: no abort
  CHECK(user.kcur0_seen == 1);
  // the window queries before: 4 rows per layer
  std::vector<std::vector<float>> window;
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto q = s.inputs(l).queries;
    REQUIRE(q.n_slots == 4);
    const auto* f = static_cast<const float*>(q.data);
    window.emplace_back(f, f + q.n_slots * q.n_heads * q.head_dim);
  }
  const int rc = s.decode(random_tokens(24, 10));  // three micro-batches: aborted in the second
  CHECK(rc != 0);
  CHECK(user.abort);
  CHECK(s.size() == 4);
  check_memory_matches(s);
  // The aborted decode's 24 query rows had pushed the window's 2 oldest out (4 + 24 > 26): the
  // window keeps its 2 newest rows, unchanged, at their positions, in every layer.
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto in = s.inputs(l);
    CHECK(std::vector<std::int64_t>(in.query_pos.begin(), in.query_pos.end()) == std::vector<std::int64_t>{2, 3});
    REQUIRE(in.queries.n_slots == 2);
    const std::size_t row = std::size_t(in.queries.n_heads * in.queries.head_dim);
    const auto* f = static_cast<const float*>(in.queries.data);
    CHECK(std::equal(f, f + 2 * row, window[std::size_t(l)].begin() + std::ptrdiff_t(2 * row)));
  }
  user.abort = false;
  user.kcur0_seen = 100;
  REQUIRE(s.decode(random_tokens(24, 10)) == 0);
  CHECK(s.size() == 28);
  check_memory_matches(s);
  check_room(s);  // the engine holds exactly the session's cells
}

TEST_CASE("llama session: a context whose cb_eval was replaced is detected and rolled back") {
  auto model = tiny_model(1);
  lc::session s(model.get());
  auto p = context_params({});
  s.attach(p);
  p.cb_eval = nullptr;
  context_ptr ctx(llama_init_from_model(model.get(), p));
  s.bind(ctx.get());
  CHECK_THROWS_WITH_AS(s.decode(random_tokens(5, 11)), doctest::Contains("cb_eval saw 0 query"), infkv::error);
  CHECK(s.size() == 0);
  check_memory_matches(s);
}

namespace {

/// Largest element difference of two row sources with the same shape, and the largest magnitude.
template <infkv::row_source A, infkv::row_source B>
std::pair<float, float> row_diff(const A& a, const B& b) {
  REQUIRE(a.n_slots == b.n_slots);
  REQUIRE(a.n_heads == b.n_heads);
  float d = 0.f, mag = 0.f;
  for (std::int64_t j = 0; j < a.n_slots; ++j)
    for (int h = 0; h < a.n_heads; ++h)
      for (int e = 0; e < a.head_dim; ++e) {
        const float x = static_cast<const float*>(a.row(j, h))[e], y = static_cast<const float*>(b.row(j, h))[e];
        d = std::max(d, std::fabs(x - y)), mag = std::max(mag, std::fabs(x));
      }
  return {d, mag};
}

}  // namespace

TEST_CASE("llama session: captured keys, values and queries do not depend on batching or flash attention") {
  auto model = tiny_model(2);
  const auto toks = random_tokens(20, 12);
  lc::session one(model.get(), {.values = true}), many(model.get(), {.values = true}),
      flash(model.get(), {.values = true});
  auto c1 = bound_context(model.get(), one, {.n_ubatch = 8});
  auto c2 = bound_context(model.get(), many, {});
  auto c3 = bound_context(model.get(), flash, {.flash_attn = true, .n_ubatch = 8});
  REQUIRE(one.decode(toks) == 0);  // 3 micro-batches
  REQUIRE(flash.decode(toks) == 0);
  for (auto t : toks) REQUIRE(many.decode(std::vector<llama_token>{t}) == 0);
  for (int l = 0; l < 2; ++l) {
    const auto a = one.inputs(l), b = many.inputs(l), f = flash.inputs(l);
    CHECK(a.keys.n_heads == 2);
    CHECK(a.queries.n_heads == 4);
    CHECK(a.keys.head_dim == 16);
    CHECK(std::ranges::equal(a.query_pos, b.query_pos));
    CHECK(std::ranges::equal(a.query_pos, f.query_pos));
    const auto [dk, mk] = row_diff(a.keys, b.keys);
    const auto [dq, mq] = row_diff(a.queries, b.queries);
    CHECK(mk > 0.1f);
    CHECK(dk < 1e-5f * mk);
    CHECK(dq < 1e-5f * mq);
    // Layer 0's Q and K come before any attention: identical with flash attention; deeper layers
    // see CPU flash attention's f16 rounding.
    const auto [fk, fmk] = row_diff(a.keys, f.keys);
    const auto [fq, fmq] = row_diff(a.queries, f.queries);
    CHECK(fk <= (l == 0 ? 0.f : 1e-2f * fmk));
    CHECK(fq <= (l == 0 ? 0.f : 1e-2f * fmq));
    REQUIRE(a.values.n_slots == 20);
    CHECK(a.values.n_heads == 2);
    const auto [dv, mv] = row_diff(a.values, b.values);
    const auto [fv, fmv] = row_diff(a.values, f.values);
    CHECK(mv > 0.1f);
    CHECK(dv < 1e-5f * mv);
    CHECK(fv <= (l == 0 ? 0.f : 1e-2f * fmv));
  }
}

TEST_CASE("llama session: captured values follow eviction and position compaction unchanged") {
  auto model = tiny_model(2);
  lc::session s(model.get(), {.window = 16, .values = true});
  auto ctx = bound_context(model.get(), s, {.n_ubatch = 16});
  REQUIRE(s.decode(random_tokens(40, 21)) == 0);
  const std::size_t row = 2 * 16;
  std::vector<std::vector<float>> before(2);  // per layer, rows by position (slot j holds position j)
  for (int l = 0; l < 2; ++l) {
    const auto v = s.inputs(l).values;
    REQUIRE(v.n_slots == 40);
    for (std::int64_t j = 0; j < 40; ++j)
      for (int h = 0; h < 2; ++h) {
        const auto* x = static_cast<const float*>(v.row(j, h));
        before[std::size_t(l)].insert(before[std::size_t(l)].end(), x, x + 16);
      }
  }
  const auto r = s.evict(infkv::expected_attention{.window = 16, .rotary = s.rope().params},
                         {.capacity = 20, .sinks = 2, .recent = 4});
  REQUIRE(r.shifted);
  std::vector<std::int64_t> kept;  // old positions of the kept tokens, ascending = their new positions
  for (std::int64_t p = 0; p < 40; ++p)
    if (std::none_of(r.removed.begin(), r.removed.end(),
                     [&](const auto& run) { return p >= run.begin && p < run.end; }))
      kept.push_back(p);
  REQUIRE(kept.size() == 20);
  for (int l = 0; l < 2; ++l) {
    const auto in = s.inputs(l);
    REQUIRE(in.values.n_slots == 20);
    for (std::int64_t j = 0; j < 20; ++j) {
      const auto old = kept[std::size_t(in.tokens[std::size_t(j)].pos)];
      for (int h = 0; h < 2; ++h) {
        const auto* got = static_cast<const float*>(in.values.row(j, h));
        CHECK(
            std::equal(got, got + 16,
                       before[std::size_t(l)].begin() + std::ptrdiff_t(std::size_t(old) * row + std::size_t(h) * 16)));
      }
    }
  }
  check_memory_matches(s);
  REQUIRE(s.decode(std::vector<llama_token>{5, 6, 7}) == 0);
  CHECK(s.inputs(1).values.n_slots == 23);
}

TEST_CASE("llama session: invalid use is reported with the argument's name") {
  auto model = tiny_model(1);
  CHECK_THROWS_WITH_AS(lc::session(nullptr), doctest::Contains("model = null"), infkv::error);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.window = -1}), doctest::Contains("session_options.window = -1"),
                       infkv::error);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.key_type = infkv::dtype::bf16}),
                       doctest::Contains("session_options.key_type = bf16"), infkv::error);
  lc::session s(model.get(), {.window = 8});
  auto plain = plain_context(model.get());
  CHECK_THROWS_WITH_AS(s.bind(plain.get()), doctest::Contains("attached = false"), infkv::error);
  auto ctx = bound_context(model.get(), s);
  CHECK_THROWS_WITH_AS(s.decode(std::vector<llama_token>{}), doctest::Contains("tokens.size() = 0"), infkv::error);
  REQUIRE(s.decode(random_tokens(30, 13)) == 0);
  CHECK_THROWS_WITH_AS(s.evict(infkv::snapkv{.window = 16}, {.capacity = 20}), doctest::Contains("snapkv.window = 16"),
                       infkv::error);
  CHECK_THROWS_WITH_AS(s.evict(infkv::h2o{}, {.capacity = 20}), doctest::Contains("session_options.track_h2o"),
                       infkv::error);
  CHECK_THROWS_WITH_AS(s.inputs(1), doctest::Contains("layer = 1"), infkv::error);
  CHECK(s.size() == 30);
  check_memory_matches(s);
}

TEST_CASE("llama session: without capture no callback runs, the stats account for each call") {
  auto model = tiny_model(2);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.values = true, .capture = false}),
                       doctest::Contains("session_options.capture = false"), infkv::error);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.capture = false, .track_h2o = infkv::h2o{}}),
                       doctest::Contains("session_options.capture = false"), infkv::error);
  lc::session off(model.get(), {.capture = false});
  auto p = context_params({});
  off.attach(p);
  const bool callback = p.cb_eval != nullptr;
  CHECK_FALSE(callback);
  context_ptr ctx(llama_init_from_model(model.get(), p));
  REQUIRE(ctx != nullptr);
  off.bind(ctx.get());
  REQUIRE(off.decode(random_tokens(40, 21)) == 0);
  CHECK(off.inputs(0).keys.empty());
  const auto r = off.evict(infkv::streaming_llm{}, {.capacity = 24, .sinks = 4});
  CHECK(r.kept == 24);
  CHECK(r.shifted);
  CHECK(positions(off) == range_set(24));
  check_memory_matches(off);
  CHECK_THROWS_WITH_AS(off.evict(infkv::keydiff{}, {.capacity = 16}),
                       doctest::Contains("session_options.capture = false"), infkv::error);
  const lc::session_stats t = off.stats();
  CHECK(t.capture == 0);
  CHECK(t.append == 0);
  CHECK(t.decode > 0);
  CHECK(t.decodes == 1);
  CHECK(t.decoded_tokens == 40);
  CHECK(t.evictions == 1);
  CHECK(t.seq_rm > 0);
  CHECK(t.seq_add > 0);
  CHECK(t.rerotate == 0);  // no host copies to turn

  lc::session on(model.get(), {.window = 8});
  auto ctx2 = bound_context(model.get(), on);
  REQUIRE(on.decode(random_tokens(40, 22)) == 0);
  on.evict(infkv::snapkv{.window = 8}, {.capacity = 24, .sinks = 2});
  for (llama_token tok : {5, 6, 7}) REQUIRE(on.decode(std::vector<llama_token>{tok}) == 0);
  const lc::session_stats u = on.stats();
  CHECK(u.capture > 0);
  CHECK(u.capture < u.decode);
  CHECK(u.append > 0);
  CHECK(u.score > 0);
  CHECK(u.rerotate > 0);
  CHECK(u.host_evict > 0);
  CHECK(u.decodes == 4);
  CHECK(u.decoded_tokens == 43);
  CHECK(u.evictions == 1);
  CHECK(u.overhead() == doctest::Approx(u.append + u.score + u.seq_rm + u.seq_add + u.host_evict + u.rerotate));
  on.reset_stats();
  CHECK(on.stats().decodes == 0);
  CHECK(on.stats().decode == 0);
}

TEST_CASE("llama session: the README's llama.cpp snippet runs and bounds the cache") {
  auto owned = tiny_model(2);
  llama_model* model = owned.get();
  const std::vector<llama_token> block_tokens = random_tokens(1100, 21);
  // example-begin llama
  const auto policy = infkv::inf_mllm{.window = 32, .bias = {.beta = 8, .unit = infkv::age_unit::ranks}};
  infkv::llama_cpp::session s(model, infkv::llama_cpp::session_options::for_policy(policy));
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 1024 + 128;  // budget + block
  s.attach(cp);           // routes cb_eval to the session
  llama_context* ctx = llama_init_from_model(model, cp);
  s.bind(ctx);
  s.decode(block_tokens);  // bookkeeping grows only on success
  s.evict(policy, {.capacity = 1024, .sinks = 4, .recent = 32});
  // example-end
  const context_ptr owns(ctx);
  CHECK(s.size() == 1024);
  CHECK(s.options().window == 32);
  check_memory_matches(s);
}

TEST_CASE("llama session: more than one thread runs on a pool the session keeps, or on one it is lent") {
  auto model = tiny_model(2);
  lc::session own(model.get(), {.executor = {.threads = 2}});
  REQUIRE(own.options().executor.pool != nullptr);  // created once, for the session's whole life
  CHECK(own.options().executor.pool->size() == 2);
  const infkv::cpu::worker_pool* first = own.options().executor.pool;
  auto ctx = bound_context(model.get(), own);
  for (int round = 0; round < 3; ++round) {
    REQUIRE(own.decode(random_tokens(20, 30 + unsigned(round))) == 0);
    own.evict(infkv::snapkv{.window = 8}, {.capacity = 24, .sinks = 2});
    CHECK(own.options().executor.pool == first);
  }
  infkv::cpu::thread_pool engine(3);
  lc::session lent(model.get(), {.executor = {.threads = 3, .pool = &engine}});
  CHECK(lent.options().executor.pool == &engine);
  lc::session one(model.get());
  CHECK(one.options().executor.pool == nullptr);  // one thread: the caller's
  infkv::cpu::thread_pool small(2);
  CHECK_THROWS_WITH_AS(lc::session(model.get(), {.executor = {.threads = 3, .pool = &small}}),
                       doctest::Contains("executor.threads = 3"), infkv::invalid_argument);
}

TEST_CASE("llama session: key copies in the cache's own type, allocated once, memory() counts what is held") {
  auto model = tiny_model(2);  // 2 layers, 2 KV heads, head_dim 16, 4 query heads
  const std::int64_t n_ctx = 256, layers = 2, row = 2 * 16;
  SUBCASE("an f16 cache: f16 keys, half of llama.cpp's K and V") {
    lc::session s(model.get(),
                  lc::session_options::for_policy(infkv::snapkv{.window = 8}, {.keys = lc::key_source::copy}));
    auto ctx = bound_context(model.get(), s, {.type_k = GGML_TYPE_F16});
    CHECK(s.key_type() == infkv::dtype::f16);
    REQUIRE(s.decode(random_tokens(100, 40)) == 0);  // of its 100 queries only the last 8 are kept
    const auto m = s.memory();
    CHECK(m.kv == n_ctx * layers * row * 2 * 2);
    CHECK(m.keys == n_ctx * layers * row * 2);  // room for every cell, once
    CHECK(m.keys * 2 == m.kv);
    CHECK(m.values == 0);
    CHECK(m.h2o == 0);
    CHECK(m.queries <= layers * (8 + 8) * 4 * 16 * 4 + layers * 16 * 4);  // window, kept rows of the batch, a row
    CHECK(s.inputs(1).queries.n_slots == 8);
    for (int round = 0; round < 3; ++round) {
      s.evict(infkv::snapkv{.window = 8}, {.capacity = 60, .sinks = 2});
      REQUIRE(s.decode(random_tokens(50, 41 + unsigned(round))) == 0);
      CHECK(s.memory().keys == m.keys);  // the storage never grows or moves
    }
    CHECK(s.memory().workspace > 0);
    CHECK(s.keys() == lc::key_source::copy);
  }
  SUBCASE("reading llama.cpp's cache instead: no copies, each cached token's cell") {
    lc::session s(model.get(), lc::session_options::for_policy(infkv::snapkv{.window = 8}));
    auto ctx = bound_context(model.get(), s, {.type_k = GGML_TYPE_F16});
    REQUIRE(s.decode(random_tokens(100, 40)) == 0);
    CHECK(s.keys() == lc::key_source::engine);
    const auto m = s.memory();
    CHECK(m.keys == 0);
    CHECK(m.values == 0);
    CHECK(m.tokens >= 100 * 4);
    CHECK(s.inputs(1).keys.type == infkv::dtype::f16);
    CHECK(s.inputs(1).keys.n_slots == 100);
  }
  SUBCASE("an f32 cache keeps f32 keys; a session can ask for f16 ones") {
    lc::session f32(model.get(), {.keys = lc::key_source::copy});
    auto c32 = bound_context(model.get(), f32);
    CHECK(f32.key_type() == infkv::dtype::f32);
    lc::session f16(model.get(), {.key_type = infkv::dtype::f16, .values = true});
    auto c16 = bound_context(model.get(), f16);
    CHECK(f16.key_type() == infkv::dtype::f16);
    REQUIRE(f32.decode(random_tokens(30, 42)) == 0);
    REQUIRE(f16.decode(random_tokens(30, 42)) == 0);
    CHECK(f32.memory().keys == n_ctx * layers * row * 4);
    CHECK(f16.memory().keys == n_ctx * layers * row * 2);
    CHECK(f16.memory().values == f16.memory().keys);
    // The same keys, rounded to f16 (what the copy from the graph's f32 rows gives).
    const auto a = f32.inputs(1).keys, b = f16.inputs(1).keys;
    float worst = 0;
    for (std::int64_t j = 0; j < 30; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 16; ++e) {
          const float x = static_cast<const float*>(a.row(j, h))[e];
          const float y = infkv::f16_to_f32(static_cast<const std::uint16_t*>(b.row(j, h))[e]);
          worst = std::max(worst, std::fabs(x - y) / std::max(std::fabs(x), 1e-3f));
        }
    CHECK(worst <= 1.f / 1024);
  }
}
