// The llama.cpp session's archive: what an eviction removes is read out of llama.cpp's cache
// (llama_state_seq_*) and archived within its quantization bound; recall puts archived rows back
// into llama.cpp's cache at their own positions, exactly as dequantized, and the bookkeeping
// follows llama.cpp through refusals.
#include "llama_fixture.hpp"

#include <map>

#include <infkv/llama_cpp/detail/kv_state.hpp>

using namespace infkv_test;
namespace lc = infkv::llama_cpp;

namespace {

struct setup {
  bool fa = false;
  ggml_type type = GGML_TYPE_F32;
  std::int32_t bits = 8;
};

lc::session_options archive_options(const setup& c) {
  auto o = lc::session_options::for_policy(infkv::snapkv{.window = 8});
  o.key_type = infkv::dtype::f32;
  o.values = true;  // the host copies are the test's reference for what llama.cpp held
  o.positions = lc::position_mode::keep;
  infkv::archive_options a;
  a.page_tokens = 8, a.key_bits = c.bits, a.value_bits = c.bits, a.capacity_bytes = static_cast<std::size_t>(1) << 22;
  o.archive = a;
  o.scratch_seq = 1;
  return o;
}

context_ptr archive_context(llama_model* m, lc::session& s, const setup& c, std::uint32_t seqs = 2) {
  return shared_context(m, s, {.flash_attn = c.fa, .n_ctx = 256, .n_ubatch = 32, .type_k = c.type}, seqs);
}

/// The session's host rows (f32) of every cached position: [layer] -> position -> (K row, V row).
using rows_by_pos = std::vector<std::map<std::int64_t, std::pair<std::vector<float>, std::vector<float>>>>;
rows_by_pos host_rows(lc::session& s) {
  rows_by_pos out(static_cast<std::size_t>(s.n_layers()));
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto in = s.inputs(l);
    const std::int64_t e = std::int64_t(in.keys.n_heads) * in.keys.head_dim;
    for (std::int64_t j = 0; j < s.size(); ++j) {
      std::vector<float> k(static_cast<std::size_t>(e)), v(static_cast<std::size_t>(e));
      for (std::int32_t h = 0; h < in.keys.n_heads; ++h) {
        infkv::to_f32(in.keys.type, in.keys.row(j, h), k.data() + h * in.keys.head_dim, in.keys.head_dim);
        infkv::to_f32(in.values.type, in.values.row(j, h), v.data() + h * in.keys.head_dim, in.keys.head_dim);
      }
      out[static_cast<std::size_t>(l)][s.tokens()[static_cast<std::size_t>(j)].pos] = {k, v};
    }
  }
  return out;
}

/// Every held page's dequantized rows: [layer] -> position -> (K row, V row).
rows_by_pos archived_rows(const infkv::archive& a) {
  const auto& sh = a.shape();
  const std::int64_t e = std::int64_t(sh.kv_heads) * sh.head_dim;
  rows_by_pos out(static_cast<std::size_t>(sh.n_layers));
  for (const auto p : a.held()) {
    const auto t = a.tokens(p);
    const auto n = std::int64_t(t.size());
    std::vector<std::vector<float>> k(static_cast<std::size_t>(sh.n_layers),
                                      std::vector<float>(static_cast<std::size_t>(n * e))),
        v = k;
    std::vector<infkv::kv_view> views;
    for (std::int32_t l = 0; l < sh.n_layers; ++l)
      views.push_back(infkv::contiguous_nhd(k[static_cast<std::size_t>(l)].data(),
                                            v[static_cast<std::size_t>(l)].data(), infkv::dtype::f32, n, sh.kv_heads,
                                            sh.head_dim));
    infkv::cpu::restore(a, p, views, 0);
    for (std::int32_t l = 0; l < sh.n_layers; ++l)
      for (std::int64_t i = 0; i < n; ++i)
        out[static_cast<std::size_t>(l)][t[static_cast<std::size_t>(i)].pos] = {
            std::vector<float>(k[static_cast<std::size_t>(l)].begin() + i * e,
                               k[static_cast<std::size_t>(l)].begin() + (i + 1) * e),
            std::vector<float>(v[static_cast<std::size_t>(l)].begin() + i * e,
                               v[static_cast<std::size_t>(l)].begin() + (i + 1) * e)};
  }
  return out;
}

