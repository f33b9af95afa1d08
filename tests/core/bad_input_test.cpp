// Every invalid argument raises infkv::error whose message names the argument (and its value).
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

/// Checks that `expr` throws infkv::error whose what() contains `text`.
#define CHECK_ERROR(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), infkv::error)

namespace {

constexpr double nan_v = std::numeric_limits<double>::quiet_NaN();

std::vector<token> tokens_at(std::vector<std::int64_t> pos) {
  std::vector<token> t;
  for (auto p : pos) t.push_back({p, 0, modality::text});
  return t;
}

/// A small valid layer: 6 slots, 2 KV heads, 4 query heads, d = 4, 2 queries.
struct small_layer {
  std::vector<float> k = std::vector<float>(6 * 2 * 4, 0.5f);
  std::vector<float> q = std::vector<float>(2 * 4 * 4, 0.25f);
  std::vector<token> tokens = text_tokens(6);
  std::vector<std::int64_t> qpos = {4, 5};
  layer_inputs<> in() {
    return {nhd(k.data(), dtype::f32, 6, 2, 4), {}, nhd(q.data(), dtype::f32, 2, 4, 4), qpos, tokens, 0.f};
  }
};

}  // namespace

TEST_CASE("error types: invalid arguments are infkv::invalid_argument, every infkv error a std::runtime_error") {
  CHECK_THROWS_AS(budget{}.validate(), infkv::invalid_argument);
  CHECK_THROWS_AS(budget{}.validate(), infkv::error);
  CHECK_THROWS_AS(budget{}.validate(), std::runtime_error);
  static_assert(std::is_base_of_v<infkv::error, infkv::engine_error>);
  static_assert(!std::is_base_of_v<infkv::invalid_argument, infkv::engine_error>);
  static_assert(!std::is_base_of_v<std::invalid_argument, infkv::error>);
}

TEST_CASE("bad budgets name the field and its value") {
  CHECK_ERROR((budget{.capacity = 5, .sinks = 4, .recent = 2}.validate()), "budget.capacity = 5");
  CHECK_ERROR((budget{.capacity = 5, .sinks = 4, .recent = 2}.keep_count(100)), "sinks (4) + recent (2)");
  CHECK_ERROR(budget{}.validate(), "budget.capacity = 0");  // neither
  CHECK_ERROR(budget{}.validate(), "set exactly one of capacity");
  CHECK_ERROR((budget{.capacity = 8, .ratio = 0.5}.validate()), "budget.capacity = 8");  // both
  CHECK_ERROR((budget{.capacity = 8, .ratio = 0.5}.validate()), "ratio = 0.5");
  CHECK_ERROR(budget{.capacity = -3}.validate(), "budget.capacity = -3");
  CHECK_ERROR((budget{.capacity = 8, .sinks = -1}.validate()), "budget.sinks = -1");
  CHECK_ERROR((budget{.capacity = 8, .recent = -2}.validate()), "budget.recent = -2");
  CHECK_ERROR(budget{.ratio = -0.25}.validate(), "budget.ratio = -0.25");
  CHECK_ERROR(budget{.ratio = 1.5}.validate(), "budget.ratio = 1.5");
  CHECK_ERROR(budget{.ratio = nan_v}.validate(), "budget.ratio = nan");
  CHECK_ERROR(budget{.ratio = std::numeric_limits<double>::infinity()}.validate(), "budget.ratio = inf");
  // A ratio that resolves below the protected tokens: 0.1 of 20 = 2 < 2 + 1.
  CHECK_ERROR((budget{.ratio = 0.1, .sinks = 2, .recent = 1}.keep_count(20)), "budget.ratio = 0.1");
  CHECK_ERROR((budget{.ratio = 0.1, .sinks = 2, .recent = 1}.keep_count(20)), "keeps 2 of 20");
  CHECK_ERROR(budget{.capacity = 4}.keep_count(-1), "n_slots = -1");
  // select_top validates its budget too; snapkv's window can overflow a small capacity.
  const score_matrix s(1, 10);
  const auto t = text_tokens(10);
  CHECK_ERROR((cpu::select_top(s, t, budget{.capacity = 3, .sinks = 2, .recent = 2})), "budget.capacity = 3");
  CHECK_ERROR((cpu::select_top(s, t, protect(snapkv{.window = 8}, budget{.capacity = 6}))), "recent (8)");
}

