// Batched plans (batch.hpp) on the CPU backend: over random ragged batches (1-6 sequences of
// 1-120 slots, their own budgets and query counts, keys contiguous or in one shared page pool,
// one or two layers, AdaKV) every registered policy's keep set for each sequence equals that
// sequence's own run; a paged batch compacts in place with its page table rewritten and freed
// pages reported (checked by reading every kept row back through the new table); bad batches
// are refused naming the argument and the sequence, before anything moves.
#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "batch_cases.hpp"
#include "cpu/reference_helpers.hpp"

using namespace infkv;
using namespace infkv_test;

TEST_CASE("a batch plan keeps, for every sequence and policy, exactly what the sequence's own run keeps") {
  for (std::uint64_t seed = 0; seed < 40; ++seed) {
    CAPTURE(seed);
    const batch_case c = draw_batch(seed);
    std::mt19937_64 gen(seed + 99);
    const batch_keys keys(gen, c);
    const cpu::backend be{.ex = {.threads = seed % 2 ? 2 : 1}};
    check_batch_equals_runs(be, c, keys.tensor_rows);
    check_batch_equals_runs(be, c, keys.paged_rows);
  }
}

namespace {

/// A paged batch with values, random one-unit keep sets, compacted by cpu::compact.
struct compacted {
  batch_case c;
  page_pool k, v;
  std::vector<std::vector<std::int64_t>> keep;  ///< [seq] kept slots
  std::vector<std::int64_t> slot_indptr{0}, unit_indptr{0}, kept_indptr{0}, slots, offsets;

  explicit compacted(std::uint64_t seed) : c(draw_batch(seed)) {
    std::mt19937_64 gen(seed + 7);
    std::vector<std::vector<float>> kx, vx;
    std::vector<std::int64_t> n;
    for (const problem& p : c.seqs) {
      kx.push_back(p.k);
      vx.push_back(p.k);
      for (float& x : vx.back()) x = -2.f * x + 1.f;
      n.push_back(p.n);
    }
    std::mt19937_64 same(seed);  // one page assignment for K and V
    k = page_pool(same, kx, n, c.hkv, c.d, c.type, c.page);
    same.seed(seed);
    v = page_pool(same, vx, n, c.hkv, c.d, c.type, c.page);
    for (const problem& p : c.seqs) {
      keep.push_back(random_slots(gen, p.n, std::int64_t(gen() % std::uint64_t(p.n + 1))));
      slot_indptr.push_back(slot_indptr.back() + p.n);
      unit_indptr.push_back(unit_indptr.back() + 1);
      kept_indptr.push_back(kept_indptr.back() + std::int64_t(keep.back().size()));
      offsets.push_back(0);
      offsets.push_back(std::int64_t(keep.back().size()));
      slots.insert(slots.end(), keep.back().begin(), keep.back().end());
    }
  }
  paged_view kv() {
    paged_view p = k.view;
    p.v = v.view.k;
    return p;
  }
  batch_keep_view view() {
    return {slots.data(),       offsets.data(),     slot_indptr.data(),
            unit_indptr.data(), kept_indptr.data(), std::int32_t(c.seqs.size())};
  }
};

std::vector<std::uint8_t> row_bytes(const paged_rows& r, std::int64_t slot, std::int32_t head) {
  const auto* p = static_cast<const std::uint8_t*>(r.row(slot, head));
  return {p, p + r.head_dim * std::int64_t(size_of(r.type))};
}

}  // namespace

