// Every policy's CPU scores against naive double-precision references on random inputs, for
// every element type (f32, f16, bf16), every view (NHD, HND with spare capacity, padded strides,
// paged with out-of-order pages), GQA groups of 2 and 4, causally masked queries, and 1 or 2
// threads (which must agree bit for bit).
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

namespace {

/// Tolerance against the reference fed the stored (rounded) values: f32 arithmetic only.
constexpr double rtol_stored = 2e-4, atol_stored = 2e-6;

/// Tolerance against the reference fed the values before rounding to the element type.
double rtol_exact(dtype t) { return t == dtype::f32 ? 2e-4 : t == dtype::f16 ? 5e-3 : 5e-2; }
double atol_exact(dtype t) { return t == dtype::f32 ? 2e-6 : t == dtype::f16 ? 5e-4 : 5e-3; }

/// The problem with its unrounded values, as if the cache held them exactly.
problem exact(problem p) {
  p.k = p.k_exact;
  p.q = p.q_exact;
  return p;
}

/// Calls f(problem, layer_inputs, label) for every type x layout x GQA group.
template <class F>
void for_each_setup(std::uint64_t seed, F&& f) {
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (layout l : {layout::nhd, layout::hnd, layout::strided, layout::paged})
      for (std::int32_t group : {2, 4}) {
        const problem p = make_problem(seed++, 70, 2, group, 12, 5, t);
        const stored keys = store(p.k, p.n, p.hkv, p.d, t, l);
        const stored queries = store_queries(p);
        const std::string label = std::string(to_string(t)) + "/" + to_string(l) + "/G=" + std::to_string(group);
        INFO(label);
        keys.visit([&](const auto& rows) {
          layer_inputs<std::decay_t<decltype(rows)>> in{rows, {}, queries.tensor, p.qpos, p.tokens, 0.f};
          f(p, in, label);
          return 0;
        });
      }
}

/// Checks a policy's layer scores against `ref` on stored and exact values, and threads = 2.
template <class P, class Inputs, class Ref>
void check_policy(const P& policy, const problem& p, const Inputs& in, const std::string& label, Ref&& ref) {
  const auto got = cpu::layer_scores(policy, in);
  check_close(got, ref(p), rtol_stored, atol_stored, label + " vs stored values");
  check_close(got, ref(exact(p)), rtol_exact(p.type), atol_exact(p.type), label + " vs exact values");
  CHECK(cpu::layer_scores(policy, in, cpu::executor{2}).data == got.data);
}

}  // namespace

TEST_CASE("window attention mass matches the reference on every type, view and GQA group") {
  for_each_setup(100, [](const problem& p, const auto& in, const std::string& label) {
    const auto got = cpu::window_attention(in);
    check_close(got, ref_window_mass(p), rtol_stored, atol_stored, label);
    check_close(got, ref_window_mass(exact(p)), rtol_exact(p.type), atol_exact(p.type), label + " exact");
    CHECK(cpu::window_attention(in, cpu::executor{2}).data == got.data);
    CHECK(cpu::window_attention(in, cpu::executor{7}).data == got.data);
    // Every query sees at least one key, so the mass adds up to the number of queries per head.
    for (std::int64_t h = 0; h < got.rows; ++h) {
      double total = 0;
      for (float v : got.row(h)) total += v;
      CHECK(total == doctest::Approx(double(p.nq)).epsilon(1e-4));
    }
  });
}

TEST_CASE("window attention honours an explicit scale and zeroes queries that see no key") {
  problem p = make_problem(7, 30, 2, 2, 8, 4, dtype::f32);
  p.qpos[0] = -1;  // sees nothing
  p.scale = 0.3;
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.3f};
  check_close(cpu::window_attention(in), ref_window_mass(p), rtol_stored, atol_stored, "scale 0.3");
  in.query_pos = std::span<const std::int64_t>(p.qpos).first(1);
  in.queries.n_slots = 1;
  const auto none = cpu::window_attention(in);
  for (float v : none.data) CHECK(v == 0.f);
}

TEST_CASE("window attention beyond the kept-probability cache (tiles recomputed) matches the reference") {
  // 4 query heads x 32 queries x 40000 keys x 4 bytes = 20 MiB of probabilities: more than one
  // worker keeps between the softmax passes, so later tiles are recomputed.
  const problem p = make_problem(11, 40000, 1, 4, 8, 32, dtype::f32);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const auto got = cpu::window_attention(in);
  check_close(got, ref_window_mass(p), rtol_stored, atol_stored, "40000 keys");
  CHECK(cpu::window_attention(in, cpu::executor{2}).data == got.data);
}