TEST_CASE("bad scores and tokens for selection") {
  score_matrix s(2, 4, 1.f);
  s(1, 2) = float(nan_v);
  const auto t = text_tokens(4);
  CHECK_ERROR((cpu::select_top(s, t, budget{.capacity = 2})), "scores[1, 2] = nan");
  const score_matrix ok(2, 4, 1.f);
  CHECK_ERROR((cpu::select_top(ok, text_tokens(5), budget{.capacity = 2})), "tokens.size() = 5");
  CHECK_ERROR((cpu::select_top(ok, tokens_at({0, 1, -7, 3}), budget{.capacity = 2})), "tokens[2].pos = -7");
  const std::int64_t caps[] = {2};
  CHECK_ERROR(cpu::select_top(ok, t, caps, 0, 0), "capacities.size() = 1");
  const std::int64_t small[] = {2, 1};
  CHECK_ERROR(cpu::select_top(ok, t, small, 1, 1), "capacities[1] = 1");
  CHECK_ERROR(validate_tokens(t, 3), "tokens.size() = 4");
  CHECK_ERROR(score_matrix(-1, 3), "score_matrix.rows = -1");
}

TEST_CASE("bad keep sets and position runs") {
  keep_set k(5);
  CHECK_ERROR((k.add_unit(std::vector<std::int64_t>{0, 3, 2})), "slots[2] = 2");
  CHECK_ERROR((k.add_unit(std::vector<std::int64_t>{1, 1})), "slots[1] = 1");
  CHECK_ERROR((k.add_unit(std::vector<std::int64_t>{0, 7})), "slots[1] = 7");
  CHECK_ERROR(k.add_unit(std::vector<std::int64_t>{-1}), "slots[0] = -1");
  CHECK(k.n_units() == 0);  // a rejected unit leaves the set unchanged
  CHECK_ERROR(keep_set(-2), "n_slots = -2");
  CHECK_ERROR(k.unit(0), "unit = 0");
  k.add_unit(std::vector<std::int64_t>{0, 1});
  // Slots 1 (kept) and 2 (evicted) share position 1.
  const auto shared = tokens_at({0, 1, 1, 2, 3});
  CHECK_ERROR(k.kept_runs(shared), "position 1 is held by a kept and an evicted slot");
  CHECK_ERROR(k.evicted_runs(shared), "tokens: position 1");
  CHECK_ERROR(k.kept_runs(text_tokens(4)), "tokens.size() = 4");
  CHECK_ERROR((k.kept_runs(tokens_at({0, 1, 2, -3, 4}))), "tokens[3].pos = -3");
  const position_run bad[] = {{0, 2}, {5, 5}};
  CHECK_ERROR(keep_set::from_runs(bad, text_tokens(5)), "kept[1].end = 5");
}

TEST_CASE("bad attention inputs") {
  small_layer L;
  auto in = L.in();
  CHECK_NOTHROW(cpu::window_attention(in));
  SUBCASE("head_dim mismatch") {
    in.queries.head_dim = 2;
    CHECK_ERROR(cpu::window_attention(in), "queries.head_dim = 2");
  }
  SUBCASE("Hq not a multiple of Hkv") {
    in.queries.n_heads = 3;
    CHECK_ERROR(cpu::window_attention(in), "queries.n_heads = 3");
  }
  SUBCASE("query_pos size") {
    in.query_pos = std::span<const std::int64_t>(L.qpos).first(1);
    CHECK_ERROR(cpu::window_attention(in), "query_pos.size() = 1");
  }
  SUBCASE("zero queries") {
    in.queries.n_slots = 0;
    in.query_pos = {};
    CHECK_ERROR(cpu::window_attention(in), "queries.n_slots = 0");
  }
  SUBCASE("null views") {
    in.keys.data = nullptr;
    CHECK_ERROR(cpu::window_attention(in), "keys.data = null");
    CHECK_ERROR(cpu::keydiff_scores(in.keys), "keys.data = null");
    in = L.in();
    in.queries.data = nullptr;
    CHECK_ERROR(cpu::window_attention(in), "queries.data = null");
  }
  SUBCASE("bad shapes") {
    in.keys.n_heads = 0;
    CHECK_ERROR(cpu::window_attention(in), "keys.n_heads = 0");
    in = L.in();
    in.keys.head_dim = -4;
    CHECK_ERROR(cpu::window_attention(in), "keys.head_dim = -4");
  }
  SUBCASE("tokens") {
    L.tokens.pop_back();
    in = L.in();
    CHECK_ERROR(cpu::window_attention(in), "tokens.size() = 5");
    CHECK_ERROR((cpu::select(keydiff{}, budget{.capacity = 2}, in)), "tokens.size() = 5");
  }
  SUBCASE("scale") {
    in.scale = -1.f;
    CHECK_ERROR(cpu::window_attention(in), "scale = -1");
  }
  SUBCASE("executor threads") {
    CHECK_ERROR((cpu::window_attention(in, cpu::executor{0})), "executor.threads = 0");
    CHECK_ERROR((cpu::window_attention(in, cpu::executor{-2})), "executor.threads = -2");
  }
}

