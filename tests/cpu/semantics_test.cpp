// The reference semantics infkv follows, each checked through the public API against an
// independent float64 implementation (reference_helpers.hpp) of SnapKV's reference code and
// kvpress's SnapKVPress: pooling stops at the observation window, max pooling runs per query
// head before the GQA mean, NaN / Inf inputs raise naming slot and head, views are checked, and
// selection follows one documented total order, also when scores tie massively.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

#define CHECK_ERROR(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), infkv::invalid_argument)

namespace {

/// The reference selection, written from the documented rule with plain sorting: the first
/// `sinks` and last `recent` slots in time order, then the others by (score desc, position desc,
/// slot asc), -0 equal to +0; `cap` slots in all, returned in increasing slot order.
std::vector<std::int64_t> ref_keep(const std::vector<double>& score, std::span<const token> tokens, std::int64_t cap,
                                   std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(tokens.size());
  std::vector<std::int64_t> kept, rest;
  if (cap >= n) {
    for (std::int64_t s = 0; s < n; ++s) kept.push_back(s);
    return kept;
  }
  const auto order = ref_time_order(tokens);
  for (std::int64_t i = 0; i < n; ++i) (i < sinks || i >= n - recent ? kept : rest).push_back(order[std::size_t(i)]);
  std::sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t b) {
    const double sa = score[std::size_t(a)] + 0.0, sb = score[std::size_t(b)] + 0.0;  // -0 -> +0
    return std::make_tuple(-sa, -tokens[std::size_t(a)].pos, a) < std::make_tuple(-sb, -tokens[std::size_t(b)].pos, b);
  });
  kept.insert(kept.end(), rest.begin(), rest.begin() + (cap - std::int64_t(kept.size())));
  std::sort(kept.begin(), kept.end());
  return kept;
}

std::vector<std::int64_t> unit_of(const keep_set& k, std::int64_t u = 0) {
  return {k.unit(u).begin(), k.unit(u).end()};
}

/// The window attention mass of the reference, G query heads averaged first, then pooled over
/// the whole row: what infkv computed before pooling stopped at the window and ran per head.
ref_matrix mean_then_pool_whole_row(const problem& p, std::int32_t kernel, pooling kind) {
  ref_matrix s = ref_window_pooled(p, p.nq, 1, pooling::none);  // no pooling: the group means
  const auto o = ref_time_order(p.tokens);
  const auto n = std::int64_t(o.size());
  for (auto& row : s) {
    const auto in = row;
    for (std::int64_t t = 0; t < n; ++t) {
      double acc = kind == pooling::max ? -1e300 : 0.0;
      for (std::int64_t u = std::max<std::int64_t>(0, t - kernel / 2); u <= std::min(n - 1, t + kernel / 2); ++u)
        acc = kind == pooling::max ? std::max(acc, in[std::size_t(o[std::size_t(u)])])
                                   : acc + in[std::size_t(o[std::size_t(u)])];
      row[std::size_t(o[std::size_t(t)])] = kind == pooling::avg ? acc / kernel : acc;
    }
  }
  return s;
}

}  // namespace

TEST_CASE("snapkv pools only the slots before its window: the kept set of the reference (n = 16 and 4096)") {
  // One KV head, G = 1, d = 16, window 4, kernel 5, avg pooling; capacity 7 of 16 (64 of 4096).
  // As in a prompt, the window's queries are the last four tokens and each attends strongly to
  // its own key, so the window holds a large part of the mass.
  const auto prompt_like = [](std::uint64_t seed, std::int64_t n) {
    problem p = make_problem(seed, n, 1, 1, 16, 4);
    const auto order = ref_time_order(p.tokens);
    for (std::int64_t i = 0; i < 4; ++i) {
      const auto slot = order[std::size_t(n - 4 + i)];
      p.qpos[std::size_t(i)] = p.tokens[std::size_t(slot)].pos;
      for (std::int64_t e = 0; e < 16; ++e) p.k[std::size_t(slot * 16 + e)] = p.q[std::size_t(i * 16 + e)];
    }
    return p;
  };
  const snapkv pol{.window = 4, .kernel = 5, .pool = pooling::avg};
  int differ = 0;
  for (std::uint64_t seed = 41; seed < 61; ++seed) {
    CAPTURE(seed);
    const layer l(prompt_like(seed, 16));
    const auto want = ref_keep(ref_window_pooled(l.p, 4, 5, pooling::avg)[0], l.p.tokens, 7, 0, 4);
    CHECK(unit_of(cpu::select(pol, budget{.capacity = 7}, l.in())) == want);
    differ += ref_keep(mean_then_pool_whole_row(l.p, 5, pooling::avg)[0], l.p.tokens, 7, 0, 4) != want;
  }
  CHECK(differ > 0);  // pooling over the whole row would keep other slots: the test tells them apart

  const std::int64_t n = 4096;
  const layer l(prompt_like(42, n));
  const auto want = ref_keep(ref_window_pooled(l.p, 4, 5, pooling::avg)[0], l.p.tokens, 64, 0, 4);
  const auto kept = unit_of(cpu::select(pol, budget{.capacity = 64}, l.in()));
  CHECK(kept == want);
  // Pooling over the whole row kept the slot right before the window for the window's mass.
  const auto order = ref_time_order(l.p.tokens);
  const auto whole = ref_keep(mean_then_pool_whole_row(l.p, 5, pooling::avg)[0], l.p.tokens, 64, 0, 4);
  CHECK(std::binary_search(whole.begin(), whole.end(), order[std::size_t(n - 5)]));
  CHECK_FALSE(std::binary_search(kept.begin(), kept.end(), order[std::size_t(n - 5)]));
}