TEST_CASE("snapkv scores match the reference with avg and max pooling") {
  for (const snapkv cfg :
       {snapkv{.window = 3, .kernel = 5, .pool = pooling::avg}, snapkv{.window = 4, .kernel = 7, .pool = pooling::max},
        snapkv{.window = 2, .kernel = 1, .pool = pooling::avg}}) {
    CAPTURE(cfg.window);
    CAPTURE(cfg.kernel);
    for_each_setup(200, [&](const problem& p, const auto& in, const std::string& label) {
      check_policy(cfg, p, in, label + "/snapkv", [&](const problem& q) { return ref_snapkv(q, cfg); });
    });
  }
}

TEST_CASE("inf_mllm scores match the reference with the bias off and on") {
  const inf_mllm configs[] = {
      {.window = 4, .kernel = 3, .pool = pooling::sum, .bias = {}},
      {.window = 3, .kernel = 5, .pool = pooling::sum, .bias = {.beta = 0.5, .shape = decay::linear}},
      {.window = 5,
       .kernel = 3,
       .pool = pooling::sum,
       .bias = {.beta = 0.8, .shape = decay::exponential, .unit = age_unit::segments, .rate = 3.0}},
      {.window = 2,
       .kernel = 1,
       .pool = pooling::none,
       .bias = {.beta = 2.0, .shape = decay::exponential, .unit = age_unit::positions}},
  };
  for (const auto& cfg : configs) {
    CAPTURE(cfg.bias.beta);
    CAPTURE(cfg.window);
    for_each_setup(300, [&](const problem& p, const auto& in, const std::string& label) {
      check_policy(cfg, p, in, label + "/inf_mllm", [&](const problem& q) { return ref_inf_mllm(q, cfg); });
    });
  }
}

TEST_CASE("tova scores match the reference: last query, mean over every head") {
  for_each_setup(400, [&](const problem& p, const auto& in, const std::string& label) {
    check_policy(tova{}, p, in, label + "/tova", [](const problem& q) { return ref_tova(q); });
  });
}

TEST_CASE("keydiff scores match the reference") {
  for_each_setup(500, [&](const problem& p, const auto& in, const std::string& label) {
    check_policy(keydiff{}, p, in, label + "/keydiff", [](const problem& q) { return ref_keydiff(q); });
    CHECK(cpu::keydiff_scores(in.keys, cpu::executor{2}).data == cpu::keydiff_scores(in.keys).data);
  });
}

TEST_CASE("streaming_llm scores are the time rank of each slot") {
  const problem p = make_problem(9, 25, 2, 2, 4, 2);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  const layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const auto s = cpu::layer_scores(streaming_llm{}, in);
  const auto order = ref_time_order(p.tokens);
  REQUIRE(s.rows == 1);
  for (std::size_t i = 0; i < order.size(); ++i) CHECK(s(0, order[i]) == float(i));
}

TEST_CASE("h2o accumulates the reference's running sum, with forgetting and lifetime") {
  for (const h2o cfg : {h2o{}, h2o{.normalize_lifetime = true}, h2o{.forgetting = 0.7},
                        h2o{.normalize_lifetime = true, .forgetting = 0.5}}) {
    CAPTURE(cfg.forgetting);
    CAPTURE(cfg.normalize_lifetime);
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16})
      for (layout l : {layout::nhd, layout::hnd, layout::strided, layout::paged}) {
        INFO(to_string(t), "/", to_string(l));
        // Three steps over the same cache, each with its own queries and visibility.
        std::vector<problem> steps;
        for (std::uint64_t s = 0; s < 3; ++s) {
          problem st = make_problem(600 + s, 40, 2, 2, 8, 3 - std::int64_t(s), t);
          if (s) st.k = steps[0].k, st.k_exact = steps[0].k_exact, st.tokens = steps[0].tokens;
          for (auto& qp : st.qpos) qp -= std::int64_t(10 * (2 - s));  // early steps see fewer keys
          steps.push_back(std::move(st));
        }
        const stored keys = store(steps[0].k, steps[0].n, steps[0].hkv, steps[0].d, t, l);
        cpu::h2o_state one(cfg, 2), two(cfg, 2);
        one.append(steps[0].n);
        two.append(steps[0].n);
        keys.visit([&](const auto& rows) {
          for (const auto& st : steps) {
            const stored queries = store_queries(st);
            const layer_inputs<std::decay_t<decltype(rows)>> in{rows, {}, queries.tensor, st.qpos, st.tokens, 0.f};
            cpu::observe(one, in);
            cpu::observe(two, in, cpu::executor{2});
          }
          const layer_inputs<std::decay_t<decltype(rows)>> last{rows, {}, {}, {}, steps[0].tokens, 0.f};
          const auto got = cpu::layer_scores(cfg, one.attach(last));
          check_close(got, ref_h2o(steps, cfg), rtol_stored, atol_stored, "h2o");
          CHECK(two.scores().data == got.data);
          return 0;
        });
      }
  }
}