TEST_CASE("bad paged tables") {
  std::vector<float> store(4 * 3 * 2 * 4, 0.f);  // 4 pages of 3 slots, 2 heads, d = 4
  std::vector<std::int32_t> indptr = {0, 2, 3}, indices = {3, 1, 0}, last = {2, 3};
  paged_view p;
  p.k = {store.data(), 3 * 2 * 4, 2 * 4, 4};
  p.type = dtype::f32, p.n_heads = 2, p.head_dim = 4, p.page_size = 3, p.n_seqs = 2, p.n_pages = 4;
  p.indptr = indptr.data(), p.indices = indices.data(), p.last_page_len = last.data();
  CHECK_NOTHROW(validate(p, "paged"));
  SUBCASE("a page id past the pool") {  // the pool has 4 pages: id 4 would read past the storage
    indices[1] = 4;
    CHECK_ERROR(validate(p, "paged"), "paged.indices[1] = 4: must be a page of the pool: in [0, n_pages = 4)");
    CHECK_ERROR(key_rows(p, 0), "paged.indices[1] = 4");
  }
  SUBCASE("a negative page id") {
    indices[2] = -1;
    CHECK_ERROR(validate(p, "paged"), "paged.indices[2] = -1");
  }
  SUBCASE("no page count") {
    p.n_pages = 0;
    CHECK_ERROR(validate(p, "paged"), "paged.indices[0] = 3: must be a page of the pool: in [0, n_pages = 0)");
  }
  CHECK(p.seq_len(0) == 5);
  SUBCASE("indptr[0] != 0") {
    indptr[0] = 1;
    CHECK_ERROR(validate(p, "paged"), "paged.indptr[0] = 1");
  }
  SUBCASE("decreasing indptr") {
    indptr[2] = 1;
    CHECK_ERROR(validate(p, "paged"), "paged.indptr[2] = 1");
  }
  SUBCASE("last_page_len above the page size") {
    last[1] = 4;
    CHECK_ERROR(validate(p, "paged"), "paged.last_page_len[1] = 4");
  }
  SUBCASE("last_page_len zero for a sequence with pages") {
    last[0] = 0;
    CHECK_ERROR(validate(p, "paged"), "paged.last_page_len[0] = 0");
  }
  SUBCASE("page size, null arrays") {
    p.page_size = 0;
    CHECK_ERROR(validate(p, "paged"), "paged.page_size = 0");
    p.page_size = 3;
    p.indices = nullptr;
    CHECK_ERROR(validate(p, "paged"), "paged: indptr, indices");
  }
  SUBCASE("compaction validates the table and the sequence") {
    std::vector<token> t = text_tokens(5);
    last[0] = 9;
    CHECK_ERROR(cpu::compact(key_rows(p, 0), paged_rows{}, t, keep_set::all(5)), "paged.last_page_len[0] = 9");
    last[0] = 2;
    CHECK_ERROR(cpu::compact(key_rows(p, 2), paged_rows{}, t, keep_set::all(5)), "seq = 2");
    CHECK_ERROR(cpu::compact(key_rows(p, 0), value_rows(p, 0), t, keep_set::all(4)), "keep.n_slots = 4");
  }
  SUBCASE("rows of a bad table or of a missing sequence") {
    indptr[0] = 1;
    CHECK_ERROR(key_rows(p, 0), "paged.indptr[0] = 1");
    CHECK_ERROR(value_rows(p, 0), "paged.indptr[0] = 1");
    indptr[0] = 0;
    last[1] = 0;
    CHECK_ERROR(key_rows(p, 1), "paged.last_page_len[1] = 0");
    last[1] = 3;
    CHECK_ERROR(key_rows(p, 2), "seq = 2");
    CHECK_ERROR(key_rows(p, -1), "seq = -1");
    CHECK(key_rows(p, 1).n_slots == 3);
  }
  SUBCASE("rows of a paged sequence must have a page size") {
    auto rows = key_rows(p, 0);
    rows.page_size = 0;
    CHECK_ERROR(validate(rows, "keys"), "keys.page_size = 0");
  }
}

