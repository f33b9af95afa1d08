// llama.cpp adapter: budgeted block-wise prefill of mixed text and image / video-frame embedding
// chunks: the cache bound after every block, blocks at chunk boundaries, segments and modalities
// on the cached tokens, the segment-aged bias, embeddings equal to token ids.
#include "llama_fixture.hpp"

#include <gguf.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <set>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

constexpr int n_embd = 64;

/// Text, then `n_frames` video frames of `per_frame` random embedding rows with a short text
/// every 4 frames, then a closing text. Owns the data its chunks point into.
struct mixed_stream {
  std::vector<std::vector<llama_token>> texts;
  std::vector<std::vector<float>> frames;
  std::vector<lc::chunk> chunks;
  std::vector<std::int64_t> start;  // input index of each chunk's first token, and the total

  mixed_stream(int n_frames, int per_frame, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<char> kinds;  // 't' or 'v', in stream order
    texts.push_back(random_tokens(16, seed + 1));
    kinds.push_back('t');
    for (int f = 0; f < n_frames; ++f) {
      if (f > 0 && f % 4 == 0) texts.push_back(random_tokens(4, seed + 2 + unsigned(f))), kinds.push_back('t');
      frames.emplace_back(std::size_t(per_frame * n_embd));
      for (auto& x : frames.back()) x = d(rng);
      kinds.push_back('v');
    }
    texts.push_back(random_tokens(8, seed + 100));
    kinds.push_back('t');
    std::size_t t = 0, v = 0;
    for (char k : kinds)
      chunks.push_back(k == 't' ? lc::text_chunk(texts[t++])
                                : lc::embd_chunk(frames[v++], per_frame, infkv::modality::video));
    start.push_back(0);
    for (const auto& c : chunks) start.push_back(start.back() + c.size());
  }
  std::int64_t n_input() const { return start.back(); }
};

/// Every block ends at a chunk boundary unless no boundary lies inside it and it is full; every
/// chunk that fits a block lies inside one block.
void check_blocks_follow_chunks(const std::vector<infkv::block_range>& blocks, const mixed_stream& in,
                                std::int64_t block, std::int64_t first_limit) {
  const std::set<std::int64_t> bounds(in.start.begin(), in.start.end());
  REQUIRE(!blocks.empty());
  CHECK(blocks.front().begin == 0);
  CHECK(blocks.back().end == in.n_input());
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    const auto r = blocks[k];
    if (k > 0) CHECK(r.begin == blocks[k - 1].end);
    const std::int64_t limit = k == 0 ? first_limit : block;
    CHECK(r.end - r.begin <= limit);
    if (!bounds.count(r.end)) {
      CHECK(r.end - r.begin == limit);
      CHECK(bounds.upper_bound(r.begin) == bounds.lower_bound(r.end));  // no boundary inside
    }
  }
  for (std::size_t c = 0; c + 1 < in.start.size(); ++c) {
    if (in.start[c + 1] - in.start[c] > block) continue;
    CHECK(std::ranges::any_of(
        blocks, [&](const infkv::block_range& r) { return r.begin <= in.start[c] && in.start[c + 1] <= r.end; }));
  }
}

/// Cached tokens carry the segment and modality of the chunk they came from, in time order;
/// tokens older than the stream have older segments.
void check_segments(const lc::session& s, const mixed_stream& in, std::int32_t first_segment) {
  const auto order = infkv::time_order(s.tokens());
  std::int32_t prev = -1;
  for (auto slot : order) {
    const auto& t = s.tokens()[std::size_t(slot)];
    const std::int64_t c = t.segment - first_segment;
    REQUIRE(c < std::int64_t(in.chunks.size()));
    if (c >= 0) CHECK(t.kind == in.chunks[std::size_t(c)].kind);
    CHECK(t.segment >= prev);
    prev = t.segment;
  }
}

