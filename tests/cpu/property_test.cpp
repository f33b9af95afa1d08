// Properties of every registered policy on random inputs (random shapes, element types, views,
// budgets and granularities, fixed seeds): each unit keeps min(n, capacity) slots, always the
// protected ones; the result does not depend on the thread count, nor (up to float near-ties) on
// the order of the slots; compacting the cache and scoring again equals scoring a cache built
// from the kept rows; kept and evicted position runs partition the positions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

namespace {

/// A random case: problem, storage layout, budget, granularity.
struct random_case {
  problem p;
  layout lay;
  budget b;
  granularity g;
};

random_case draw(std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  const auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return lo + std::int64_t(gen() % std::uint64_t(hi - lo + 1));
  };
  const std::int64_t n = pick(1, 260);
  const auto hkv = std::int32_t(std::vector<int>{1, 2, 4}[std::size_t(pick(0, 2))]);
  const auto group = std::int32_t(pick(1, 3));
  const auto d = std::int32_t(std::vector<int>{4, 8, 17, 32}[std::size_t(pick(0, 3))]);
  const dtype t = std::vector<dtype>{dtype::f32, dtype::f16, dtype::bf16}[std::size_t(pick(0, 2))];
  random_case c{make_problem(seed, n, hkv, group, d, pick(1, 8), t), layout(pick(0, 3)), {}, granularity(pick(0, 2))};
  c.b.sinks = pick(0, 5);
  c.b.recent = pick(0, 8);
  // Room for the protected tokens of every registered policy (windows up to 4).
  const std::int64_t prot = c.b.sinks + std::max<std::int64_t>(c.b.recent, 4);
  if (gen() % 3 == 0)
    c.b.ratio = std::min(1.0, double(prot + pick(0, 40)) / double(std::max<std::int64_t>(n, 1)));
  else
    c.b.capacity = prot + pick(0, n);
  return c;
}

std::vector<std::set<std::int64_t>> kept_positions(const keep_set& k, std::span<const token> tokens) {
  std::vector<std::set<std::int64_t>> out;
  for (std::int64_t u = 0; u < k.n_units(); ++u) {
    out.emplace_back();
    for (auto s : k.unit(u)) out.back().insert(tokens[std::size_t(s)].pos);
  }
  return out;
}

/// What one policy decided on one cache: kept positions per unit and the finished scores by
/// position per unit.
struct decision {
  std::vector<std::set<std::int64_t>> kept;
  std::vector<std::map<std::int64_t, float>> score;
};

template <class P, class R>
decision decide(const P& pol, const budget& b, granularity g, const layer_inputs<R>& in) {
  decision d;
  const auto keep = cpu::select(pol, b, in, g);
  d.kept = kept_positions(keep, in.tokens);
  auto s = cpu::layer_scores(pol, in);
  if (g != granularity::per_head && s.rows > 1) s = reduce_rows(s, reduction::mean);
  for (std::int64_t u = 0; u < s.rows; ++u) {
    d.score.emplace_back();
    for (std::int64_t j = 0; j < s.cols; ++j) d.score.back()[in.tokens[std::size_t(j)].pos] = s(u, j);
  }
  return d;
}

/// Same kept positions, or differences only between slots whose scores tie within float noise.
void check_same_up_to_near_ties(const decision& a, const decision& b) {
  REQUIRE(a.kept.size() == b.kept.size());
  for (std::size_t u = 0; u < a.kept.size(); ++u) {
    if (a.kept[u] == b.kept[u]) continue;
    float top = 0;
    for (const auto& [pos, v] : a.score[u]) top = std::max(top, std::abs(v));
    std::vector<float> in_a_only, in_b_only;
    for (auto pos : a.kept[u])
      if (!b.kept[u].count(pos)) in_a_only.push_back(a.score[u].at(pos));
    for (auto pos : b.kept[u])
      if (!a.kept[u].count(pos)) in_b_only.push_back(a.score[u].at(pos));
    CHECK(in_a_only.size() == in_b_only.size());
    for (std::size_t i = 0; i < std::min(in_a_only.size(), in_b_only.size()); ++i)
      CHECK(std::abs(in_a_only[i] - in_b_only[i]) <= 1e-4f * std::max(top, 1e-30f));
  }
}

}  // namespace

