// Conformance of every policy through cpu::select: over budgets (absolute and ratio, with sinks
// and recent) and granularities, on random caches whose slot order is not time order, each unit
// keeps exactly keep_count slots, always the protected ones, the best of the rest by the
// documented order (score, then newer position, then lower slot); the result is deterministic and
// independent of the thread count; and keep sets round-trip through position runs.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

namespace {

std::string describe(const budget& b) {
  return (b.capacity ? "capacity " + std::to_string(b.capacity) : "ratio " + std::to_string(b.ratio)) + ", sinks " +
         std::to_string(b.sinks) + ", recent " + std::to_string(b.recent);
}

/// Ranks slots for the non-protected part: a before b when a must be kept first.
struct rank_key {
  float score;
  std::int64_t pos, slot;
  bool better_than(const rank_key& o) const {
    return std::tie(score, pos) != std::tie(o.score, o.pos) ? std::tie(score, pos) > std::tie(o.score, o.pos)
                                                            : slot < o.slot;
  }
};

void check_runs_round_trip(const keep_set& keep, std::int64_t u, std::span<const token> tokens) {
  const auto kept = keep.kept_runs(tokens, u), evicted = keep.evicted_runs(tokens, u);
  keep_set alone(keep.n_slots());
  alone.add_unit(keep.unit(u));
  CHECK(keep_set::from_runs(kept, tokens) == alone);
  auto count = [&](std::int64_t pos) {
    int c = 0;
    for (const auto& r : kept) c += pos >= r.begin && pos < r.end;
    for (const auto& r : evicted) c += pos >= r.begin && pos < r.end;
    return c;
  };
  for (const auto& t : tokens) CHECK(count(t.pos) == 1);  // kept and evicted runs partition them
}

/// All conformance properties of one (policy, budget, granularity) on one layer.
template <class P>
void check_conformance(const P& pol, const budget& b, granularity g, const layer_inputs<>& in) {
  const auto keep = cpu::select(pol, b, in, g);
  const std::int64_t n = in.keys.n_slots;
  const budget prot = protect(pol, b);
  const std::int64_t cap = prot.keep_count(n);
  auto scores = cpu::layer_scores(pol, in);
  if (g != granularity::per_head && scores.rows > 1) scores = reduce_rows(scores, reduction::mean);
  REQUIRE(keep.n_slots() == n);
  REQUIRE(keep.n_units() == scores.rows);
  if (g != granularity::per_head) CHECK(keep.n_units() == 1);
  const auto order = ref_time_order(in.tokens);
  for (std::int64_t u = 0; u < keep.n_units(); ++u) {
    CAPTURE(u);
    CHECK(keep.size(u) == cap);
    const auto mask = keep.mask(u);
    if (cap < n) {
      for (std::int64_t i = 0; i < prot.sinks; ++i) CHECK(mask[std::size_t(order[std::size_t(i)])]);
      for (std::int64_t i = n - prot.recent; i < n; ++i) CHECK(mask[std::size_t(order[std::size_t(i)])]);
    }
    // The worst kept unprotected slot ranks above the best evicted one.
    bool any_kept = false, any_evicted = false;
    rank_key worst_kept{}, best_evicted{};
    for (std::int64_t i = prot.sinks; i < n - prot.recent; ++i) {
      const auto s = order[std::size_t(i)];
      const rank_key key{scores(u, s), in.tokens[std::size_t(s)].pos, s};
      if (mask[std::size_t(s)]) {
        if (!any_kept || worst_kept.better_than(key)) worst_kept = key;
        any_kept = true;
      } else {
        if (!any_evicted || key.better_than(best_evicted)) best_evicted = key;
        any_evicted = true;
      }
    }
    if (any_kept && any_evicted) CHECK(worst_kept.better_than(best_evicted));
    check_runs_round_trip(keep, u, in.tokens);
  }
  CHECK(cpu::select(pol, b, in, g) == keep);
  CHECK(cpu::select(pol, b, in, g, reduction::mean, cpu::executor{2}) == keep);
}

const budget budgets[] = {
    {.capacity = 20, .sinks = 2, .recent = 4},
    {.capacity = 9},
    {.ratio = 0.5, .sinks = 3, .recent = 5},
    {.ratio = 0.25, .sinks = 1},
    {.capacity = 12, .sinks = 8},               // with snapkv's window of 4: nothing left to choose
    {.capacity = 60, .sinks = 4, .recent = 8},  // more than the cache: keep everything
};

}  // namespace

