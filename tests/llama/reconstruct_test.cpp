// llama.cpp adapter: context-reconstruction scores (KVzip). session::reconstruct repeats the
// cached tokens in chunks on the scratch sequence; each chunk's scores are checked against a
// float64 reference built from a second session that decodes the same context and then the same
// pass into its own sequence (its key copies and window queries are what the pass computes), with
// the softmax over the sinks, the chunk and the pass's own keys. The eviction keeps the sinks, the
// recent tokens and the best mean scores; the scratch sequence is empty after every call; bad
// options and unknown token ids are refused by name.
#include "llama_fixture.hpp"

#include "../cpu/reference_helpers.hpp"

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

lc::session_options recon_options(std::int64_t window = 0) {
  lc::session_options o;
  o.capture = true;
  o.window = window;
  o.key_type = infkv::dtype::f32;
  o.keys = lc::key_source::copy;
  o.positions = lc::position_mode::keep;
  o.scratch_seq = 1;
  return o;
}

context_ptr two_seq_context(llama_model* m, lc::session& s) {
  return shared_context(m, s, {.n_ctx = 256, .n_ubatch = 16});
}

/// The reference scores of one pass, per layer [kv heads][chunk]: a session decodes `context`, then
/// `pass` in one decode (its window holds the pass's queries); per KV head and chunk slot, the
/// largest float64 softmax probability any query of the head's group gives the slot over the
/// first `sink` slots, the chunk [a, b) and the pass's keys it sees.
std::vector<ref_matrix> reference_pass(llama_model* m, const std::vector<llama_token>& context,
                                       const std::vector<llama_token>& pass, std::int64_t a, std::int64_t b,
                                       std::int64_t sink) {
  lc::session r(m, recon_options(std::int64_t(pass.size())));
  auto ctx = two_seq_context(m, r);
  feed(r, context);
  REQUIRE(r.decode(pass) == 0);
  const auto n = std::int64_t(context.size()), mq = std::int64_t(pass.size());
  std::vector<std::int64_t> keys;  // slots of the softmax: sinks, chunk, pass
  for (std::int64_t j = 0; j < sink; ++j) keys.push_back(j);
  for (std::int64_t j = a; j < b; ++j) keys.push_back(j);
  for (std::int64_t j = n; j < n + mq; ++j) keys.push_back(j);
  std::vector<ref_matrix> out;
  for (std::int32_t l = 0; l < r.n_layers(); ++l) {
    const auto in = r.inputs(l);
    REQUIRE(in.queries.n_slots == mq);
    const std::int32_t hkv = in.keys.n_heads, hq = in.queries.n_heads, g = hq / hkv;
    const std::int64_t d = in.keys.head_dim;
    ref_matrix s(std::size_t(hkv), std::vector<double>(std::size_t(b - a), 0.0));
    for (std::int32_t qh = 0; qh < hq; ++qh)
      for (std::int64_t i = 0; i < mq; ++i) {
        const auto* q = static_cast<const float*>(in.queries.row(i, qh));
        std::vector<double> logit;
        for (const std::int64_t j : keys) {
          if (in.tokens[std::size_t(j)].pos > in.query_pos[std::size_t(i)]) {
            logit.push_back(-std::numeric_limits<double>::infinity());
            continue;
          }
          const auto* k = static_cast<const float*>(in.keys.row(j, qh / g));
          double dot = 0;
          for (std::int64_t e = 0; e < d; ++e) dot += double(q[e]) * double(k[e]);
          logit.push_back(dot / std::sqrt(double(d)));
        }
        const double mx = *std::max_element(logit.begin(), logit.end());
        double sum = 0;
        for (double x : logit) sum += std::exp(x - mx);
        for (std::int64_t c = 0; c < b - a; ++c) {
          const double p = std::exp(logit[std::size_t(sink + c)] - mx) / sum;
          s[std::size_t(qh / g)][std::size_t(c)] = std::max(s[std::size_t(qh / g)][std::size_t(c)], p);
        }
      }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<llama_token> concat(std::initializer_list<std::vector<llama_token>> parts) {
  std::vector<llama_token> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

}  // namespace

TEST_CASE("llama reconstruction: every chunk's scores equal the float64 reference of the same pass") {
  auto model = tiny_model(2);
  const auto context = random_tokens(100, 21);
  lc::reconstruction_options o;
  o.chunk = 64, o.tail = 8, o.sinks = 4;
  o.first_ids = random_tokens(6, 22), o.next_ids = random_tokens(9, 23), o.suffix_ids = {5};

  lc::session s(model.get(), recon_options());
  auto ctx = two_seq_context(model.get(), s);
  feed(s, context);
  const auto before = s.memory();
  const auto scores = s.reconstruct(o);
  REQUIRE(std::int64_t(scores.size()) == s.n_layers());
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);  // the scratch sequence is empty again
  check_memory_matches(s);
  CHECK(s.size() == 100);
  CHECK(s.stats().reconstruct > 0.0);
  CHECK(s.memory().queries <= before.queries);  // the passes' queries are not kept

  // Pass 1: the first prompt, the suffix, slots [0, 64); pass 2: the next prompt, the last 8 of
  // the first chunk, the suffix, slots [64, 100), the 4 sinks attended too.
  const std::vector<llama_token> chunk1(context.begin(), context.begin() + 64),
      chunk2(context.begin() + 64, context.end());
  const std::vector<llama_token> tail(context.begin() + 56, context.begin() + 64);
  const auto ref1 = reference_pass(model.get(), context, concat({o.first_ids, o.suffix_ids, chunk1}), 0, 64, 0);
  const auto ref2 = reference_pass(model.get(), context, concat({o.next_ids, tail, o.suffix_ids, chunk2}), 64, 100, 4);
  double worst = 0, top = 0;
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto& got = scores[std::size_t(l)];
    REQUIRE(got.rows == 2);
    REQUIRE(got.cols == 100);
    for (std::int64_t h = 0; h < got.rows; ++h)
      for (std::int64_t j = 0; j < 100; ++j) {
        const double want = j < 64 ? ref1[std::size_t(l)][std::size_t(h)][std::size_t(j)]
                                   : ref2[std::size_t(l)][std::size_t(h)][std::size_t(j - 64)];
        worst = std::max(worst, std::abs(double(got(h, j)) - want) / std::max(want, 1e-3));
        top = std::max(top, want);
      }
  }
  INFO("largest relative difference " << worst);
  CHECK(worst <= 1e-3);
  CHECK(top > 0.0);
}