TEST_CASE("h2o state follows eviction: kept slots keep their accumulated scores, new slots start at zero") {
  const problem p = make_problem(700, 20, 2, 2, 8, 3);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  const layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  cpu::h2o_state st(h2o{}, 2);
  st.append(p.n);
  cpu::observe(st, in);
  const auto before = st.scores();
  const auto keep =
      cpu::select(h2o{}, budget{.capacity = 8, .sinks = 1, .recent = 2}, st.attach(in), granularity::per_head);
  REQUIRE(keep.n_units() == 2);
  st.evict(keep);
  REQUIRE(st.n_slots() == 8);
  st.append(3);
  const auto after = st.scores();
  for (std::int64_t h = 0; h < 2; ++h) {
    const auto slots = keep.unit(h);
    for (std::size_t i = 0; i < slots.size(); ++i) CHECK(after(h, std::int64_t(i)) == before(h, slots[i]));
    for (std::int64_t j = 8; j < 11; ++j) CHECK(after(h, j) == 0.f);
  }
}

TEST_CASE("every registered policy matches its float64 reference on every type, view and GQA group") {
  for_each_setup(700, [&](const problem& p, const auto& in, const std::string& label) {
    for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
      check_policy(pol, p, with(in), label + "/" + name, [&](const problem& q) { return ref_scores(q, pol); });
    });
  });
}

namespace {
/// Context-reconstruction scores: per KV head, the largest probability any query of the head's
/// group gives each key.
ref_matrix ref_reconstruction(const problem& p) {
  const std::int32_t g = p.hq / p.hkv;
  ref_matrix out(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
  for (std::int32_t hq = 0; hq < p.hq; ++hq)
    for (std::int64_t i = 0; i < p.nq; ++i) {
      const auto pr = ref_probs(p, i, hq);
      for (std::int64_t j = 0; j < p.n; ++j)
        out[std::size_t(hq / g)][std::size_t(j)] =
            std::max(out[std::size_t(hq / g)][std::size_t(j)], pr[std::size_t(j)]);
    }
  return out;
}

}  // namespace

TEST_CASE("reconstruction scores (KVzip) match the reference on every type, view and GQA group") {
  for_each_setup(300, [](const problem& p, const auto& in, const std::string& label) {
    const auto got = cpu::reconstruction(in);
    check_close(got, ref_reconstruction(p), rtol_stored, atol_stored, label);
    check_close(got, ref_reconstruction(exact(p)), rtol_exact(p.type), atol_exact(p.type), label + " exact");
    CHECK(cpu::reconstruction(in, cpu::executor{2}).data == got.data);
    // A second pass over the same keys max-accumulates: nothing changes; from a larger start, the start stays.
    score_matrix again = got;
    const cpu::workspace work(cpu::detail::window_scratch_bytes(in));
    cpu::reconstruction_into(in, again.view(), work.span().data());
    CHECK(again.data == got.data);
    score_matrix high(got.rows, got.cols, 2.f);
    cpu::reconstruction_into(in, high.view(), work.span().data());
    for (float v : high.data) CHECK(v == 2.f);
  });
}

TEST_CASE("reconstruction scores: keys nobody sees score 0, chunks accumulate, and bad shapes name out.rows") {
  problem p = make_problem(17, 40, 2, 2, 8, 6, dtype::f32);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored queries = store_queries(p);
  layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const auto all = cpu::reconstruction(in);
  std::int64_t max_q = 0;
  for (auto q : p.qpos) max_q = std::max(max_q, q);
  for (std::int64_t j = 0; j < p.n; ++j)
    if (p.tokens[std::size_t(j)].pos > max_q)
      for (std::int64_t h = 0; h < all.rows; ++h) CHECK(all(h, j) == 0.f);
  // Two halves of the queries, accumulated, give the whole.
  score_matrix halves(all.rows, all.cols);
  const cpu::workspace work(cpu::detail::window_scratch_bytes(in));
  for (std::int64_t first : {std::int64_t(0), p.nq / 2}) {
    layer_inputs<> part = in;
    const std::int64_t count = first == 0 ? p.nq / 2 : p.nq - p.nq / 2;
    part.queries.data = in.queries.row(first, 0);
    part.queries.n_slots = count;
    part.query_pos = std::span<const std::int64_t>(p.qpos).subspan(std::size_t(first), std::size_t(count));
    cpu::reconstruction_into(part, halves.view(), work.span().data());
  }
  check_close(halves, ref_reconstruction(p), rtol_stored, atol_stored, "two halves");
  score_matrix wrong(all.rows + 1, all.cols);
  CHECK_THROWS_WITH_AS(cpu::reconstruction_into(in, wrong.view(), work.span().data()), doctest::Contains("out.rows"),
                       infkv::error);
}
