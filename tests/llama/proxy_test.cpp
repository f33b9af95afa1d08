// llama.cpp adapter: evicting against a question known in advance (proxy queries). The queries a
// session scores against are those of the question decoded after the cache (after_cache), or
// decoded alone and turned to the positions after the cache (alone), checked against sessions
// that decode the question themselves and against a float64 rotation; the eviction keeps what the
// float64 SnapKV reference keeps for those queries; block-wise prefill with a question evicts as a
// loop of decodes and proxy evictions does; what cannot work is refused with the reason.
#include "llama_fixture.hpp"

#include "../cpu/reference_helpers.hpp"

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

constexpr std::int64_t context_tokens = 64;

/// A session with the options of `p`, a scratch sequence (1) and f32 keys.
template <class P>
lc::session_options proxy_options(const P& p, lc::position_mode mode = lc::position_mode::compact) {
  auto o = lc::session_options::for_policy(p, {.positions = mode});
  o.scratch_seq = 1;
  return o;
}

ctx_config two_sequences() { return {.n_ctx = 160, .n_ubatch = 16}; }

/// A context with two sequences (the second the scratch one), bound to `s`.
context_ptr scratch_context(llama_model* m, lc::session& s, const ctx_config& c = two_sequences()) {
  return shared_context(m, s, c);
}

/// One layer's queries as floats [n][heads][d].
std::vector<float> floats(const infkv::const_tensor_view& q) {
  REQUIRE(q.type == infkv::dtype::f32);
  std::vector<float> out;
  for (std::int64_t i = 0; i < q.n_slots; ++i)
    for (std::int32_t h = 0; h < q.n_heads; ++h) {
      const auto* r = static_cast<const float*>(q.row(i, h));
      out.insert(out.end(), r, r + q.head_dim);
    }
  return out;
}

void check_near(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(double(got[i]) - double(want[i])));
  CHECK(worst <= tol);
}

/// The slots the float64 reference keeps: SnapKV's scores (ref_snapkv) of every layer of `s` for
/// `queries` (per layer) at `qpos`, the mean over KV heads and layers, then the sinks, the policy's
/// window (recent) and the best of the rest (higher score, then newer position, then lower slot).
std::set<std::int64_t> reference_keep(lc::session& s, const infkv::snapkv& c, const infkv::budget& b,
                                      const std::vector<std::vector<float>>& queries,
                                      const std::vector<std::int64_t>& qpos) {
  const auto toks = s.tokens();
  const auto n = std::int64_t(toks.size());
  std::vector<double> score(std::size_t(n), 0.0);
  std::int64_t rows = 0;
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto in = s.inputs(l);
    REQUIRE(in.keys.type == infkv::dtype::f32);
    problem p;
    p.n = n, p.nq = std::int64_t(qpos.size()), p.hkv = in.keys.n_heads, p.hq = in.queries.n_heads;
    p.d = in.keys.head_dim, p.type = infkv::dtype::f32, p.scale = 1.0 / std::sqrt(double(p.d));
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int32_t h = 0; h < p.hkv; ++h) {
        const auto* r = static_cast<const float*>(in.keys.row(i, h));
        p.k.insert(p.k.end(), r, r + p.d);
      }
    p.q = queries[std::size_t(l)];
    p.tokens.assign(toks.begin(), toks.end());
    p.qpos = qpos;
    const ref_matrix m = ref_snapkv(p, c);
    for (const auto& row : m) {
      for (std::int64_t j = 0; j < n; ++j) score[std::size_t(j)] += row[std::size_t(j)];
      ++rows;
    }
  }
  std::vector<std::int64_t> order = ref_time_order(toks);
  const infkv::budget pb = c.spec().protect(b);
  std::set<std::int64_t> keep;
  for (std::int64_t i = 0; i < n; ++i)
    if (i < pb.sinks || i >= n - pb.recent) keep.insert(order[std::size_t(i)]);
  std::vector<std::int64_t> rest;
  for (std::int64_t j = 0; j < n; ++j)
    if (!keep.contains(j)) rest.push_back(j);
  std::sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t x) {
    if (score[std::size_t(a)] != score[std::size_t(x)]) return score[std::size_t(a)] > score[std::size_t(x)];
    if (toks[std::size_t(a)].pos != toks[std::size_t(x)].pos)
      return toks[std::size_t(a)].pos > toks[std::size_t(x)].pos;
    return a < x;
  });
  for (std::int64_t i = 0; std::int64_t(keep.size()) < b.capacity; ++i) keep.insert(rest[std::size_t(i)]);
  std::set<std::int64_t> pos;
  for (const auto j : keep) pos.insert(toks[std::size_t(j)].pos);
  return pos;
}

}  // namespace