/// llama.cpp's rows of sequence `seq` by position, read through llama_state_seq_get_data: of a
/// model with one cache, or of an iSWA cache's part `part` (0 global, 1 sliding) whose layers
/// are the model's `part_layers`.
rows_by_pos engine_rows(llama_context* ctx, llama_seq_id seq, std::int32_t layers, std::int64_t e,
                        const std::vector<std::int32_t>& part_layers = {}, std::size_t part = 0) {
  std::vector<std::uint8_t> buf(llama_state_seq_get_size(ctx, seq));
  REQUIRE(llama_state_seq_get_data(ctx, buf.data(), buf.size(), seq) == buf.size());
  const bool two = !part_layers.empty();
  const auto st = lc::detail::parse_kv_states(buf, layers, e, two)[part];
  rows_by_pos out(static_cast<std::size_t>(layers));
  for (std::int64_t c = 0; c < st.cells; ++c) {
    std::int32_t pos;
    std::memcpy(&pos, buf.data() + st.pos_at[static_cast<std::size_t>(c)], 4);
    for (std::int32_t j = 0; j < std::int32_t(st.layers.size()); ++j) {
      std::vector<float> k(static_cast<std::size_t>(e)), v(static_cast<std::size_t>(e));
      infkv::to_f32(st.layers[static_cast<std::size_t>(j)].k_type, buf.data() + st.k_row(j, c), k.data(), e);
      for (std::int64_t i = 0; i < e; ++i)
        infkv::to_f32(st.layers[static_cast<std::size_t>(j)].v_type, buf.data() + st.v_elem(j, c, i), v.data() + i, 1);
      out[static_cast<std::size_t>(two ? part_layers[static_cast<std::size_t>(j)] : j)][pos] = {k, v};
    }
  }
  return out;
}

/// 64 tokens, an eviction to `b`, then 8 tokens more (a "question": their queries choose).
void stream(lc::session& s, const infkv::snapkv& policy, const infkv::budget& b) {
  REQUIRE(s.decode(random_tokens(64, 3)) == 0);
  s.evict(policy, b);
  REQUIRE(s.decode(random_tokens(8, 4)) == 0);
}

float rounded(float x, ggml_type t) { return t == GGML_TYPE_F16 ? infkv::f16_to_f32(infkv::f32_to_f16(x)) : x; }

/// Every head of row `x` (heads of `d`) turned by `by` positions with RoPE `r`, in float64.
std::vector<double> turned(const std::vector<float>& x, std::int32_t d, const infkv::rope& r, std::int64_t by) {
  std::vector<double> y(x.begin(), x.end());
  const std::int32_t dims = r.dims == 0 ? d : r.dims;
  for (std::size_t h0 = 0; h0 < x.size(); h0 += static_cast<std::size_t>(d))
    for (std::int32_t i = 0; i < dims / 2; ++i) {
      const double ang = double(by) * r.freq_scale * std::pow(r.theta, -2.0 * i / dims);
      const std::size_t a = h0 + static_cast<std::size_t>(r.style == infkv::rope_style::normal ? 2 * i : i),
                        b = h0 +
                            static_cast<std::size_t>(r.style == infkv::rope_style::normal ? 2 * i + 1 : i + dims / 2);
      y[a] = x[a] * std::cos(ang) - x[b] * std::sin(ang);
      y[b] = x[a] * std::sin(ang) + x[b] * std::cos(ang);
    }
  return y;
}

}  // namespace

