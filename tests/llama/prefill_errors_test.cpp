// llama.cpp adapter: block-wise prefill with explicit positions, invalid arguments reported
// before anything is decoded, and a failing llama_decode stopping the prefill with the session
// and the llama memory in agreement.
#include "llama_fixture.hpp"

#include <algorithm>
#include <random>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

std::vector<float> random_rows(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n * 64);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace

TEST_CASE("llama prefill: explicit positions in keep mode, and the chunk after them") {
  auto model = tiny_model(1);
  lc::session s(model.get(), {.positions = lc::position_mode::keep});
  auto ctx = bound_context(model.get(), s);
  const auto t0 = random_tokens(10, 31), t2 = random_tokens(4, 32);
  const auto rows = random_rows(6, 33);
  const std::vector<llama_pos> pos{10, 11, 12, 13, 14, 15};
  const std::vector<lc::chunk> in{lc::text_chunk(t0), lc::embd_chunk(rows, 6, infkv::modality::image, pos, 6),
                                  lc::text_chunk(t2)};
  const auto r = lc::prefill(s, in, infkv::keydiff{}, {.block = 8, .budget = 64});
  REQUIRE(r.ok());
  REQUIRE(s.size() == 20);
  for (std::int64_t i = 0; i < 20; ++i) CHECK(s.tokens()[std::size_t(i)].pos == i);
  CHECK(s.tokens()[12].kind == infkv::modality::image);
  CHECK(s.tokens()[12].segment == 1);
  CHECK(s.tokens()[19].segment == 2);
  check_memory_matches(s);

  // n_pos past the chunk's own positions moves the next chunk on; this llama model wants
  // consecutive positions (M-RoPE models accept the jump), so its decode fails and stops.
  const std::vector<llama_pos> pos2{20, 21, 22, 23, 24, 25};
  const std::vector<lc::chunk> jump{lc::embd_chunk(rows, 6, infkv::modality::image, pos2, 10), lc::text_chunk(t2),
                                    lc::text_chunk(t0)};
  const auto j = lc::prefill(s, jump, infkv::keydiff{}, {.block = 8, .budget = 64});
  CHECK(j.status != 0);
  CHECK(j.failed_chunk == 1);
  CHECK(j.failed_block == 1);  // blocks [0, 6) and [6, 10): the session held tokens, so 8 at most
  CHECK(j.blocks_done == 1);
  CHECK(j.decoded == 6);
  CHECK(j.first_segment == 3);
  CHECK(s.size() == 26);
  CHECK(s.tokens().back().pos == 25);
  CHECK(s.next_pos() == 30);  // the image's n_pos stays reserved for the next prefill
  check_memory_matches(s);

  lc::session compact(model.get());
  auto cctx = bound_context(model.get(), compact);
  CHECK_THROWS_WITH_AS(compact.reserve_positions(5), doctest::Contains("position_mode::keep"), infkv::error);
  CHECK_THROWS_WITH_AS(s.reserve_positions(-1), doctest::Contains("end = -1"), infkv::error);
}