/// Prefills `in` with `p` (budget 96, block 24) and checks the cache after every block.
template <class P>
lc::prefill_result run_checked(lc::session& s, const mixed_stream& in, const P& p, std::int64_t sinks = 2) {
  const infkv::block_prefill sched{.block = 24, .budget = 96};
  std::vector<lc::block_report> reports;
  const std::int64_t before = s.size();
  const auto res = lc::prefill(s, in.chunks, p, sched, {.sinks = sinks, .on_block = [&](const lc::block_report& r) {
                                                          CHECK(r.decoded <= sched.peak());
                                                          CHECK(s.size() <= sched.budget);
                                                          if (r.decoded > sched.budget)
                                                            CHECK(r.eviction.evicted == r.decoded - sched.budget);
                                                          check_memory_matches(s);
                                                          reports.push_back(r);
                                                        }});
  REQUIRE(res.ok());
  CHECK(res.blocks_done == std::int64_t(res.blocks.size()));
  REQUIRE(reports.size() == res.blocks.size());
  std::int64_t peak = before, evicted = 0;
  for (std::size_t k = 0; k < reports.size(); ++k) {
    CHECK(reports[k].index == std::int64_t(k));
    CHECK(reports[k].range == res.blocks[k]);
    peak = std::max(peak, reports[k].decoded);
    evicted += reports[k].eviction.evicted;
  }
  CHECK(res.peak == peak);
  CHECK(res.peak <= sched.peak());
  CHECK(res.peak > sched.budget);
  CHECK(res.evicted == evicted);
  CHECK(res.decoded == in.n_input());
  CHECK(before + res.decoded - res.evicted == s.size());
  CHECK(s.size() == sched.budget);
  check_blocks_follow_chunks(res.blocks, in, sched.block, before == 0 ? sched.budget : sched.block);
  check_segments(s, in, res.first_segment);
  return res;
}

}  // namespace

TEST_CASE("llama prefill: text and video frames stay within budget + block with every policy") {
  auto model = tiny_model(2);
  const mixed_stream in(12, 24, 3);
  REQUIRE(in.chunks.size() == 16);
  REQUIRE(in.n_input() == 16 + 12 * 24 + 2 * 4 + 8);
  std::set<std::int32_t> segments_kept;
  const auto run = [&](auto policy, lc::session_options so) {
    lc::session s(model.get(), so);
    auto ctx = bound_context(model.get(), s, {.n_ctx = 128, .n_ubatch = 32});
    const auto res = run_checked(s, in, policy);
    CHECK(res.first_segment == 0);
    // The first block takes the text and the frames that fit the budget: 16 + 3 * 24 tokens.
    CHECK(res.blocks.front() == infkv::block_range{0, 88});
    for (const auto& t : s.tokens()) segments_kept.insert(t.segment);
    // A second stream continues the segments and plans its first block of `block` tokens.
    const mixed_stream more(2, 24, 9);
    const auto again = run_checked(s, more, policy);
    CHECK(again.first_segment > *std::max_element(segments_kept.begin(), segments_kept.end()));
    CHECK(again.first_segment <= 16);
    CHECK(again.blocks.front() == infkv::block_range{0, 16});
  };
  SUBCASE("inf_mllm, segment-aged bias") {
    run(infkv::inf_mllm{.window = 16, .bias = {.beta = 0.5, .unit = infkv::age_unit::segments}}, {.window = 16});
  }
  SUBCASE("snapkv, keep mode") { run(infkv::snapkv{.window = 8}, {.window = 8, .positions = lc::position_mode::keep}); }
  SUBCASE("keydiff, f16 keys") { run(infkv::keydiff{}, {.key_type = infkv::dtype::f16}); }
  SUBCASE("h2o, scores accumulated over every decode") {
    run(infkv::h2o{}, lc::session_options::for_policy(infkv::h2o{}));
  }
  SUBCASE("streaming_llm") {
    run(infkv::streaming_llm{}, {});
    // Sinks and the newest 94 tokens: the closing text, frames 11..9 and part of frame 8.
    CHECK(segments_kept == std::set<std::int32_t>{0, 11, 12, 13, 14, 15});
  }
}

TEST_CASE("llama prefill: the segment-aged bias makes old frames leave first") {
  auto model = tiny_model(2);
  const mixed_stream in(12, 24, 5);
  const auto kept_segments = [&](double beta) {
    lc::session s(model.get(), {.window = 16, .positions = lc::position_mode::keep});
    auto ctx = bound_context(model.get(), s, {.n_ctx = 128, .n_ubatch = 32});
    const infkv::inf_mllm p{.window = 16, .bias = {.beta = beta, .unit = infkv::age_unit::segments}};
    run_checked(s, in, p, 4);
    std::map<std::int32_t, std::int64_t> count;  // segment -> kept tokens, sinks (positions 0..3) aside
    for (const auto& t : s.tokens())
      if (t.pos >= 4) ++count[t.segment];
    return count;
  };
  const auto plain = kept_segments(0.0), biased = kept_segments(1e4);
  // With a dominant bias the cache past its sinks is the newest segments, whole, and part of
  // the one before them: nothing older survives.
  REQUIRE(!biased.empty());
  const std::int32_t oldest = biased.begin()->first;
  for (const auto& [seg, n] : biased) {
    const auto size = in.chunks[std::size_t(seg)].size();
    CHECK(n <= size);
    if (seg != oldest) CHECK(n == size);
  }
  CHECK(biased.rbegin()->first == 15);
  // Without bias the choice follows attention: tokens of frames older than that stay.
  REQUIRE(!plain.empty());
  CHECK(plain.begin()->first < oldest);
  std::int64_t n_plain_old = 0;
  for (const auto& [seg, n] : plain)
    if (seg < oldest) n_plain_old += n;
  CHECK(n_plain_old > 0);
}