TEST_CASE("llama archive: the stream's rows are read from llama.cpp's cache and archived within the bound") {
  auto model = tiny_model(2);
  setup c;
  SUBCASE("f32 cache, flash attention off (V transposed)") { c = {false, GGML_TYPE_F32, 8}; }
  SUBCASE("f16 cache, flash attention on, 4 bits") { c = {true, GGML_TYPE_F16, 4}; }
  lc::session s(model.get(), archive_options(c));
  auto ctx = archive_context(model.get(), s, c);
  REQUIRE(s.decode(random_tokens(40, 1)) == 0);
  // the parser reads exactly what the session captured from the graph (f32 cache: bit for bit)
  const auto host = host_rows(s);
  const std::int64_t e = std::int64_t(s.inputs(0).keys.n_heads) * s.inputs(0).keys.head_dim;
  const auto engine = engine_rows(ctx.get(), 0, s.n_layers(), e);
  for (std::int32_t l = 0; l < s.n_layers(); ++l)
    for (const auto& [pos, kv] : host[static_cast<std::size_t>(l)]) {
      const auto& got = engine[static_cast<std::size_t>(l)].at(pos);
      for (std::int64_t j = 0; j < e; ++j) {
        CHECK(got.first[static_cast<std::size_t>(j)] == rounded(kv.first[static_cast<std::size_t>(j)], c.type));
        CHECK(got.second[static_cast<std::size_t>(j)] == rounded(kv.second[static_cast<std::size_t>(j)], c.type));
      }
    }
  const auto r = s.evict(infkv::snapkv{.window = 8}, {.capacity = 24, .sinks = 2});
  REQUIRE(r.evicted == 16);
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);  // the scratch sequence is empty
  REQUIRE(s.archive() != nullptr);
  CHECK(s.archive()->held_tokens() == 40);  // written through: every row, before any could leave
  CHECK(s.archive()->held_pages() == 5);
  CHECK(s.memory().archive >= std::int64_t(s.archive()->memory()));
  const auto back = archived_rows(*s.archive());
  const float levels = float((1 << c.bits) - 1);
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    REQUIRE(back[static_cast<std::size_t>(l)].size() == 40);
    // every group's range is within the page's: half a step of the page's range bounds each error
    for (const auto p : s.archive()->held()) {
      float lo = 1e30f, hi = -1e30f;
      for (const auto& t : s.archive()->tokens(p))
        for (const auto& row :
             {host[static_cast<std::size_t>(l)].at(t.pos).first, host[static_cast<std::size_t>(l)].at(t.pos).second})
          for (float x : row) lo = std::min(lo, rounded(x, c.type)), hi = std::max(hi, rounded(x, c.type));
      for (const auto& t : s.archive()->tokens(p)) {
        const auto& want = host[static_cast<std::size_t>(l)].at(t.pos);
        const auto& got = back[static_cast<std::size_t>(l)].at(t.pos);
        for (std::int64_t j = 0; j < e; ++j) {
          CHECK(std::fabs(got.first[static_cast<std::size_t>(j)] -
                          rounded(want.first[static_cast<std::size_t>(j)], c.type)) <=
                (hi - lo) / levels * 0.51f + 1e-3f);
          CHECK(std::fabs(got.second[static_cast<std::size_t>(j)] -
                          rounded(want.second[static_cast<std::size_t>(j)], c.type)) <=
                (hi - lo) / levels * 0.51f + 1e-3f);
        }
      }
    }
  }
}