TEST_CASE("llama prefill: a failing decode stops the prefill and leaves the session consistent") {
  auto model = tiny_model(2);
  lc::session s(model.get());
  auto ctx = bound_context(model.get(), s, {.n_ctx = 128, .n_ubatch = 16});
  std::vector<std::vector<llama_token>> texts;
  std::vector<std::vector<float>> frames;
  for (int i = 0; i < 8; ++i)
    texts.push_back(random_tokens(6, 40 + unsigned(i))), frames.push_back(random_rows(20, 50 + unsigned(i)));
  texts[5][2] = 100000;  // outside the vocabulary: llama_decode refuses the batch
  std::vector<lc::chunk> in;
  for (int i = 0; i < 8; ++i) {
    in.push_back(lc::text_chunk(texts[std::size_t(i)]));
    in.push_back(lc::embd_chunk(frames[std::size_t(i)], 20, infkv::modality::video));
  }
  // Chunk 10 is texts[5]; blocks after the first hold one text or one frame each.
  const infkv::block_prefill sched{.block = 20, .budget = 40};
  std::int64_t blocks_seen = 0;
  const auto r =
      lc::prefill(s, in, infkv::inf_mllm{.window = 16, .bias = {.beta = 0.3, .unit = infkv::age_unit::segments}}, sched,
                  {.sinks = 2, .on_block = [&](const lc::block_report&) { ++blocks_seen; }});
  CHECK(r.status != 0);
  CHECK_FALSE(r.ok());
  CHECK(r.failed_chunk == 10);
  REQUIRE(r.failed_block >= 0);
  const auto fb = r.blocks[std::size_t(r.failed_block)];
  CHECK(fb.begin <= 5 * 26);
  CHECK(5 * 26 < fb.end);
  CHECK(r.blocks_done == r.failed_block);
  CHECK(blocks_seen == r.failed_block);
  CHECK(r.decoded == 5 * 26);
  CHECK(s.size() <= sched.peak());
  check_memory_matches(s);
  std::int32_t last_segment = -1;
  for (const auto& t : s.tokens()) last_segment = std::max(last_segment, t.segment);
  CHECK(last_segment < 10);

  // Fixed, the rest goes in after what is cached, with the segments continuing.
  texts[5][2] = 7;
  const auto rest = lc::prefill(s, std::span(in).subspan(10), infkv::inf_mllm{.window = 16}, sched, {.sinks = 2});
  REQUIRE(rest.ok());
  CHECK(rest.first_segment == last_segment + 1);
  CHECK(rest.decoded == 3 * 26);
  CHECK(s.size() == 40);
  check_memory_matches(s);
  check_room(s);  // the engine holds exactly the session's cells
}

TEST_CASE("llama prefill: invalid arguments are reported before anything is decoded") {
  auto model = tiny_model(1);
  const auto toks = random_tokens(8, 60);
  const auto rows = random_rows(2, 61);
  const infkv::block_prefill sched{.block = 8, .budget = 32};
  lc::session unbound(model.get());
  const std::vector<lc::chunk> ok{lc::text_chunk(toks)};
  CHECK_THROWS_WITH_AS(lc::prefill(unbound, ok, infkv::keydiff{}, sched), doctest::Contains("ctx = null"),
                       infkv::error);

  lc::session s(model.get(), {.window = 8});
  auto ctx = bound_context(model.get(), s, {.n_ctx = 256, .n_ubatch = 16});
  const auto fails = [&](const std::vector<lc::chunk>& in, const infkv::block_prefill& b, const char* what,
                         const lc::prefill_options& o = {}) {
    CHECK_THROWS_WITH_AS(lc::prefill(s, in, infkv::keydiff{}, b, o), doctest::Contains(what), infkv::error);
  };
  fails({lc::text_chunk(toks), lc::text_chunk({})}, sched, "chunks[1].size() = 0");
  fails({lc::embd_chunk(std::span(rows).first(127), 2, infkv::modality::image)}, sched, "chunks[0].embd.size() = 127");
  fails({lc::embd_chunk(rows, 3, infkv::modality::video)}, sched, "n_tokens (3) * llama_model_n_embd_inp (64)");
  fails({lc::chunk{.tokens = toks, .embd = rows}}, sched, "chunks[0].embd.size() = 128");
  fails({lc::chunk{.tokens = toks, .n_tokens = 3}}, sched, "chunks[0].n_tokens = 3");
  const std::vector<llama_pos> pos{0, 1, 2};
  fails({lc::embd_chunk(rows, 2, infkv::modality::image, pos)}, sched, "position_mode::keep");
  fails({lc::chunk{.tokens = toks, .n_pos = 4}}, sched, "chunks[0].n_pos = 4");
  fails(ok, {.block = 0}, "block_prefill.block = 0");
  fails(ok, {.block = 8, .budget = 250}, "llama_n_ctx(ctx) = 256");
  fails(ok, sched, "block_prefill.budget = 32: cannot hold", {.sinks = 30, .recent = 3});
  fails(ok, sched, "prefill_options.sinks = -1", {.sinks = -1});
  const auto many = random_tokens(20, 62);
  fails({lc::chunk{.tokens = many, .non_causal = true}}, sched, "chunks[0].size() = 20");
  CHECK_THROWS_WITH_AS(lc::prefill(s, ok, infkv::snapkv{.window = 8}, {.block = 8, .budget = 6}),
                       doctest::Contains("block_prefill.budget = 6"), infkv::error);
  CHECK_THROWS_WITH_AS(lc::prefill(s, ok, infkv::snapkv{.window = 16}, sched), doctest::Contains("snapkv.window = 16"),
                       infkv::error);
  // H2O needs a session that accumulates its scores at every decode.
  CHECK_THROWS_WITH_AS(lc::prefill(s, ok, infkv::h2o{}, sched), doctest::Contains("session_options.track_h2o = unset"),
                       infkv::error);
  CHECK(s.size() == 0);
  check_memory_matches(s);

  lc::session k(model.get(), {.positions = lc::position_mode::keep});
  auto kctx = bound_context(model.get(), k);
  const std::vector<lc::chunk> short_pos{lc::embd_chunk(rows, 2, infkv::modality::image, pos)};
  CHECK_THROWS_WITH_AS(lc::prefill(k, short_pos, infkv::keydiff{}, sched),
                       doctest::Contains("chunks[0].positions.size() = 3"), infkv::error);
  const std::vector<llama_pos> neg{0, -1};
  const std::vector<lc::chunk> neg_pos{lc::embd_chunk(rows, 2, infkv::modality::image, neg)};
  CHECK_THROWS_WITH_AS(lc::prefill(k, neg_pos, infkv::keydiff{}, sched),
                       doctest::Contains("chunks[0].positions[1] = -1"), infkv::error);
  CHECK(k.size() == 0);

  // Nothing to prefill: no blocks, nothing decoded.
  const auto none = lc::prefill(s, std::span<const lc::chunk>{}, infkv::keydiff{}, sched);
  CHECK(none.ok());
  CHECK(none.blocks.empty());
  CHECK(s.size() == 0);
}

