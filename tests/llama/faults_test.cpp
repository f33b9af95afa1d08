// llama.cpp adapter under engine faults: the memory refusing to remove a range (during an
// eviction and during the rollback of a failed decode), a memory that cannot shift, a sequence id
// the context does not have. The refusals are injected through session_options.memory around the
// real llama.cpp calls; after each, the session's bookkeeping must equal the engine's (positions,
// cell count, logits) and the stream must go on where the session promises it can.
#include "llama_fixture.hpp"

#include <algorithm>
#include <map>
#include <set>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

/// llama.h's memory calls, counted; seq_rm refuses its `refuse_at`-th call (1-based; 0: never,
/// -1: always), can_shift answers `shift`.
struct injected {
  int rm_calls = 0, add_calls = 0, refuse_at = 0;
  bool shift = true;
  lc::memory_calls calls() {
    lc::memory_calls c;
    c.seq_rm = [this](llama_memory_t m, llama_seq_id s, llama_pos p0, llama_pos p1) {
      ++rm_calls;
      if (refuse_at == -1 || rm_calls == refuse_at) return false;
      return llama_memory_seq_rm(m, s, p0, p1);
    };
    c.seq_add = [this](llama_memory_t m, llama_seq_id s, llama_pos p0, llama_pos p1, llama_pos d) {
      ++add_calls;
      llama_memory_seq_add(m, s, p0, p1, d);
    };
    c.can_shift = [this](llama_memory_t m) { return shift && llama_memory_can_shift(m); };
    return c;
  }
};

/// The logits after decoding `more` in the session equal a fresh context fed the cached ids and
/// `more` at positions 0, 1, ... (the session must be in compact mode with positions 0..n-1; one
/// layer: deeper layers' keys depend on the evicted tokens, a fresh context's do not).
void check_logits_against_fresh(llama_model* m, lc::session& s, const std::vector<llama_token>& cached,
                                const std::vector<llama_token>& more) {
  REQUIRE(positions(s) == range_set(s.size()));
  REQUIRE(s.decode(more) == 0);
  const auto got = last_logits(s.context());
  std::vector<llama_token> all = cached;
  all.insert(all.end(), more.begin(), more.end());
  auto fresh = plain_context(m);
  REQUIRE(plain_decode(fresh.get(), all) == 0);
  const auto want = last_logits(fresh.get());
  float scale = 0.f;
  for (float v : want) scale = std::max(scale, std::fabs(v));
  REQUIRE(scale > 0.1f);
  CHECK(max_abs_diff(got, want) < 1e-4f * std::max(1.f, scale));
}

}  // namespace

TEST_CASE("llama faults: llama_memory_seq_rm refusing a range mid-eviction leaves the session following the memory") {
  auto model = tiny_model(1);
  injected inj;
  lc::session s(model.get(), {.memory = inj.calls()});
  auto ctx = bound_context(model.get(), s);
  std::map<std::int64_t, llama_token> by_pos;
  const auto first = random_tokens(60, 31);
  REQUIRE(s.decode(first) == 0);
  for (std::size_t i = 0; i < first.size(); ++i) by_pos[std::int64_t(i)] = first[i];

  // Keep every third slot: 20 evicted runs [1, 3), [4, 6), ...; the third removal is refused.
  infkv::keep_set keep(60);
  std::vector<std::int64_t> slots;
  for (std::int64_t i = 0; i < 60; i += 3) slots.push_back(i);
  keep.add_unit(slots);
  inj.refuse_at = 3;
  CHECK_THROWS_WITH_AS(s.apply(keep),
                       doctest::Contains("llama_memory_seq_rm(seq = 0, p0 = 7, p1 = 9) = false: the memory cannot "
                                         "remove part of the sequence; 2 of 20 runs were removed"),
                       infkv::engine_error);
  CHECK(inj.rm_calls == 3);
  CHECK(inj.add_calls == 0);  // no compaction after a failed removal
  std::set<std::int64_t> want;
  for (std::int64_t p = 0; p < 60; ++p)
    if (p != 1 && p != 2 && p != 4 && p != 5) want.insert(p);
  CHECK(positions(s) == want);
  CHECK(s.inputs(0).keys.n_slots == 56);
  check_memory_matches(s);

  // The stream goes on: a decode after the holes, then an eviction that succeeds and compacts.
  const auto second = random_tokens(6, 32);
  REQUIRE(s.decode(second) == 0);
  for (std::size_t i = 0; i < second.size(); ++i) by_pos[60 + std::int64_t(i)] = second[i];
  CHECK(s.tokens().back().pos == 65);
  const auto r = s.evict(infkv::streaming_llm{}, {.capacity = 20, .sinks = 2});
  CHECK(r.kept == 20);
  CHECK(r.shifted);
  std::vector<llama_token> kept = {by_pos.at(0), by_pos.at(3)};  // the two sinks, then the 18 newest
  for (std::int64_t p = 48; p < 66; ++p) kept.push_back(by_pos.at(p));
  check_logits_against_fresh(model.get(), s, kept, random_tokens(4, 33));
  check_room(s);
}