TEST_CASE("max pooling with GQA pools each query head, then averages the group (as SnapKV and kvpress)") {
  for (const std::int32_t group : {2, 4}) {
    CAPTURE(group);
    const layer l(make_problem(50 + std::uint64_t(group), 96, 2, group, 16, 8));
    const snapkv pol{.window = 8, .kernel = 7, .pool = pooling::max};
    const auto got = cpu::layer_scores(pol, l.in());
    check_close(got, ref_window_pooled(l.p, 8, 7, pooling::max), 2e-4, 2e-6, "per-head max pooling");
    // Averaging first gives other scores: the order of the two steps is observable.
    auto mean_first = ref_window_pooled(l.p, 8, 1, pooling::none);
    const auto o = ref_time_order(l.p.tokens);
    double differ = 0;
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t t = 3; t + 3 < l.p.n - 8; ++t) {
        double m = -1e300;
        for (std::int64_t u = t - 3; u <= t + 3; ++u)
          m = std::max(m, mean_first[std::size_t(h)][std::size_t(o[std::size_t(u)])]);
        differ = std::max(differ, std::abs(m - double(got(h, o[std::size_t(t)]))));
      }
    CHECK(differ > 1e-3);
    // The keep sets follow the reference's scores.
    const auto keep = cpu::select(pol, budget{.capacity = 30, .sinks = 2}, l.in());
    const auto ref = ref_window_pooled(l.p, 8, 7, pooling::max);
    for (std::int64_t h = 0; h < 2; ++h) CHECK(unit_of(keep, h) == ref_keep(ref[std::size_t(h)], l.p.tokens, 30, 2, 8));
  }
}

TEST_CASE("avg and sum pooling give the same scores whichever of pooling and the GQA mean comes first") {
  const layer l(make_problem(60, 80, 2, 4, 8, 6));
  for (const pooling kind : {pooling::avg, pooling::sum}) {
    const snapkv pol{.window = 6, .kernel = 5, .pool = kind};
    check_close(cpu::layer_scores(pol, l.in()), ref_window_pooled(l.p, 6, 5, kind), 2e-4, 2e-6, to_string(kind));
  }
}

TEST_CASE("NaN and Inf in keys or queries raise, naming the tensor, slot and head") {
  const layer base(make_problem(70, 1000, 2, 2, 16, 4, dtype::f32, false));  // slot j holds position j + j / 7
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const float bad : {nan, inf, -inf}) {
    CAPTURE(bad);
    SUBCASE("a key element") {
      layer l(base.p);
      l.p.k[std::size_t((10 * 2 + 1) * 16 + 3)] = bad;  // slot 10, head 1, element 3
      l.keys = store(l.p.k, l.p.n, l.p.hkv, l.p.d, l.p.type, layout::nhd);
      for (const auto& [name, check] : std::vector<std::pair<std::string, std::function<void()>>>{
               {"snapkv", [&] { (void)cpu::select(snapkv{.window = 4}, budget{.capacity = 100}, l.in()); }},
               {"inf_mllm", [&] { (void)cpu::select(inf_mllm{.window = 4}, budget{.capacity = 100}, l.in()); }},
               {"tova", [&] { (void)cpu::select(tova{}, budget{.capacity = 100}, l.in()); }},
               {"keydiff", [&] { (void)cpu::select(keydiff{}, budget{.capacity = 100}, l.in()); }},
               {"window_attention", [&] { (void)cpu::window_attention(l.in()); }},
               {"attention_output", [&] {
                  auto in = l.in();
                  in.values = in.keys;
                  (void)cpu::attention_output(in);
                }}}) {
        CAPTURE(name);
        CHECK_ERROR(check(), "keys[slot 10, head 1][3] = ");
      }
    }
    SUBCASE("a query element") {
      layer l(base.p);
      l.p.q[std::size_t((3 * 4 + 2) * 16 + 5)] = bad;  // query 3, query head 2, element 5
      l.queries = store_queries(l.p);
      CHECK_ERROR((cpu::select(snapkv{.window = 4}, budget{.capacity = 100}, l.in())), "queries[slot 3, head 2][5] = ");
      CHECK_ERROR((cpu::select(tova{}, budget{.capacity = 100}, l.in())), "queries[slot 3, head 2][5] = ");
    }
  }
  SUBCASE("paged keys") {
    problem p = base.p;
    p.k[std::size_t((10 * 2 + 0) * 16 + 0)] = nan;
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::paged);
    const stored queries = store_queries(p);
    const layer_inputs<const_paged_rows> in{key_rows(keys.paged, 1), {}, queries.tensor, p.qpos, p.tokens, 0.f};
    CHECK_ERROR((cpu::select(snapkv{.window = 4}, budget{.capacity = 100}, in)), "keys[slot 10, head 0][0] = nan");
    CHECK_ERROR((cpu::select(keydiff{}, budget{.capacity = 100}, in)), "keys[slot 10, head 0][0] = nan");
  }
}