TEST_CASE(
    "llama proxy queries: after_cache is the question decoded after the cache, and the eviction keeps the "
    "float64 reference's slots") {
  auto model = tiny_model(2);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 32, .sinks = 2};
  const auto context = random_tokens(context_tokens, 3), question = random_tokens(8, 4);
  lc::position_mode mode = lc::position_mode::compact;
  SUBCASE("compact positions") {}
  SUBCASE("positions kept") { mode = lc::position_mode::keep; }

  // The reference queries: a session that decodes the question itself, right after the context.
  lc::session asked(model.get(), proxy_options(policy, mode));
  auto c1 = scratch_context(model.get(), asked);
  feed(asked, context);
  REQUIRE(asked.decode(question) == 0);

  lc::session s(model.get(), proxy_options(policy, mode));
  auto c2 = scratch_context(model.get(), s);
  feed(s, context);
  const auto window_keep = [&] {  // what the window's own queries would keep, for contrast
    std::vector<std::vector<float>> q;
    for (std::int32_t l = 0; l < s.n_layers(); ++l) q.push_back(floats(s.inputs(l).queries));
    const auto qp = s.inputs(0).query_pos;
    return reference_keep(s, policy, b, q, {qp.begin(), qp.end()});
  }();
  const auto views = s.proxy(question);
  REQUIRE(std::int64_t(views.size()) == s.n_layers());
  std::vector<std::vector<float>> proxy_q;
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    proxy_q.push_back(floats(views[std::size_t(l)]));
    check_near(proxy_q.back(), floats(asked.inputs(l).queries), 1e-4);
  }
  const std::vector<std::int64_t> qpos(s.proxy_positions().begin(), s.proxy_positions().end());
  CHECK(qpos == std::vector<std::int64_t>(asked.inputs(0).query_pos.begin(), asked.inputs(0).query_pos.end()));
  CHECK(llama_memory_seq_pos_max(llama_get_memory(c2.get()), 1) == -1);  // the scratch sequence is empty again

  const auto want = reference_keep(s, policy, b, proxy_q, qpos);
  CHECK(want != window_keep);  // the question changes the choice, so the test can tell them apart
  const auto before = positions(s);
  const auto r = s.evict(policy, b, question);
  CHECK(s.size() == b.capacity);
  std::set<std::int64_t> kept;  // positions before any compaction
  for (const auto p : before)
    if (std::none_of(r.removed.begin(), r.removed.end(),
                     [&](const auto& run) { return p >= run.begin && p < run.end; }))
      kept.insert(p);
  CHECK(kept == want);
  CHECK(s.stats().proxy > 0.0);
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(c2.get()), 1) == -1);
  REQUIRE(s.decode(random_tokens(4, 5)) == 0);  // the stream goes on
  check_memory_matches(s);
}

TEST_CASE("llama proxy queries: alone is the question decoded by itself, turned to the positions after the cache") {
  auto model = tiny_model(2);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 32, .sinks = 2};
  const auto context = random_tokens(context_tokens, 3), question = random_tokens(8, 4);

  // The question alone, from position 0, in a session of its own.
  lc::session alone(model.get(), proxy_options(policy));
  auto c1 = scratch_context(model.get(), alone);
  REQUIRE(alone.decode(question) == 0);

  lc::session s(model.get(), proxy_options(policy, lc::position_mode::keep));
  auto c2 = scratch_context(model.get(), s);
  feed(s, context);
  const auto& rope = s.layer_rope(0);
  REQUIRE(rope.has_rope);
  REQUIRE(rope.supported);
  const auto check_turned = [&](std::int64_t at) {
    const auto views = s.proxy(question, lc::proxy_mode::alone);
    CHECK(s.proxy_positions()[0] == at);
    for (std::int32_t l = 0; l < s.n_layers(); ++l) {
      const auto base = floats(alone.inputs(l).queries);
      const auto in = alone.inputs(l).queries;
      std::vector<float> want(base.size());
      for (std::int64_t i = 0; i < in.n_slots; ++i) {  // float64 rotation by `at` of each head's row
        const ref_square rot = ref_rotation(s.layer_rope(l).params, in.head_dim, double(at));
        for (std::int32_t h = 0; h < in.n_heads; ++h)
          for (std::int32_t r = 0; r < in.head_dim; ++r) {
            double acc = 0;
            for (std::int32_t c = 0; c < in.head_dim; ++c)
              acc += rot[std::size_t(r) * std::size_t(in.head_dim) + std::size_t(c)] *
                     base[std::size_t((i * in.n_heads + h) * in.head_dim + c)];
            want[std::size_t((i * in.n_heads + h) * in.head_dim + r)] = float(acc);
          }
      }
      check_near(floats(views[std::size_t(l)]), want, 2e-4);
    }
  };
  check_turned(context_tokens);
  s.evict(policy, b, question, lc::proxy_mode::alone);
  CHECK(s.size() == b.capacity);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(c2.get()), 1) == -1);
  feed(s, random_tokens(40, 6));  // later evictions turn the same first pass further
  check_turned(context_tokens + 40);
  s.evict(policy, b, question, lc::proxy_mode::alone);
  check_memory_matches(s);
}