TEST_CASE("llama faults: a refused removal inside budgeted prefill stops it with the session consistent") {
  auto model = tiny_model(1);
  injected inj;
  lc::session s(model.get(), {.memory = inj.calls()});
  auto ctx = bound_context(model.get(), s, {.n_ctx = 128, .n_ubatch = 16});
  std::vector<std::vector<llama_token>> texts;
  std::vector<lc::chunk> in;
  for (int i = 0; i < 6; ++i) texts.push_back(random_tokens(20, 60 + unsigned(i)));
  for (const auto& t : texts) in.push_back(lc::text_chunk(t));
  inj.refuse_at = 2;  // the second eviction's (only) run
  std::int64_t blocks_seen = 0;
  CHECK_THROWS_WITH_AS(lc::prefill(s, in, infkv::streaming_llm{}, {.block = 20, .budget = 40},
                                   {.sinks = 2, .on_block = [&](const lc::block_report&) { ++blocks_seen; }}),
                       doctest::Contains("= false: the memory cannot remove part of the sequence; 0 of 1 runs"),
                       infkv::engine_error);
  CHECK(blocks_seen == 2);  // blocks 1 (no eviction due) and 2 (the first eviction) reported
  CHECK(s.size() == 60);    // 40 kept + block 3 decoded, nothing removed by the refused call
  check_memory_matches(s);
  check_room(s);
}

TEST_CASE("llama faults: the memory refusing to roll back a decode is reported, not hidden") {
  // llama.cpp removes a failed batch itself; the session rolls back a batch it could not capture
  // (here: the context's cb_eval was replaced after attach) and the memory refuses that.
  auto model = tiny_model(1);
  injected inj;
  lc::session s(model.get(), {.memory = inj.calls()});
  auto p = context_params({});
  s.attach(p);
  p.cb_eval = nullptr;
  context_ptr ctx(llama_init_from_model(model.get(), p));
  s.bind(ctx.get());
  inj.refuse_at = -1;
  CHECK_THROWS_WITH_AS(
      s.decode(random_tokens(5, 11)),
      doctest::Contains("llama_memory_seq_rm(seq = 0, p0 = -1, p1 = -1) = false while rolling back a "
                        "decode (infkv: layer 0: cb_eval saw 0 query, 0 key and 0 value rows for 5 tokens"),
      infkv::engine_error);
  CHECK(inj.rm_calls == 1);
  CHECK(s.size() == 0);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 0) == 4);  // what the error says
}

TEST_CASE("llama faults: a memory that cannot shift falls back to keep mode and never shifts") {
  auto model = tiny_model(2);
  injected inj;
  SUBCASE("can_shift false: holes stay, positions go on after the newest") {
    inj.shift = false;
    lc::session s(model.get(), {.memory = inj.calls()});
    auto ctx = bound_context(model.get(), s);
    CHECK(s.mode() == lc::position_mode::keep);
    REQUIRE(s.decode(random_tokens(40, 41)) == 0);
    const auto r = s.evict(infkv::streaming_llm{}, {.capacity = 20, .sinks = 2});
    CHECK_FALSE(r.shifted);
    CHECK(s.tokens().front().pos == 0);
    CHECK(positions(s).count(21) == 0);
    CHECK(positions(s).count(22) == 1);
    REQUIRE(s.decode(random_tokens(5, 42)) == 0);
    CHECK(s.tokens().back().pos == 44);
    CHECK(inj.add_calls == 0);
    check_memory_matches(s);
    check_room(s);
  }
  SUBCASE("can_shift true: the same stream compacts (the counter can see a shift)") {
    lc::session s(model.get(), {.memory = inj.calls()});
    auto ctx = bound_context(model.get(), s);
    CHECK(s.mode() == lc::position_mode::compact);
    REQUIRE(s.decode(random_tokens(40, 41)) == 0);
    CHECK(s.evict(infkv::streaming_llm{}, {.capacity = 20, .sinks = 2}).shifted);
    CHECK(inj.add_calls == 1);
    CHECK(s.tokens().back().pos == 19);
    check_memory_matches(s);
    check_room(s);
  }
}

TEST_CASE("llama faults: calls llama.cpp would end the process on are refused with a clear error") {
  auto model = tiny_model(1);
  SUBCASE("a sequence id beyond the context's n_seq_max (llama_memory_seq_pos_max asserts)") {
    lc::session s(model.get(), {.seq = 3});
    auto p = context_params({});
    s.attach(p);
    context_ptr ctx(llama_init_from_model(model.get(), p));
    REQUIRE(ctx != nullptr);
    CHECK_THROWS_WITH_AS(s.bind(ctx.get()),
                         doctest::Contains("session_options.seq = 3: must be below the context's n_seq_max = 1"),
                         infkv::error);
  }
  SUBCASE("more tokens than n_batch in one decode (llama_decode asserts)") {
    lc::session s(model.get());
    auto ctx = bound_context(model.get(), s, {.n_ctx = 256});
    REQUIRE(s.decode(random_tokens(10, 71)) == 0);
    const auto n_batch = llama_n_batch(ctx.get());
    const std::string want = "batch.n_tokens = " + std::to_string(n_batch + 1) +
                             ": exceeds the context's n_batch = " + std::to_string(n_batch);
    CHECK_THROWS_WITH_AS(s.decode(random_tokens(n_batch + 1, 72)), doctest::Contains(want.c_str()), infkv::error);
    CHECK(s.size() == 10);
    check_memory_matches(s);
    CHECK(s.decode(random_tokens(100, 72)) == 0);
  }
  SUBCASE("memory calls left empty") {
    CHECK_THROWS_WITH_AS(lc::session(model.get(), {.memory = {.seq_rm = {}}}),
                         doctest::Contains("session_options.memory = empty"), infkv::error);
  }
}