TEST_CASE("compacting a paged batch keeps each sequence's rows in its first pages and rewrites the table") {
  for (std::uint64_t seed = 100; seed < 160; ++seed) {
    CAPTURE(seed);
    compacted b(seed);
    const paged_view before = b.kv();
    const std::vector<std::int32_t> old_indptr = b.k.indptr, old_indices = b.k.indices;
    // What each sequence should hold after: its kept rows and tokens, read before anything moves.
    std::vector<std::vector<std::vector<std::uint8_t>>> want_k, want_v;
    std::vector<token> want_tokens;
    for (std::int32_t s = 0; s < before.n_seqs; ++s) {
      want_k.emplace_back(), want_v.emplace_back();
      for (const std::int64_t j : b.keep[std::size_t(s)]) {
        want_tokens.push_back(b.c.tokens[std::size_t(b.slot_indptr[std::size_t(s)] + j)]);
        for (std::int32_t h = 0; h < before.n_heads; ++h) {
          want_k.back().push_back(row_bytes(key_rows(before, s), j, h));
          want_v.back().push_back(row_bytes(value_rows(before, s), j, h));
        }
      }
    }
    std::vector<token> tokens = b.c.tokens;
    std::vector<std::int32_t> freed(old_indices.size() + 1, -1);
    // The engine's own table is rewritten in place (out aliases kv's arrays).
    const page_table_out out{b.k.indptr, b.k.indices, b.k.last, freed};
    const std::int64_t n_freed = cpu::compact(before, tokens, b.view(), out);
    // The table: each sequence keeps the first ceil(kept / page) of its pages, in order.
    paged_view after = before;  // the same arrays, rewritten
    std::multiset<std::int32_t> pages_after(freed.begin(), freed.begin() + n_freed);
    for (std::int32_t s = 0; s < before.n_seqs; ++s) {
      CAPTURE(s);
      const auto m = std::int64_t(b.keep[std::size_t(s)].size());
      REQUIRE(after.seq_len(s) == m);
      const auto stay = std::int32_t((m + before.page_size - 1) / before.page_size);
      REQUIRE(after.indptr[s + 1] - after.indptr[s] == stay);
      for (std::int32_t i = 0; i < stay; ++i) {
        CHECK(after.indices[after.indptr[s] + i] == old_indices[std::size_t(old_indptr[std::size_t(s)] + i)]);
        pages_after.insert(after.indices[after.indptr[s] + i]);
      }
      std::size_t r = 0;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int32_t h = 0; h < before.n_heads; ++h, ++r) {
          CHECK(row_bytes(key_rows(after, s), i, h) == want_k[std::size_t(s)][r]);
          CHECK(row_bytes(value_rows(after, s), i, h) == want_v[std::size_t(s)][r]);
        }
    }
    // Pages kept and pages freed are exactly the pages held before.
    CHECK(pages_after == std::multiset<std::int32_t>(old_indices.begin(), old_indices.end()));
    // Tokens packed: sequence s's kept tokens at kept_indptr[s].
    tokens.resize(want_tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i)
      CHECK((tokens[i].pos == want_tokens[i].pos && tokens[i].segment == want_tokens[i].segment));
  }
}