TEST_CASE("llama archive: recall puts archived rows back at their positions, exactly as dequantized") {
  auto model = tiny_model(2);
  setup c;
  SUBCASE("f32 cache, flash attention off") { c = {false, GGML_TYPE_F32, 4}; }
  SUBCASE("f16 cache, flash attention on") { c = {true, GGML_TYPE_F16, 4}; }
  lc::session s(model.get(), archive_options(c));
  auto ctx = archive_context(model.get(), s, c);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2};
  stream(s, policy, b);
  const std::int64_t size = s.size(), held = s.archive()->held_tokens();
  const auto before = archived_rows(*s.archive());
  const auto rep = s.recall(policy, b, {.budget_tokens = 8, .candidates = 8});
  REQUIRE(rep.tokens > 0);
  CHECK(rep.tokens <= 8);
  CHECK(std::int64_t(rep.positions.size()) == rep.tokens);
  CHECK(s.size() == size);                  // as many slots displaced as brought back
  CHECK(held == 64);                        // the eviction archived the 64 tokens before it
  CHECK(s.archive()->held_tokens() == 72);  // the recall the 8 after it; the recalled pages stay
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  const auto pos = positions(s);
  const std::int64_t e = std::int64_t(s.inputs(0).keys.n_heads) * s.inputs(0).keys.head_dim;
  const auto engine = engine_rows(ctx.get(), 0, s.n_layers(), e);
  const auto host = host_rows(s);
  for (const auto p : rep.positions) {
    CHECK(pos.count(p) == 1);
    CHECK(p < 64 - 8);  // an archived position, never the recent window
    for (std::int32_t l = 0; l < s.n_layers(); ++l) {
      const auto& want = before[static_cast<std::size_t>(l)].at(p);
      const auto& got = engine[static_cast<std::size_t>(l)].at(p);
      for (std::int64_t j = 0; j < e; ++j) {
        CHECK(got.first[static_cast<std::size_t>(j)] == rounded(want.first[static_cast<std::size_t>(j)], c.type));
        CHECK(got.second[static_cast<std::size_t>(j)] == rounded(want.second[static_cast<std::size_t>(j)], c.type));
        CHECK(host[static_cast<std::size_t>(l)].at(p).first[static_cast<std::size_t>(j)] ==
              want.first[static_cast<std::size_t>(j)]);
      }
    }
  }
  // the stream goes on after the newest position, with the recalled rows in the cache
  const auto next = s.next_pos();
  REQUIRE(s.decode(random_tokens(4, 5)) == 0);
  CHECK(s.tokens().back().pos == next + 3);
  check_memory_matches(s);
}

TEST_CASE("llama archive: the engine refusing the recalled rows loses nothing") {
  auto model = tiny_model(2);
  const setup c;
  auto o = archive_options(c);
  SUBCASE("keep positions") {}
  SUBCASE("compact positions: the cached slots already moved up stay where llama.cpp has them") {
    o.positions = lc::position_mode::compact;
  }
  bool refuse = true;
  o.memory.state_set = [&](llama_context* ctx, const std::uint8_t* src, std::size_t n, llama_seq_id seq) {
    return refuse ? static_cast<std::size_t>(0) : llama_state_seq_set_data(ctx, src, n, seq);
  };
  lc::session s(model.get(), o);
  auto ctx = archive_context(model.get(), s, c);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2};
  stream(s, policy, b);
  const std::int64_t size = s.size(), held = s.archive()->held_tokens();
  std::int64_t m = 0;
  try {
    s.recall(policy, b, {.budget_tokens = 8, .candidates = 8});
    FAIL("the refused write must raise");
  } catch (const infkv::engine_error& err) {
    CHECK(std::string(err.what()).find("slots fewer (they stay archived)") != std::string::npos);
    m = size - s.size();
  }
  CHECK(m > 0);
  CHECK(s.archive()->held_tokens() == held + 8);  // everything the stream wrote: nothing is lost
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  refuse = false;  // and the session goes on
  REQUIRE(s.decode(random_tokens(2, 6)) == 0);
  const auto rep = s.recall(policy, {.capacity = 24, .sinks = 2}, {.budget_tokens = 4, .candidates = 8});
  CHECK(rep.tokens <= 4);
  check_memory_matches(s);
  REQUIRE(s.decode(random_tokens(1, 7)) == 0);  // every cached row in llama.cpp is the session's copy
  const std::int64_t e = std::int64_t(s.inputs(0).keys.n_heads) * s.inputs(0).keys.head_dim;
  const auto engine = engine_rows(ctx.get(), 0, s.n_layers(), e);
  const auto host = host_rows(s);
  for (std::int32_t l = 0; l < s.n_layers(); ++l)
    for (const auto& [p, kv] : host[static_cast<std::size_t>(l)])
      for (std::int64_t j = 0; j < e; ++j)
        CHECK(std::fabs(engine[static_cast<std::size_t>(l)].at(p).first[static_cast<std::size_t>(j)] -
                        kv.first[static_cast<std::size_t>(j)]) <=
              2e-3 * (1 + std::fabs(kv.first[static_cast<std::size_t>(j)])));
}