TEST_CASE("properties of every registered policy on random caches") {
  cpu::thread_pool lent(3);  // threads lent by an engine: the same keep sets as threads of its own
  for (std::uint64_t seed = 1000; seed < 1040; ++seed) {
    const random_case c = draw(seed);
    const problem& p = c.p;
    CAPTURE(seed);
    INFO("n ", p.n, ", Hkv ", p.hkv, ", Hq ", p.hq, ", d ", p.d, ", nq ", p.nq, ", ", std::string(to_string(p.type)),
         "/", std::string(to_string(c.lay)), ", ", std::string(to_string(c.g)), ", capacity ", c.b.capacity, " ratio ",
         c.b.ratio, " sinks ", c.b.sinks, " recent ", c.b.recent);
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, c.lay);
    const stored queries = store_queries(p);
    // The same cache with its slots in another order (each slot keeps its key and token).
    problem q = p;
    std::vector<std::int64_t> perm(static_cast<std::size_t>(p.n));
    std::iota(perm.begin(), perm.end(), std::int64_t{0});
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(seed));
    for (std::int64_t j = 0; j < p.n; ++j) {
      const auto from = std::size_t(perm[std::size_t(j)]);
      std::copy_n(p.k.begin() + std::ptrdiff_t(from * std::size_t(p.hkv * p.d)), p.hkv * p.d,
                  q.k.begin() + std::ptrdiff_t(j * p.hkv * p.d));
      q.tokens[std::size_t(j)] = p.tokens[from];
    }
    const stored keys_q = store(q.k, q.n, q.hkv, q.d, q.type, c.lay);

    std::map<std::string, decision> permuted;
    keys_q.visit([&](const auto& rows) {
      const layer_inputs<std::decay_t<decltype(rows)>> in{rows, {}, queries.tensor, q.qpos, q.tokens, 0.f};
      for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
        permuted[name] = decide(pol, c.b, c.g, with(in));
      });
      return 0;
    });
    keys.visit([&](const auto& rows) {
      const layer_inputs<std::decay_t<decltype(rows)>> in{rows, {}, queries.tensor, p.qpos, p.tokens, 0.f};
      for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
        INFO(name);
        const auto inputs = with(in);
        const budget prot = protect(pol, c.b);
        const std::int64_t cap = prot.keep_count(p.n);
        const auto keep = cpu::select(pol, c.b, inputs, c.g);
        // Size and protection.
        const auto order = ref_time_order(p.tokens);
        for (std::int64_t u = 0; u < keep.n_units(); ++u) {
          CHECK(keep.size(u) == std::min(p.n, cap));
          const auto mask = keep.mask(u);
          for (std::int64_t i = 0; i < p.n; ++i)
            if (i < prot.sinks || i >= p.n - prot.recent) CHECK(mask[std::size_t(order[std::size_t(i)])]);
        }
        // Threads.
        CHECK(cpu::select(pol, c.b, inputs, c.g, reduction::mean, cpu::executor{3}) == keep);
        CHECK(cpu::select(pol, c.b, inputs, c.g, reduction::mean, cpu::executor{.threads = 3, .pool = &lent}) == keep);
        // Slot order.
        check_same_up_to_near_ties(decide(pol, c.b, c.g, inputs), permuted.at(name));
        // Kept and evicted runs partition the positions: each slot's position lies in exactly one
        // run, a kept one exactly when the slot is kept.
        if (keep.n_units() == 1) {
          const auto kept = keep.kept_runs(p.tokens), evicted = keep.evicted_runs(p.tokens);
          const auto mask = keep.mask(0);
          const auto in_runs = [](const std::vector<position_run>& runs, std::int64_t pos) {
            return std::count_if(runs.begin(), runs.end(),
                                 [&](const position_run& r) { return pos >= r.begin && pos < r.end; });
          };
          for (std::int64_t j = 0; j < p.n; ++j) {
            const auto pos = p.tokens[std::size_t(j)].pos;
            CHECK(in_runs(kept, pos) == (mask[std::size_t(j)] ? 1 : 0));
            CHECK(in_runs(evicted, pos) == (mask[std::size_t(j)] ? 0 : 1));
          }
        }
      });
      return 0;
    });
  }
}

TEST_CASE("compacting the cache and scoring again equals scoring a cache of the kept rows") {
  for (std::uint64_t seed = 2000; seed < 2012; ++seed) {
    CAPTURE(seed);
    random_case c = draw(seed);
    problem& p = c.p;
    const stored queries = store_queries(p);
    std::vector<float> k = p.k;  // f32 NHD, compacted in place
    std::vector<token> tokens = p.tokens;
    kv_view kv{nhd(k.data(), dtype::f32, p.n, p.hkv, p.d), {}};
    const layer_inputs<> in{kv.k, {}, queries.tensor, p.qpos, tokens, 0.f};
    const auto keep = cpu::select(inf_mllm{.window = 4, .kernel = 3}, c.b, in, granularity::per_token);
    // The kept rows, copied out before the compaction.
    std::vector<float> rows;
    std::vector<token> kept_tokens;
    for (auto s : keep.unit(0)) {
      rows.insert(rows.end(), p.k.begin() + std::ptrdiff_t(s * p.hkv * p.d),
                  p.k.begin() + std::ptrdiff_t((s + 1) * p.hkv * p.d));
      kept_tokens.push_back(p.tokens[std::size_t(s)]);
    }
    tokens.resize(std::size_t(cpu::compact(kv, tokens, keep)));
    REQUIRE(tokens.size() == kept_tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) CHECK(tokens[i].pos == kept_tokens[i].pos);
    const auto m = std::int64_t(kept_tokens.size());
    const layer_inputs<> compacted{kv.k, {}, queries.tensor, p.qpos, tokens, 0.f};
    const layer_inputs<> fresh{
        nhd(rows.data(), dtype::f32, m, p.hkv, p.d), {}, queries.tensor, p.qpos, kept_tokens, 0.f};
    for_each_policy(fresh, [&](const std::string& name, const auto& pol, const auto& with) {
      INFO(name);
      if (!pol.spec().needs().attention)  // H2O's state is compacted by its own hook (reference_test)
        CHECK(cpu::layer_scores(pol, compacted).data == cpu::layer_scores(pol, fresh).data);
    });
  }
}