TEST_CASE("bad batches are refused naming the argument and the sequence, and nothing moves") {
  const batch_case c = draw_batch(3);
  const cpu::backend be{};
  const snapkv pol{.window = 2};
  {  // budgets: one, or one per sequence
    std::vector<budget> two(c.seqs.size() + 1, budget{.capacity = 8});
    CHECK_THROWS_WITH_AS(make_batch_plan(be, pol, two, c.shape()), doctest::Contains("budgets.size()"),
                         invalid_argument);
  }
  {  // offsets
    std::vector<std::int64_t> bad = c.slot_indptr;
    bad[0] = 1;
    batch_shape s = c.shape();
    s.slot_indptr = bad;
    CHECK_THROWS_WITH_AS(make_batch_plan(be, pol, c.budgets, s), doctest::Contains("shape.slot_indptr[0] = 1"),
                         invalid_argument);
    std::vector<std::int64_t> short_q(c.query_indptr.begin(), c.query_indptr.end() - 1);
    s = c.shape();
    s.query_indptr = short_q;
    CHECK_THROWS_WITH_AS(make_batch_plan(be, pol, c.budgets, s), doctest::Contains("shape.query_indptr.size()"),
                         invalid_argument);
  }
  {  // a sequence whose budget is bad is named
    std::vector<budget> b = c.budgets;
    b.back().capacity = -3;
    const std::string why = "sequence " + std::to_string(c.seqs.size() - 1) + " of the batch: budget.capacity = -3";
    CHECK_THROWS_WITH_AS(make_batch_plan(be, pol, b, c.shape()), doctest::Contains(why.c_str()), invalid_argument);
  }
  {  // inputs that do not fit the plan
    const batch_plan bp = make_batch_plan(be, pol, c.budgets, c.shape());
    std::mt19937_64 gen(1);
    const batch_keys keys(gen, c);
    cpu::workspace ws(bp.workspace_bytes);
    std::vector<std::int64_t> slots(std::size_t(bp.kept_total())), offsets(std::size_t(bp.offsets_size()));
    batch_inputs<> in{.keys = keys.tensor_rows[0],
                      .queries = c.queries.tensor,
                      .query_pos = c.qpos,
                      .tokens = std::span<const token>(c.tokens).first(c.tokens.size() - 1)};
    CHECK_THROWS_WITH_AS(run(bp, be, in, ws.span(), bp.keep(slots.data(), offsets.data())),
                         doctest::Contains("layers[0].tokens.size()"), invalid_argument);
    in.tokens = c.tokens;
    in.keys = std::span<const const_tensor_view>(keys.tensor_rows[0]).first(c.seqs.size() - 1);
    if (c.seqs.size() > 1)
      CHECK_THROWS_WITH_AS(run(bp, be, in, ws.span(), bp.keep(slots.data(), offsets.data())),
                           doctest::Contains("layers[0].keys.size()"), invalid_argument);
    in.keys = keys.tensor_rows[0];
    in.queries.n_slots -= 1;
    CHECK_THROWS_WITH_AS(run(bp, be, in, ws.span(), bp.keep(slots.data(), offsets.data())),
                         doctest::Contains("layers[0].queries.n_slots"), invalid_argument);
    in.queries = c.queries.tensor;
    std::vector<std::int64_t> other(std::size_t(bp.n_seqs() + 1), 0);
    batch_keep_view wrong = bp.keep(slots.data(), offsets.data());
    wrong.kept_indptr = other.data();
    CHECK_THROWS_WITH_AS(run(bp, be, in, ws.span(), wrong), doctest::Contains("plan.keep"), invalid_argument);
    run(bp, be, in, ws.span(), bp.keep(slots.data(), offsets.data()));  // and the right one runs
    // one sequence cut out: only sequences of the batch
    const std::string past = "s = " + std::to_string(bp.n_seqs());
    CHECK_THROWS_WITH_AS(sequence_inputs(bp, in, bp.n_seqs()), doctest::Contains(past.c_str()), invalid_argument);
    CHECK_THROWS_WITH_AS(sequence_inputs(bp, in, -1), doctest::Contains("s = -1"), invalid_argument);
    CHECK(sequence_inputs(bp, in, bp.n_seqs() - 1).tokens.size() == c.seqs.back().tokens.size());
  }
  {  // compaction: a bad keep set in the last sequence leaves every sequence, and the table, as they were
    std::uint64_t seed = 5;
    while (compacted(seed).c.seqs.size() < 2 || compacted(seed).keep.back().empty()) ++seed;
    compacted b(seed);
    const std::vector<std::uint8_t> k0 = b.k.bytes, v0 = b.v.bytes;
    const std::vector<std::int32_t> indices0 = b.k.indices, last0 = b.k.last;
    const std::vector<token> tokens0 = b.c.tokens;
    std::vector<token> tokens = b.c.tokens;
    std::vector<std::int32_t> freed(b.k.indices.size());
    const page_table_out out{b.k.indptr, b.k.indices, b.k.last, freed};
    b.slots.back() = b.c.seqs.back().n;  // past the sequence's slots
    const std::string why = "sequence " + std::to_string(b.c.seqs.size() - 1) + " of the batch: keep.unit(0)";
    CHECK_THROWS_WITH_AS(cpu::compact(b.kv(), tokens, b.view(), out), doctest::Contains(why.c_str()), invalid_argument);
    CHECK((b.k.bytes == k0 && b.v.bytes == v0 && b.k.indices == indices0 && b.k.last == last0));
    CHECK(std::equal(tokens.begin(), tokens.end(), tokens0.begin(),
                     [](const token& x, const token& y) { return x.pos == y.pos && x.segment == y.segment; }));
    b.slots.back() = b.c.seqs.back().n - 1;
    std::vector<std::int32_t> small(1);
    CHECK_THROWS_WITH_AS(cpu::compact(b.kv(), tokens, b.view(), {b.k.indptr, b.k.indices, b.k.last, small}),
                         doctest::Contains("out.indices.size()"), invalid_argument);
    CHECK(b.k.bytes == k0);
  }
}