TEST_CASE("llama archive: bad settings are refused with the option named") {
  auto model = tiny_model(2);
  const setup c;
  auto o = archive_options(c);
  o.positions = lc::position_mode::compact;
  CHECK_NOTHROW(lc::session(model.get(), o));  // one cache: compact positions are supported
  {
    auto gemma = tiny_gemma3();
    CHECK_THROWS_WITH(lc::session(gemma.get(), o),
                      doctest::Contains("an archive on a model with sliding-window layers needs position_mode::keep"));
  }
  o = archive_options(c);
  o.scratch_seq = 0;
  CHECK_THROWS_WITH(lc::session(model.get(), o), doctest::Contains("session_options.scratch_seq = 0"));
  {
    lc::session s(model.get(), archive_options(c));
    auto p = context_params({.n_ctx = 256});
    s.attach(p);
    context_ptr ctx(llama_init_from_model(model.get(), p));  // one sequence only
    CHECK_THROWS_WITH(s.bind(ctx.get()), doctest::Contains("must be below the context's n_seq_max = 1"));
  }
  lc::session s(model.get(), archive_options(c));
  auto ctx = archive_context(model.get(), s, c);
  REQUIRE(s.decode(random_tokens(16, 7)) == 0);
  // before any eviction the cache holds everything archived: recall archives the stream, brings nothing back
  CHECK(s.recall(infkv::snapkv{.window = 8}, {.capacity = 24, .sinks = 2}, {.budget_tokens = 4}).tokens == 0);
  CHECK(s.archive()->held_tokens() == 16);
  CHECK(s.size() == 16);
  check_memory_matches(s);
  lc::session plain(model.get(), lc::session_options::for_policy(infkv::snapkv{.window = 8}));
  CHECK_THROWS_WITH(plain.recall(infkv::snapkv{.window = 8}, {.capacity = 24}, {.budget_tokens = 4}),
                    doctest::Contains("session_options.archive = unset"));
}

TEST_CASE("llama archive: recall for a question decodes it aside and leaves the stream as it was") {
  auto model = tiny_model(2);
  const setup c;
  lc::session s(model.get(), archive_options(c));
  auto ctx = archive_context(model.get(), s, c);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2};
  stream(s, policy, b);
  const auto qpos = std::vector<std::int64_t>(s.inputs(0).query_pos.begin(), s.inputs(0).query_pos.end());
  const std::int64_t size = s.size(), next = s.next_pos();
  const auto rep = s.recall(policy, b, {.budget_tokens = 8, .candidates = 8}, random_tokens(6, 9));
  CHECK(rep.tokens <= 8);
  CHECK(s.size() == size);
  CHECK(s.next_pos() == next);  // the question's tokens are not part of the stream
  CHECK(std::vector<std::int64_t>(s.inputs(0).query_pos.begin(), s.inputs(0).query_pos.end()) == qpos);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  check_memory_matches(s);
  for (const auto p : rep.positions) CHECK(p < 64 - 8);
  CHECK_THROWS_WITH(s.recall(policy, b, {.budget_tokens = 8}, std::vector<llama_token>{}),
                    doctest::Contains("question.size() = 0"));
}