TEST_CASE(
    "llama reconstruction: the eviction keeps sinks, recent tokens and the best mean scores, and the stream goes on") {
  auto model = tiny_model(2);
  const auto context = random_tokens(100, 31);
  lc::reconstruction_options o;
  o.chunk = 48, o.first_ids = random_tokens(5, 32), o.next_ids = random_tokens(5, 33), o.suffix_ids = {7};
  lc::session s(model.get(), recon_options());
  auto ctx = two_seq_context(model.get(), s);
  feed(s, context);
  const auto scores = s.reconstruct(o);
  std::vector<double> mean(100, 0.0);
  for (const auto& m : scores)
    for (std::int64_t h = 0; h < m.rows; ++h)
      for (std::int64_t j = 0; j < m.cols; ++j) mean[std::size_t(j)] += m(h, j) / double(m.rows * scores.size());
  const infkv::budget b{.capacity = 40, .sinks = 4, .recent = 8};
  std::set<std::int64_t> want;
  for (std::int64_t j = 0; j < 4; ++j) want.insert(j);
  for (std::int64_t j = 92; j < 100; ++j) want.insert(j);
  std::vector<std::int64_t> rest;
  for (std::int64_t j = 4; j < 92; ++j) rest.push_back(j);
  std::stable_sort(rest.begin(), rest.end(),
                   [&](std::int64_t x, std::int64_t y) { return mean[std::size_t(x)] > mean[std::size_t(y)]; });
  for (std::size_t i = 0; want.size() < 40; ++i) want.insert(rest[i]);
  const auto r = s.evict_reconstructed(b, o);
  CHECK(s.size() == 40);
  CHECK(r.kept == 40);
  CHECK(positions(s) == want);
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  REQUIRE(s.decode(random_tokens(4, 34)) == 0);
  check_memory_matches(s);
  const auto again = s.reconstruct(o);  // the kept slots, repeated again
  CHECK(again[0].cols == 44);
}

TEST_CASE("llama reconstruction: bad options, an empty cache and unknown token ids are refused by name") {
  auto model = tiny_model(2);
  lc::session s(model.get(), recon_options());
  auto ctx = two_seq_context(model.get(), s);
  lc::reconstruction_options o;
  o.first_ids = {3}, o.next_ids = {4}, o.suffix_ids = {5};
  CHECK_THROWS_WITH(s.reconstruct(o), doctest::Contains("size()"));
  feed(s, random_tokens(32, 41));
  o.chunk = 0;
  CHECK_THROWS_WITH(s.reconstruct(o), doctest::Contains("reconstruction_options.chunk"));
  o.chunk = 300;  // a pass of 32 + 2 tokens fits; then a cache nearly as large as the context does not
  CHECK_NOTHROW(s.reconstruct(o));
  o.tail = -1;
  CHECK_THROWS_WITH(s.reconstruct(o), doctest::Contains("reconstruction_options.tail"));
  o.tail = 8;
  feed(s, random_tokens(208, 42));  // 240 cached of 256
  CHECK_THROWS_WITH(s.reconstruct(o), doctest::Contains("does not fit the context"));
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  CHECK(s.size() == 240);

  // Embeddings carry no token ids.
  lc::session e(model.get(), recon_options());
  auto c2 = two_seq_context(model.get(), e);
  const std::int32_t n_embd = llama_model_n_embd(model.get());
  llama_batch batch = llama_batch_init(4, n_embd, 1);
  for (std::int32_t i = 0; i < 4; ++i) {
    for (std::int32_t k = 0; k < n_embd; ++k) batch.embd[i * n_embd + k] = 0.01f * float((i + k) % 7);
    batch.pos[i] = i, batch.n_seq_id[i] = 1, batch.seq_id[i][0] = 0, batch.logits[i] = i == 3;
  }
  batch.n_tokens = 4;
  REQUIRE(e.decode(batch) == 0);
  llama_batch_free(batch);
  CHECK_THROWS_WITH(e.reconstruct(o), doctest::Contains("token id"));
}