TEST_CASE("llama faults: a model file llama.cpp cannot load is named, with llama.cpp's reasons in the error") {
  const std::string good = std::string(INFKV_TEST_MODEL_DIR) + "/tiny-llama-1.gguf";
  const std::string cut = std::string(INFKV_TEST_MODEL_DIR) + "/truncated.gguf";
  {
    std::FILE* in = std::fopen(good.c_str(), "rb");
    std::FILE* out = std::fopen(cut.c_str(), "wb");
    REQUIRE(in != nullptr);
    REQUIRE(out != nullptr);
    char buf[600];
    const std::size_t n = std::fread(buf, 1, sizeof buf, in);
    std::fwrite(buf, 1, n, out);
    std::fclose(in);
    std::fclose(out);
  }
  for (const std::string& path : {cut, std::string(INFKV_TEST_MODEL_DIR) + "/no-such-model.gguf"}) {
    const std::string want = "--model = " + path + ": llama.cpp cannot load it as a GGUF model (llama.cpp: ";
    CHECK_THROWS_WITH_AS(lc::load_model(path, "--model"), doctest::Contains(want.c_str()), infkv::engine_error);
  }
  std::remove(cut.c_str());
  CHECK(lc::load_model(good) != nullptr);  // the collector is off again: a good file still loads
}

TEST_CASE("llama faults: gather_cells refused by llama.cpp moves nothing it cannot follow, and the eviction stands") {
  auto model = tiny_model(1);
  injected inj;
  bool refuse_state = false;
  auto opt = lc::session_options::for_policy(infkv::keydiff{});
  opt.scratch_seq = 1;
  auto plain_opt = opt;
  opt.gather_cells = true;
  opt.memory = inj.calls();
  opt.memory.state_set = [&](llama_context* ctx, const std::uint8_t* src, std::size_t n, llama_seq_id seq) {
    return refuse_state ? std::size_t(0) : llama_state_seq_set_data(ctx, src, n, seq);
  };
  lc::session s(model.get(), opt), plain(model.get(), plain_opt);
  auto ctx = shared_context(model.get(), s, {});
  auto pctx = shared_context(model.get(), plain, {});
  const auto both = [&](const std::vector<llama_token>& t) {
    REQUIRE(s.decode(t) == 0);
    REQUIRE(plain.decode(t) == 0);
  };
  both(random_tokens(60, 41));
  const auto keep_every = [](std::int64_t n, std::int64_t k) {  // the first 2 slots and every k-th after
    infkv::keep_set keep(n);
    std::vector<std::int64_t> slots;
    for (std::int64_t i = 0; i < n; ++i)
      if (i < 2 || i % k != 0) slots.push_back(i);
    keep.add_unit(slots);
    return keep;
  };
  const auto same_logits = [&] {
    both(random_tokens(3, 44));
    const auto want = last_logits(pctx.get());
    float scale = 0.f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    CHECK(max_abs_diff(last_logits(ctx.get()), want) <= 1e-4f * std::max(1.f, scale));
  };

  SUBCASE("llama_state_seq_set_data refused: no cell moves") {
    refuse_state = true;
    CHECK_THROWS_WITH_AS(
        s.apply(keep_every(60, 4)),
        doctest::Contains("the copies were removed again and no cell was moved (the eviction is complete)"),
        infkv::engine_error);
    CHECK(s.stats().gathered == 0);
  }
  SUBCASE("a removal refused mid-move: the cells moved so far are followed") {
    inj.refuse_at = inj.rm_calls + 14 + 1 + 5;  // the eviction's 14 runs, the scratch emptied, the 5th original
    CHECK_THROWS_WITH_AS(
        s.apply(keep_every(60, 4)),
        doctest::Contains("4 of 11 cells were moved and the session follows them (the eviction is complete)"),
        infkv::engine_error);
    CHECK(s.stats().gathered == 0);
  }
  plain.apply(keep_every(60, 4));
  CHECK(positions(s) == positions(plain));  // the eviction stands, compacted as without the fault
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  same_logits();                            // every cell the session names holds the row it names
  refuse_state = false, inj.refuse_at = 0;  // and the stream goes on, gathering again
  s.apply(keep_every(s.size(), 3));
  plain.apply(keep_every(plain.size(), 3));
  CHECK(s.stats().gathered > 0);
  check_memory_matches(s);
  same_logits();
}