TEST_CASE("bad policy parameters") {
  small_layer L;
  const auto in = L.in();
  const budget b{.capacity = 4};
  CHECK_ERROR((cpu::select(snapkv{.window = 0}, b, in)), "snapkv.window = 0");
  CHECK_ERROR((cpu::select(snapkv{.kernel = 4}, budget{.capacity = 40}, in)), "snapkv.kernel = 4");
  CHECK_ERROR((cpu::select(snapkv{.kernel = -1}, budget{.capacity = 40}, in)), "snapkv.kernel = -1");
  CHECK_ERROR((cpu::select(inf_mllm{.window = -1}, b, in)), "inf_mllm.window = -1");
  CHECK_ERROR((cpu::select(inf_mllm{.kernel = 2}, b, in)), "inf_mllm.kernel = 2");
  CHECK_ERROR((cpu::select(inf_mllm{.bias = {.beta = -0.5}}, b, in)), "bias.beta = -0.5");
  CHECK_ERROR((cpu::select(inf_mllm{.bias = {.beta = nan_v}}, b, in)), "bias.beta = nan");
  CHECK_ERROR((attention_bias{.beta = 1.0, .rate = 0.0}.validate()), "bias.rate = 0");
  CHECK_ERROR((cpu::h2o_state(h2o{.forgetting = 0.0}, 2)), "h2o.forgetting = 0");
  CHECK_ERROR((cpu::h2o_state(h2o{.forgetting = 1.5}, 2)), "h2o.forgetting = 1.5");
  CHECK_ERROR((cpu::h2o_state(h2o{.forgetting = -0.5}, 2)), "h2o.forgetting = -0.5");
  CHECK_ERROR((cpu::h2o_state(h2o{.forgetting = nan_v}, 2)), "h2o.forgetting = nan");
  CHECK_ERROR((cpu::h2o_state(h2o{}, 0)), "n_kv_heads = 0");
}

TEST_CASE("bad h2o state events") {
  small_layer L;
  cpu::h2o_state st(h2o{}, 2);
  st.append(5);
  CHECK_ERROR(cpu::observe(st, L.in()), "probs.cols = 6");  // state not mirroring the cache
  CHECK_ERROR(st.append(-1), "n = -1");
  st.append(1);
  CHECK_ERROR(st.evict(keep_set::all(5)), "keep.n_slots = 5");
  CHECK_ERROR(st.evict(keep_set::all(6, 3)), "keep.n_units = 3");
  keep_set uneven(6);
  uneven.add_unit(std::vector<std::int64_t>{0, 1});
  uneven.add_unit(std::vector<std::int64_t>{0});
  CHECK_ERROR(st.evict(uneven), "keep.size(1) = 1");
  CHECK_ERROR(st.shift(text_tokens(7)), "tokens.size() = 7");
  CHECK_ERROR(st.accumulate(score_matrix(3, 6), std::vector<std::int64_t>(6)), "probs.rows = 3");
}

TEST_CASE("bad compaction and re-rotation") {
  std::vector<float> k(6 * 2 * 4, 1.f), v(6 * 2 * 4, 1.f);
  auto kv = contiguous_nhd(k.data(), v.data(), dtype::f32, 6, 2, 4);
  auto t = text_tokens(6);
  CHECK_ERROR(cpu::compact(kv, t, keep_set::all(5)), "keep.n_slots = 5");
  CHECK_ERROR(cpu::compact(kv, t, keep_set::all(6, 3)), "keep.n_units = 3");
  auto short_t = text_tokens(4);
  CHECK_ERROR(cpu::compact(kv, short_t, keep_set::all(6)), "tokens.size() = 4");
  const std::vector<std::int64_t> delta(6, 1);
  CHECK_ERROR((cpu::rerotate(kv.k, delta, cpu::rope{.dims = 3})), "rope.dims = 3");
  CHECK_ERROR((cpu::rerotate(kv.k, delta, cpu::rope{.dims = 8})), "rope.dims = 8");
  CHECK_ERROR((cpu::rerotate(kv.k, delta, cpu::rope{.theta = -1})), "rope.theta = -1");
  CHECK_ERROR((cpu::rerotate(kv.k, std::vector<std::int64_t>(5), cpu::rope{})), "delta.size() = 5");
  CHECK_ERROR((cpu::rerotate(kv.k, delta, cpu::rope{}, cpu::executor{0})), "executor.threads = 0");
}

TEST_CASE("bad allocation and reduction arguments") {
  const score_matrix s(2, 10, 1.f);
  const auto t = text_tokens(10);
  const budget b{.capacity = 4};
  CHECK_ERROR((cpu::allocate(adakv{.alpha = 1.5}, s, t, b)), "adakv.alpha = 1.5");
  CHECK_ERROR((cpu::allocate(adakv{.alpha = -0.1}, s, t, b)), "adakv.alpha = -0.1");
  CHECK_ERROR((cpu::allocate(adakv{.alpha = nan_v}, s, t, b)), "adakv.alpha = nan");
  CHECK_ERROR((pyramidkv{}.allocate(4, budget{.ratio = 0.5})), "budget.capacity = 0");
  CHECK_ERROR((pyramidkv{}.allocate(4, budget{.ratio = 0.5})), "PyramidKV needs an absolute capacity");
  CHECK_ERROR((pyramidkv{}.allocate(0, b)), "n_layers = 0");
  CHECK_ERROR((pyramidkv{.beta = 0.5}.allocate(4, b)), "pyramidkv.beta = 0.5");
}