TEST_CASE("conformance: every policy x budget x granularity on shuffled random caches") {
  for (std::uint64_t seed : {11u, 12u, 13u}) {
    CAPTURE(seed);
    const problem p = make_problem(seed, 48, 2, 2, 8, 6, dtype::f32, true);
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
    const stored queries = store_queries(p);
    const layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
    for (const budget& b : budgets)
      for (granularity g : {granularity::per_head, granularity::per_layer, granularity::per_token}) {
        INFO(describe(b), " / ", to_string(g));
        for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
          INFO(name);
          check_conformance(pol, b, g, with(in));
        });
      }
  }
}

TEST_CASE("conformance: per-head policies can keep different slots per head, per-layer ones cannot") {
  const problem p = make_problem(21, 48, 2, 2, 8, 6, dtype::f32, true);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  const layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const budget b{.capacity = 12, .sinks = 1, .recent = 2};
  CHECK_FALSE(cpu::select(snapkv{.window = 4, .kernel = 3}, b, in, granularity::per_head).uniform());
  CHECK_FALSE(cpu::select(keydiff{}, b, in, granularity::per_head).uniform());
  CHECK(cpu::select(tova{}, b, in, granularity::per_head).n_units() == 1);
  CHECK(cpu::select(streaming_llm{}, b, in, granularity::per_head).n_units() == 1);
  // The per-layer decision is the per-head scores' mean, selected once.
  const auto s = reduce_rows(cpu::layer_scores(keydiff{}, in), reduction::mean);
  CHECK(cpu::select(keydiff{}, b, in, granularity::per_layer) == cpu::select_top(s, p.tokens, b));
  const auto mx = reduce_rows(cpu::layer_scores(keydiff{}, in), reduction::max);
  CHECK(cpu::select(keydiff{}, b, in, granularity::per_layer, reduction::max) == cpu::select_top(mx, p.tokens, b));
}

TEST_CASE("conformance: explicit ties keep the newest positions, then the lowest slots") {
  // Slots 0..9 hold positions 9, 8, ..., 0, except that slots 7 and 8 share position 1.
  std::vector<token> tokens(10);
  for (std::int64_t s = 0; s < 10; ++s) tokens[std::size_t(s)].pos = 9 - s;
  tokens[7].pos = 1;
  std::vector<float> k(10 * 2 * 4, 0.f), q(2 * 4 * 4, 0.f);
  for (std::size_t i = 0; i < k.size(); i += 4) k[i] = 1.f;  // identical keys: every score ties
  const std::vector<std::int64_t> qpos = {9, 9};
  const layer_inputs<> in{
      nhd(k.data(), dtype::f32, 10, 2, 4), {}, nhd(q.data(), dtype::f32, 2, 4, 4), qpos, tokens, 0.f};
  cpu::h2o_state fresh(h2o{}, 2);
  fresh.append(10);  // all zero
  const budget b{.capacity = 4, .sinks = 1};
  // Sink: position 0 (slot 9); then positions 9, 8, 7 (slots 0, 1, 2).
  const std::vector<std::int64_t> want = {0, 1, 2, 9};
  const auto check_all_units = [&](const keep_set& keep) {
    for (std::int64_t u = 0; u < keep.n_units(); ++u)
      CHECK(std::vector<std::int64_t>(keep.unit(u).begin(), keep.unit(u).end()) == want);
  };
  check_all_units(cpu::select(keydiff{}, b, in));
  check_all_units(cpu::select(h2o{}, b, fresh.attach(in)));
  check_all_units(cpu::select(tova{}, b, in));
  check_all_units(cpu::select(snapkv{.window = 2, .kernel = 1}, budget{.capacity = 4, .sinks = 1}, in));
  // Capacity 9 with the sink at position 0: one of the two slots at position 1 goes, the higher.
  const auto nine = cpu::select(keydiff{}, budget{.capacity = 9, .sinks = 1}, in, granularity::per_layer);
  CHECK(std::vector<std::int64_t>(nine.unit(0).begin(), nine.unit(0).end()) ==
        std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 9});
}
