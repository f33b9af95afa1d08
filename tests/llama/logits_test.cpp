// llama.cpp adapter: with one layer, evicting and compacting positions must give the same
// logits as a fresh context fed only the kept tokens (RoPE is relative, K is re-rotated by the
// shift), and the session's own re-rotated key copy must equal the keys a fresh session captures.
#include "llama_fixture.hpp"

#include <algorithm>
#include <map>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

/// Token ids of the kept slots in time order, given the ids by original position and the runs removed.
std::vector<llama_token> kept_ids(const std::map<std::int64_t, llama_token>& by_pos,
                                  const std::vector<infkv::position_run>& removed) {
  std::vector<llama_token> out;
  for (const auto& [p, id] : by_pos)
    if (std::none_of(removed.begin(), removed.end(), [&](const auto& r) { return p >= r.begin && p < r.end; }))
      out.push_back(id);
  return out;
}

/// Largest difference between the keys of two sessions, slots matched by position.
float key_diff(lc::session& a, lc::session& b, int layer) {
  const auto ka = a.inputs(layer), kb = b.inputs(layer);
  REQUIRE(ka.keys.n_slots == kb.keys.n_slots);
  const auto oa = infkv::time_order(a.tokens()), ob = infkv::time_order(b.tokens());
  float m = 0.f;
  for (std::size_t i = 0; i < oa.size(); ++i) {
    REQUIRE(a.tokens()[std::size_t(oa[i])].pos == b.tokens()[std::size_t(ob[i])].pos);
    for (int h = 0; h < ka.keys.n_heads; ++h)
      for (int e = 0; e < ka.keys.head_dim; ++e)
        m = std::max(m, std::fabs(static_cast<const float*>(ka.keys.row(oa[i], h))[e] -
                                  static_cast<const float*>(kb.keys.row(ob[i], h))[e]));
  }
  return m;
}

}  // namespace

TEST_CASE("llama session: one layer, evict + compact equals a fresh context fed the kept tokens") {
  auto model = tiny_model(1);
  bool fa = false;
  SUBCASE("flash attention off") { fa = false; }
  SUBCASE("flash attention on") { fa = true; }
  const ctx_config cfg{.flash_attn = fa};
  lc::session s(model.get());
  auto ctx = bound_context(model.get(), s, cfg);

  std::map<std::int64_t, llama_token> by_pos;  // current position -> token id
  const auto prompt = random_tokens(48, 21);
  REQUIRE(s.decode(prompt) == 0);
  for (std::size_t i = 0; i < prompt.size(); ++i) by_pos[std::int64_t(i)] = prompt[i];

  const auto extra = random_tokens(30, 22);
  std::size_t next = 0;
  for (int round = 0; round < 3; ++round) {
    const auto r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 2});  // scattered selection
    REQUIRE(r.shifted);
    REQUIRE(r.removed.size() >= 2);
    const auto kept = kept_ids(by_pos, r.removed);
    REQUIRE(kept.size() == 20);
    by_pos.clear();
    for (std::size_t i = 0; i < kept.size(); ++i) by_pos[std::int64_t(i)] = kept[i];

    std::vector<llama_token> more(extra.begin() + std::ptrdiff_t(next), extra.begin() + std::ptrdiff_t(next + 5));
    next += 5;
    REQUIRE(s.decode(more) == 0);
    for (std::size_t i = 0; i < more.size(); ++i) by_pos[std::int64_t(20 + i)] = more[i];
    const auto got = last_logits(ctx.get());

    std::vector<llama_token> all = kept;
    all.insert(all.end(), more.begin(), more.end());
    auto fresh_ctx = plain_context(model.get(), cfg);
    REQUIRE(plain_decode(fresh_ctx.get(), all) == 0);
    const auto want = last_logits(fresh_ctx.get());
    float scale = 0.f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    REQUIRE(scale > 0.1f);
    // CPU flash attention rounds through f16 and sums cells in cell order, which differs after
    // removals: it agrees to ~1e-3 relative; the plain path agrees to 1e-4.
    CHECK(max_abs_diff(got, want) < (fa ? 1e-3f : 1e-4f) * std::max(1.f, scale));

    // The session's re-rotated keys equal those a fresh session captures for the same tokens.
    lc::session f(model.get());
    auto fctx = bound_context(model.get(), f, cfg);
    REQUIRE(f.decode(all) == 0);
    CHECK(key_diff(s, f, 0) < 1e-4f);
  }
}

TEST_CASE("llama session: the comparison is sensitive: without the shift the logits differ") {
  auto model = tiny_model(1);
  lc::session s(model.get(), {.positions = lc::position_mode::keep});
  auto ctx = bound_context(model.get(), s);
  const auto prompt = random_tokens(48, 31);
  REQUIRE(s.decode(prompt) == 0);
  const auto r = s.evict(infkv::keydiff{}, {.capacity = 20, .sinks = 2});
  REQUIRE_FALSE(r.shifted);
  std::map<std::int64_t, llama_token> by_pos;
  for (std::size_t i = 0; i < prompt.size(); ++i) by_pos[std::int64_t(i)] = prompt[i];
  auto kept = kept_ids(by_pos, r.removed);
  const std::vector<llama_token> more{5, 6, 7};
  REQUIRE(s.decode(more) == 0);
  kept.insert(kept.end(), more.begin(), more.end());
  auto fresh = plain_context(model.get());
  REQUIRE(plain_decode(fresh.get(), kept) == 0);
  CHECK(max_abs_diff(last_logits(ctx.get()), last_logits(fresh.get())) > 1e-3f);
}

TEST_CASE("llama session: two layers, compaction keeps decoding and the key copy stays exact at layer 0") {
  auto model = tiny_model(2);
  lc::session s(model.get());
  auto ctx = bound_context(model.get(), s);
  const auto prompt = random_tokens(40, 41);
  REQUIRE(s.decode(prompt) == 0);
  std::map<std::int64_t, llama_token> by_pos;
  for (std::size_t i = 0; i < prompt.size(); ++i) by_pos[std::int64_t(i)] = prompt[i];
  const auto r = s.evict(infkv::tova{}, {.capacity = 16, .sinks = 1});
  auto kept = kept_ids(by_pos, r.removed);
  REQUIRE(s.decode(std::vector<llama_token>{9}) == 0);
  kept.push_back(9);
  // Layer 0's keys depend only on each token and its position: a fresh session agrees there.
  lc::session f(model.get());
  auto fctx = bound_context(model.get(), f);
  REQUIRE(f.decode(kept) == 0);
  CHECK(key_diff(s, f, 0) < 1e-4f);
  check_memory_matches(s);
}