TEST_CASE("llama prefill: a non-causal chunk attends both ways, and only that chunk does") {
  auto model = tiny_model(2);
  const auto rows = random_rows(8, 70);
  const auto toks = random_tokens(4, 71);
  const infkv::block_prefill sched{.block = 8, .budget = 64};
  const auto run = [&](bool non_causal) {
    lc::session s(model.get());
    auto ctx = bound_context(model.get(), s);
    lc::chunk img = lc::embd_chunk(rows, 8, infkv::modality::image);
    img.non_causal = non_causal;
    const std::vector<lc::chunk> in{img, lc::text_chunk(toks)};
    REQUIRE(lc::prefill(s, in, infkv::keydiff{}, sched).ok());
    REQUIRE(s.decode(std::vector<llama_token>{9}) == 0);
    return last_logits(ctx.get());
  };
  const auto causal = run(false), bidir = run(true);
  CHECK(max_abs_diff(causal, bidir) > 1e-3f);

  // By hand: the image without the causal mask, then the text and the next token with it.
  lc::session s(model.get());
  auto ctx = bound_context(model.get(), s);
  llama_batch b = llama_batch_init(8, 64, 1);
  std::copy(rows.begin(), rows.end(), b.embd);
  for (int i = 0; i < 8; ++i) b.pos[i] = i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = 0;
  b.n_tokens = 8;
  llama_set_causal_attn(ctx.get(), false);
  const int rc = s.decode(b, {.segment = 0, .kind = infkv::modality::image});
  llama_set_causal_attn(ctx.get(), true);
  llama_batch_free(b);
  REQUIRE(rc == 0);
  REQUIRE(s.decode(toks, {.segment = 1}) == 0);
  REQUIRE(s.decode(std::vector<llama_token>{9}) == 0);
  CHECK(max_abs_diff(last_logits(ctx.get()), bidir) <= 1e-4f);
}