TEST_CASE("views are checked: HND capacity below the slots, overlapping strides") {
  std::vector<float> buf(64);
  CHECK_ERROR(hnd(buf.data(), dtype::f32, 10, 2, 4, 8), "slot_capacity = 8: must be >= n_slots (10)");
  CHECK_NOTHROW(hnd(buf.data(), dtype::f32, 8, 2, 4, 8));
  tensor_view v = nhd(buf.data(), dtype::f32, 4, 2, 4);
  v.head_stride = 2;  // rows of 4 elements, 2 apart: overlap
  CHECK_ERROR(validate(v, "keys"), "keys.head_stride = 2");
  v = nhd(buf.data(), dtype::f32, 4, 2, 4);
  v.slot_stride = 6;  // 2 heads of 4 need 8
  CHECK_ERROR(validate(v, "keys"), "keys.slot_stride = 6");
  v = hnd(buf.data(), dtype::f32, 4, 2, 4, 4);
  CHECK_NOTHROW(validate(v, "keys"));
  v.head_stride = 12;  // 4 slots of 4 need 16
  CHECK_ERROR(validate(v, "keys"), "keys.head_stride = 12");
}

TEST_CASE("ties: one total order (score, newer position, lower slot) on massively tied scores") {
  std::mt19937_64 gen(80);
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t n = 200, rows = 3;
    // Shuffled slots, repeated positions, scores on 4 levels (as bf16 Knorm scores tie), +-0.
    std::vector<token> tokens(static_cast<std::size_t>(n));
    for (std::int64_t s = 0; s < n; ++s) tokens[std::size_t(s)].pos = std::int64_t(gen() % 120);
    score_matrix m(rows, n);
    for (auto& x : m.data) {
      const auto level = gen() % 5;
      x = level == 4 ? -0.f : float(level);
    }
    const budget b{.capacity = 37 + trial, .sinks = trial % 5, .recent = trial % 7};
    const auto keep = cpu::select_top(m, tokens, b);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::vector<double> row(m.row(r).begin(), m.row(r).end());
      CHECK(unit_of(keep, r) == ref_keep(row, tokens, b.keep_count(n), b.sinks, b.recent));
    }
  }
}

TEST_CASE("ties through the pipeline: identical keys tie every attention and KeyDiff score") {
  problem p = make_problem(90, 64, 2, 2, 8, 4);
  for (std::int64_t j = 0; j < p.n; j += 2)  // every other slot copies slot 1: half the scores tie
    std::copy_n(p.k.begin() + 1 * 16, 16, p.k.begin() + j * 16);
  const layer l(p);
  for_each_policy(l.in(), [&](const std::string& name, const auto& pol, const auto& with) {
    INFO(name);
    const budget b{.capacity = 24, .sinks = 2, .recent = 4};
    const auto keep = cpu::select(pol, b, with(l.in()), granularity::per_head);
    const auto scores = cpu::layer_scores(pol, with(l.in()));
    const budget pb = protect(pol, b);
    for (std::int64_t u = 0; u < keep.n_units(); ++u) {
      const std::vector<double> row(scores.row(u).begin(), scores.row(u).end());
      CHECK(unit_of(keep, u) == ref_keep(row, l.p.tokens, pb.keep_count(p.n), pb.sinks, pb.recent));
    }
  });
}