namespace {

/// Rows of the tiny model's token embedding matrix, read from its GGUF file.
std::vector<float> token_embeddings(int layers) {
  const std::string path = std::string(INFKV_TEST_MODEL_DIR) + "/tiny-llama-" + std::to_string(layers) + ".gguf";
  gguf_context* g = gguf_init_from_file(path.c_str(), {.no_alloc = true, .ctx = nullptr});
  REQUIRE(g != nullptr);
  const std::int64_t id = gguf_find_tensor(g, "token_embd.weight");
  REQUIRE(id >= 0);
  REQUIRE(gguf_get_tensor_type(g, id) == GGML_TYPE_F32);
  std::vector<float> w(gguf_get_tensor_size(g, id) / sizeof(float));
  const std::size_t offset = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id);
  gguf_free(g);
  REQUIRE(w.size() == std::size_t(128 * n_embd));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(f != nullptr);
  const bool ok =
      std::fseek(f, long(offset), SEEK_SET) == 0 && std::fread(w.data(), sizeof(float), w.size(), f) == w.size();
  std::fclose(f);
  REQUIRE(ok);
  return w;
}

std::vector<float> rows_of(const std::vector<float>& table, const std::vector<llama_token>& toks) {
  std::vector<float> out;
  for (auto t : toks) out.insert(out.end(), table.begin() + t * n_embd, table.begin() + (t + 1) * n_embd);
  return out;
}

}  // namespace

TEST_CASE("llama prefill: embedding rows of token ids decode like the token ids") {
  auto model = tiny_model(2);
  const auto table = token_embeddings(2);
  const auto a = random_tokens(16, 21), b = random_tokens(16, 22), c = random_tokens(16, 23);
  std::vector<llama_token> all = a;
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  const auto b_rows = rows_of(table, b);
  const std::vector<lc::chunk> mixed{lc::text_chunk(a), lc::embd_chunk(b_rows, 16, infkv::modality::image),
                                     lc::text_chunk(c)};
  const std::vector<lc::chunk> plain{lc::text_chunk(all)};
  // Blocks of 8 after a first block of 32: the same cut for one chunk and for three of 16.
  const infkv::block_prefill sched{.block = 8, .budget = 32};
  lc::session s1(model.get()), s2(model.get());
  auto c1 = bound_context(model.get(), s1), c2 = bound_context(model.get(), s2);
  const auto r1 = lc::prefill(s1, mixed, infkv::streaming_llm{}, sched, {.sinks = 4});
  const auto r2 = lc::prefill(s2, plain, infkv::streaming_llm{}, sched, {.sinks = 4});
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  CHECK(r1.blocks == r2.blocks);
  CHECK(r1.blocks.size() == 3);
  CHECK(r1.evicted == 16);
  CHECK(s1.size() == 32);
  const auto l1 = last_logits(c1.get()), l2 = last_logits(c2.get());
  float mag = 0.f;
  for (float x : l2) mag = std::max(mag, std::fabs(x));
  CHECK(mag > 0.1f);
  CHECK(max_abs_diff(l1, l2) <= 1e-4f * mag);
  // The embedding chunk's tokens are marked image, the others text; positions are the same.
  for (std::size_t i = 0; i < 32; ++i) {
    CHECK(s1.tokens()[i].pos == s2.tokens()[i].pos);
    CHECK(s1.tokens()[i].kind == (s1.tokens()[i].segment == 1 ? infkv::modality::image : infkv::modality::text));
  }
  // Split into blocks of 4 without eviction, the rows still decode like the token ids.
  lc::session s3(model.get()), s4(model.get());
  auto c3 = bound_context(model.get(), s3), c4 = bound_context(model.get(), s4);
  const std::vector<lc::chunk> e{lc::embd_chunk(b_rows, 16, infkv::modality::image)}, t{lc::text_chunk(b)};
  const infkv::block_prefill fours{.block = 4, .budget = 64, .first_block_fills_budget = false};
  const auto r3 = lc::prefill(s3, e, infkv::keydiff{}, fours);
  REQUIRE(r3.ok());
  CHECK(r3.blocks.size() == 4);
  CHECK(r3.evicted == 0);
  REQUIRE(lc::prefill(s4, t, infkv::keydiff{}, fours).ok());
  CHECK(max_abs_diff(last_logits(c3.get()), last_logits(c4.get())) <= 1e-4f * mag);
}