TEST_CASE("llama archive, sliding-window model: global layers' rows go back into llama.cpp, sliding ones' never") {
  // tiny Gemma 3: layers 0 and 2 slide over 16 positions (the iSWA cache's second part), 1 and 3
  // are global (its first part)
  auto model = tiny_gemma3();
  setup c;
  SUBCASE("f32 cache, flash attention off") { c = {false, GGML_TYPE_F32, 4}; }
  SUBCASE("f16 cache, flash attention on") { c = {true, GGML_TYPE_F16, 8}; }
  lc::session s(model.get(), archive_options(c));
  auto ctx = archive_context(model.get(), s, c);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2};
  stream(s, policy, b);
  check_memory_matches(s);
  const std::int64_t e = std::int64_t(s.inputs(0).keys.n_heads) * s.inputs(0).keys.head_dim;
  const std::vector<std::int32_t> global{1, 3}, sliding{0, 2};
  // every layer of the 64 streamed tokens is archived (the sliding ones from the session's copies)
  REQUIRE(s.archive()->held_tokens() == 64);
  const auto before = archived_rows(*s.archive());
  const std::int64_t size = s.size(), next = s.next_pos();
  const auto rep = s.recall(policy, b, {.budget_tokens = 8, .candidates = 8});
  REQUIRE(rep.tokens > 0);
  CHECK(s.size() == size);
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  const auto engine = engine_rows(ctx.get(), 0, s.n_layers(), e, global, 0);
  const auto engine_sliding = engine_rows(ctx.get(), 0, s.n_layers(), e, sliding, 1);
  const auto host = host_rows(s);
  for (const auto p : rep.positions) {
    CAPTURE(p);
    CHECK(p < next - 16);  // older than the window: no sliding layer attends to it again
    for (const std::int32_t l : global)
      for (std::int64_t j = 0; j < e; ++j) {
        const auto& want = before[static_cast<std::size_t>(l)].at(p);
        const auto& got = engine[static_cast<std::size_t>(l)].at(p);
        CHECK(got.first[static_cast<std::size_t>(j)] == rounded(want.first[static_cast<std::size_t>(j)], c.type));
        CHECK(got.second[static_cast<std::size_t>(j)] == rounded(want.second[static_cast<std::size_t>(j)], c.type));
      }
    for (const std::int32_t l : sliding) CHECK(engine_sliding[static_cast<std::size_t>(l)].count(p) == 0);
    for (std::int32_t l = 0; l < s.n_layers(); ++l)  // the session's copies: every layer's archived keys
      for (std::int64_t j = 0; j < e; ++j)
        CHECK(host[static_cast<std::size_t>(l)].at(p).first[static_cast<std::size_t>(j)] ==
              before[static_cast<std::size_t>(l)].at(p).first[static_cast<std::size_t>(j)]);
  }
  // the archived sliding layers' keys are the session's copies (within the quantization step)
  for (const std::int32_t l : sliding) CHECK(before[static_cast<std::size_t>(l)].size() == 64);
  REQUIRE(s.decode(random_tokens(4, 5)) == 0);
  CHECK(s.tokens().back().pos == next + 3);
  check_memory_matches(s);
  // a recall of at most the window's tokens back, for a question, leaves the stream as it was
  const auto q = s.recall(policy, b, {.budget_tokens = 4, .candidates = 8}, random_tokens(5, 8));
  for (const auto p : q.positions) CHECK(p < s.next_pos() - 16);
  check_memory_matches(s);
}