TEST_CASE("llama proxy queries: block-wise prefill with a question evicts as decodes and proxy evictions do") {
  auto model = tiny_model(2);
  const infkv::inf_mllm policy{.window = 8, .bias = {.beta = 0.5}};
  const auto text = random_tokens(150, 8), question = random_tokens(6, 9);
  const infkv::block_prefill schedule{.block = 32, .budget = 48};
  for (const auto proxy : {lc::proxy_mode::after_cache, lc::proxy_mode::alone}) {
    CAPTURE(int(proxy));
    lc::session s(model.get(), proxy_options(policy, lc::position_mode::keep));
    auto c1 = scratch_context(model.get(), s);
    const std::vector<lc::chunk> chunks{lc::text_chunk(text)};
    const auto res = lc::prefill(s, chunks, policy, schedule, {.question = question, .proxy = proxy});
    REQUIRE(res.ok());
    CHECK(res.peak <= schedule.peak());
    CHECK(llama_memory_seq_pos_max(llama_get_memory(c1.get()), 1) == -1);

    lc::session loop(model.get(), proxy_options(policy, lc::position_mode::keep));
    auto c2 = scratch_context(model.get(), loop);
    for (const auto& r : res.blocks) {
      const std::span<const llama_token> block(text.data() + r.begin, std::size_t(r.end - r.begin));
      for (std::size_t i = 0; i < block.size(); i += 16)
        REQUIRE(loop.decode(block.subspan(i, std::min<std::size_t>(16, block.size() - i))) == 0);
      if (loop.size() > schedule.budget) loop.evict(policy, {.capacity = schedule.budget}, question, proxy);
    }
    CHECK(positions(s) == positions(loop));

    lc::session plain(model.get(), proxy_options(policy, lc::position_mode::keep));
    auto c3 = scratch_context(model.get(), plain);
    REQUIRE(lc::prefill(plain, chunks, policy, schedule).ok());
    CHECK(positions(plain) != positions(s));  // without the question it keeps something else
  }
}

TEST_CASE("llama proxy queries: what cannot work is refused, naming the reason") {
  auto model = tiny_model(2);
  const auto question = random_tokens(6, 9);
  SUBCASE("a policy that reads no window queries") {
    lc::session s(model.get(), proxy_options(infkv::keydiff{}));
    auto ctx = scratch_context(model.get(), s);
    feed(s, random_tokens(48, 3));
    CHECK_THROWS_WITH_AS(s.evict(infkv::keydiff{}, {.capacity = 24}, question),
                         doctest::Contains("reads no window queries"), infkv::invalid_argument);
    CHECK(s.size() == 48);
    CHECK_THROWS_WITH_AS(lc::prefill(s, std::vector<lc::chunk>{lc::text_chunk(question)}, infkv::keydiff{},
                                     {.block = 16, .budget = 24}, {.question = question}),
                         doctest::Contains("prefill_options.question.size() = 6"), infkv::invalid_argument);
  }
  SUBCASE("no scratch sequence") {
    lc::session s(model.get(), lc::session_options::for_policy(infkv::snapkv{.window = 8}));
    auto ctx = bound_context(model.get(), s);
    feed(s, random_tokens(48, 3));
    CHECK_THROWS_WITH_AS(s.evict(infkv::snapkv{.window = 8}, {.capacity = 24}, question),
                         doctest::Contains("session_options.scratch_seq = -1"), infkv::invalid_argument);
    CHECK(s.size() == 48);
    check_memory_matches(s);
  }
  SUBCASE("an empty question") {
    lc::session s(model.get(), proxy_options(infkv::snapkv{.window = 8}));
    auto ctx = scratch_context(model.get(), s);
    feed(s, random_tokens(48, 3));
    CHECK_THROWS_WITH_AS(s.evict(infkv::snapkv{.window = 8}, {.capacity = 24}, std::vector<llama_token>{}),
                         doctest::Contains("question.size() = 0"), infkv::invalid_argument);
  }
  SUBCASE("a context without room for the question") {
    lc::session s(model.get(), proxy_options(infkv::snapkv{.window = 8}));
    auto ctx = scratch_context(model.get(), s, {.n_ctx = 256, .n_ubatch = 16});  // llama.cpp rounds n_ctx to 256
    REQUIRE(llama_n_ctx(ctx.get()) == 256);
    CHECK_THROWS_WITH_AS(lc::prefill(s, std::vector<lc::chunk>{lc::text_chunk(random_tokens(100, 3))},
                                     infkv::snapkv{.window = 8}, {.block = 24, .budget = 232}, {.question = question}),
                         doctest::Contains("+ the question's tokens"), infkv::invalid_argument);
    CHECK(s.size() == 0);
  }
}