TEST_CASE("llama archive, compact positions: recall turns archived rows to where they land, the cache stays compact") {
  auto model = tiny_model(2);
  setup c;
  SUBCASE("f32 cache, flash attention off") { c = {false, GGML_TYPE_F32, 8}; }
  SUBCASE("f16 cache, flash attention on") { c = {true, GGML_TYPE_F16, 8}; }
  auto o = archive_options(c);
  o.positions = lc::position_mode::compact;
  lc::session s(model.get(), o);
  auto ctx = archive_context(model.get(), s, c);
  REQUIRE(s.mode() == lc::position_mode::compact);
  const infkv::snapkv policy{.window = 8};
  const infkv::budget b{.capacity = 24, .sinks = 2};
  stream(s, policy, b);  // 64 tokens, evicted to 24 at positions 0-23, then 8 at 24-31
  const std::int64_t e = std::int64_t(s.inputs(0).keys.n_heads) * s.inputs(0).keys.head_dim;
  const std::int32_t d = s.inputs(0).keys.head_dim;
  REQUIRE(s.size() == 32);
  for (std::int64_t i = 0; i < 8; ++i) CHECK(s.origins()[static_cast<std::size_t>(24 + i)] == 64 + i);
  // the 8 new tokens are archived at their origins 64-71, their keys turned from 24-31 by 40
  const auto host0 = host_rows(s);
  s.recall(policy, b, {.budget_tokens = 1, .candidates = 1}, random_tokens(2, 9));  // archives the stream first
  REQUIRE(s.archive()->held_tokens() == 72);
  const auto before = archived_rows(*s.archive());
  const float levels = float((1 << c.bits) - 1);
  for (std::int32_t l = 0; l < s.n_layers(); ++l) {
    const auto& r = s.layer_rope(l).params;
    for (std::int64_t i = 0; i < 8; ++i) {
      const auto want = turned(host0[static_cast<std::size_t>(l)].at(24 + i).first, d, r, 40);
      const auto& got = before[static_cast<std::size_t>(l)].at(64 + i).first;
      float lo = 1e30f, hi = -1e30f;
      for (const double x : want) lo = std::min(lo, float(x)), hi = std::max(hi, float(x));
      for (std::int64_t j = 0; j < e; ++j)
        CHECK(std::fabs(got[static_cast<std::size_t>(j)] - want[static_cast<std::size_t>(j)]) <=
              (hi - lo) / levels + 2e-3);
    }
  }
  const std::int64_t size = s.size();
  const std::vector<std::int64_t> origins_before(s.origins().begin(), s.origins().end());
  const auto rep = s.recall(policy, b, {.budget_tokens = 8, .candidates = 8});
  REQUIRE(rep.tokens > 0);
  CHECK(s.size() == size);
  check_memory_matches(s);
  CHECK(llama_memory_seq_pos_max(llama_get_memory(ctx.get()), 1) == -1);
  // compact again: positions 0..n-1, in the order of the origins
  std::vector<std::pair<std::int64_t, std::int64_t>> by_pos;
  for (std::size_t j = 0; j < s.tokens().size(); ++j) by_pos.push_back({s.tokens()[j].pos, s.origins()[j]});
  std::sort(by_pos.begin(), by_pos.end());
  for (std::size_t i = 0; i < by_pos.size(); ++i) {
    CHECK(by_pos[i].first == std::int64_t(i));
    if (i > 0) CHECK(by_pos[i].second > by_pos[i - 1].second);
  }
  // the recalled rows in llama.cpp: the archived ones turned from their origins to where they landed
  const auto engine = engine_rows(ctx.get(), 0, s.n_layers(), e);
  std::map<std::int64_t, std::int64_t> origin_at;
  for (std::size_t j = 0; j < s.tokens().size(); ++j) origin_at[s.tokens()[j].pos] = s.origins()[j];
  for (const auto p : rep.positions) {
    CAPTURE(p);
    const std::int64_t from = origin_at.at(p);
    CHECK(std::find(origins_before.begin(), origins_before.end(), from) == origins_before.end());  // not cached before
    CHECK(from < 64 - 8);
    for (std::int32_t l = 0; l < s.n_layers(); ++l) {
      const auto& arch = before[static_cast<std::size_t>(l)].at(from);
      const auto want = turned(arch.first, d, s.layer_rope(l).params, p - from);
      const auto& got = engine[static_cast<std::size_t>(l)].at(p);
      for (std::int64_t j = 0; j < e; ++j) {
        CHECK(std::fabs(got.first[static_cast<std::size_t>(j)] - want[static_cast<std::size_t>(j)]) <=
              2e-3 * (1 + std::fabs(want[static_cast<std::size_t>(j)])));
        CHECK(got.second[static_cast<std::size_t>(j)] == rounded(arch.second[static_cast<std::size_t>(j)], c.type));
      }
    }
  }
  // after the next decode llama.cpp has turned the moved cells' keys: every cached row equals the
  // session's copy (both turned by the same deltas)
  REQUIRE(s.decode(random_tokens(4, 5)) == 0);
  CHECK(s.tokens().back().pos == size + 3);
  CHECK(s.origins().back() == 72 + 3);
  check_memory_matches(s);
  const auto engine2 = engine_rows(ctx.get(), 0, s.n_layers(), e);
  const auto host = host_rows(s);
  for (std::int32_t l = 0; l < s.n_layers(); ++l)
    for (const auto& [p, kv] : host[static_cast<std::size_t>(l)]) {
      CAPTURE(p);
      const auto& got = engine2[static_cast<std::size_t>(l)].at(p);
      for (std::int64_t j = 0; j < e; ++j)
        CHECK(std::fabs(got.first[static_cast<std::size_t>(j)] - kv.first[static_cast<std::size_t>(j)]) <=
              2e-3 * (1 + std::fabs(kv.first[static_cast<std::size_t>(j)])));
    }
}
