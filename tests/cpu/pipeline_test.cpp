// The pipeline's plan / run contract for every registered policy: planned sizes match what run
// writes, several layers fold into one per-token decision, AdaKV capacities add up, and every
// misuse (workspace too small or misaligned, a layer of another shape, a keep view of other
// units, several layers at per-head granularity) raises naming the argument. run_decision_scores
// gives the scores a decision selects by.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

#define CHECK_ERROR(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), infkv::invalid_argument)

TEST_CASE("pipeline: planned sizes are what run writes, several layers fold into one decision") {
  const layer ly(make_problem(5, 120, 2, 2, 8, 6)), ly2(make_problem(6, 120, 2, 2, 8, 6));  // two layers
  const problem& p = ly.p;
  const layer_inputs<> in = ly.in();
  const cpu::backend be{};
  const budget b{.capacity = 40, .sinks = 2, .recent = 6};
  for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
    INFO(name);
    const auto l0 = with(in);
    auto l1 = with(layer_inputs<>{ly2.keys.tensor, {}, ly2.queries.tensor, p.qpos, p.tokens, 0.f});
    const plan pl =
        make_plan(be, pol, b, shape_of(l0), {.g = granularity::per_token, .r = reduction::sum, .n_layers = 2});
    CHECK(pl.units == 1);
    CHECK(pl.kept_total == protect(pol, b).keep_count(p.n));
    plan_buffers buf(pl);
    const std::vector<layer_inputs<>> layers{l0, l1};
    run(pl, be, std::span<const layer_inputs<>>(layers), buf.ws.span(), buf.out);
    CHECK(buf.offsets[1] == pl.kept_total);
    // The decision is select_top over the sum of both layers' finished scores.
    const auto s0 = cpu::layer_scores(pol, l0), s1 = cpu::layer_scores(pol, l1);
    const std::vector<score_matrix> both{s0, s1};
    CHECK(keep_set::from_view(buf.out) ==
          cpu::select_top(reduce_rows(both, reduction::sum), p.tokens, protect(pol, b)));
    // run_decision_scores hands out the scores that decision selects by: the two layers summed.
    const score_view d = run_decision_scores(pl, be, std::span<const layer_inputs<>>(layers), buf.ws.span());
    REQUIRE(d.rows == 1);
    REQUIRE(d.cols == p.n);
    for (std::int64_t c = 0; c < p.n; ++c) {
      double want = 0;
      for (const auto& m : both)
        for (std::int64_t r = 0; r < m.rows; ++r) want += double(m.data[std::size_t(r * m.cols + c)]);
      CHECK(double(d(0, c)) == doctest::Approx(want).epsilon(1e-5));
    }
  });
}

TEST_CASE("pipeline: AdaKV capacities through the plan add up and hold the protected tokens") {
  const layer ly(make_problem(7, 150, 4, 2, 8, 6));
  const problem& p = ly.p;
  const layer_inputs<> in = ly.in();
  const cpu::backend be{};
  const budget b{.capacity = 50, .sinks = 3, .recent = 5};
  for (const double alpha : {0.0, 0.2, 1.0}) {
    CAPTURE(alpha);
    const snapkv pol{.window = 5, .kernel = 3};
    const plan pl = make_plan(be, pol, b, shape_of(in), {.g = granularity::per_head, .adakv = adakv{.alpha = alpha}});
    plan_buffers buf(pl);
    run(pl, be, std::span<const layer_inputs<>>(&in, 1), buf.ws.span(), buf.out);
    const auto keep = keep_set::from_view(buf.out);
    // The same capacities as adakv::allocate on the same scores, and the same selection.
    const auto scores = cpu::layer_scores(pol, in);
    const auto caps = cpu::allocate(adakv{.alpha = alpha}, scores, p.tokens, protect(pol, b));
    CHECK(keep == cpu::select_top(scores, p.tokens, caps, 3, 5));
    std::int64_t total = 0;
    for (std::int64_t u = 0; u < keep.n_units(); ++u) total += keep.size(u);
    CHECK(total == pl.kept_total);
    if (alpha == 1.0)
      for (std::int64_t u = 0; u < keep.n_units(); ++u) CHECK(keep.size(u) == 50);
  }
}

TEST_CASE("pipeline: misuse raises naming the argument, for every policy") {
  const layer ly(make_problem(8, 64, 2, 2, 8, 4));
  const layer_inputs<> in = ly.in();
  const problem q = make_problem(9, 50, 2, 2, 8, 4);
  const stored keys_q = store(q.k, q.n, q.hkv, q.d, q.type, layout::nhd);
  const cpu::backend be{};
  const budget b{.capacity = 20, .sinks = 1, .recent = 4};
  int thread_dependent = 0;
  for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
    INFO(name);
    const auto l0 = with(in);
    const plan pl = make_plan(be, pol, b, shape_of(l0));
    plan_buffers buf(pl);
    const auto one = std::span<const layer_inputs<>>(&l0, 1);
    CHECK_ERROR(run(pl, be, one, buf.ws.span().first(pl.workspace_bytes - 1), buf.out), "workspace.size()");
    cpu::workspace roomy(pl.workspace_bytes + 64);
    CHECK_ERROR(run(pl, be, one, roomy.span().subspan(8, pl.workspace_bytes), buf.out),
                "workspace.data() = misaligned: must be 64-byte aligned");
    keep_view wrong = buf.out;
    wrong.n_units += 1;
    CHECK_ERROR(run(pl, be, one, buf.ws.span(), wrong), "out.n_units");
    auto other = l0;  // another cache: 50 slots
    other.keys = keys_q.tensor, other.query_pos = q.qpos, other.tokens = q.tokens;
    CHECK_ERROR(run(pl, be, std::span<const layer_inputs<>>(&other, 1), buf.ws.span(), buf.out), "layers[0]");
    const std::vector<layer_inputs<>> two{l0, l0};
    CHECK_ERROR(run(pl, be, std::span<const layer_inputs<>>(two), buf.ws.span(), buf.out), "layers.size() = 2");
    CHECK_ERROR(make_plan(be, pol, b, shape_of(l0), {.g = granularity::per_head, .n_layers = 2}),
                "plan_options.n_layers = 2");
    CHECK_ERROR(make_plan(be, pol, b, shape_of(l0), {.g = granularity::per_layer, .adakv = adakv{.alpha = 0.5}}),
                "plan_options.adakv.alpha");
    // Was accepted, and silently turned AdaKV off (alpha >= 0 was the switch).
    CHECK_ERROR(
        make_plan(be, pol, b, shape_of(l0),
                  {.g = granularity::per_head, .adakv = adakv{.alpha = std::numeric_limits<double>::quiet_NaN()}}),
        "adakv.alpha = nan: must be in [0, 1]");
    CHECK_ERROR(make_plan(be, pol, b, shape_of(l0), {.g = granularity::per_head, .adakv = adakv{.alpha = -0.5}}),
                "adakv.alpha = -0.5");
    CHECK_ERROR(make_plan(be, pol, budget{.capacity = 3, .sinks = 2, .recent = 2}, shape_of(l0)),
                "budget.capacity = 3");
    if (pol.spec().needs().queries > 0) {  // more window queries than the plan's workspace holds
      auto fewer = l0;
      fewer.queries.n_slots = 1;
      fewer.queries.data = l0.queries.row(3, 0);
      fewer.query_pos = fewer.query_pos.last(1);
      if (pol.spec().score.source == score_source::window_attention) {
        const plan small = make_plan(be, pol, b, shape_of(fewer));
        plan_buffers sbuf(small);
        CHECK_ERROR(run(small, be, one, sbuf.ws.span(), sbuf.out), "layers[0].queries.n_slots = 4");
      }
      CHECK_NOTHROW(run(pl, be, std::span<const layer_inputs<>>(&fewer, 1), buf.ws.span(), buf.out));
    }
    // A plan made for one thread, run by a backend of four whose scratch is larger: was an overrun.
    const cpu::backend wide{{.threads = 4}};
    if (wide.scratch_bytes(pl.spec.score, pl.shape, pl.opt) > be.scratch_bytes(pl.spec.score, pl.shape, pl.opt)) {
      ++thread_dependent;
      CHECK_ERROR(run(pl, wide, one, buf.ws.span(), buf.out), "make the plan with the backend that runs it");
    }
    run(pl, be, one, buf.ws.span(), buf.out);  // the buffers still work after the refusals
    CHECK(keep_set::from_view(buf.out) == cpu::select(pol, b, l0));
  });
  CHECK(thread_dependent >= 3);
}

TEST_CASE("pipeline: a source that reads queries refuses a layer without any") {
  const problem p = make_problem(10, 40, 2, 2, 8, 4);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const layer_inputs<> no_queries{keys.tensor, {}, {}, {}, p.tokens, 0.f};
  CHECK_ERROR(make_plan(cpu::backend{}, snapkv{}, budget{.capacity = 36}, shape_of(no_queries)), "queries.n_slots = 0");
  CHECK_ERROR(make_plan(cpu::backend{}, tova{}, budget{.capacity = 8}, shape_of(no_queries)), "queries.n_slots = 0");
  CHECK_NOTHROW(make_plan(cpu::backend{}, keydiff{}, budget{.capacity = 8}, shape_of(no_queries)));
  const layer_inputs<> no_keys{{}, {}, {}, {}, p.tokens, 0.f};
  CHECK_ERROR(cpu::select(keydiff{}, budget{.capacity = 8}, no_keys), "layers[0].keys.data = null");
}

TEST_CASE("pipeline: what capture_needs_of names is all a policy reads, and enough") {
  const layer ly(make_problem(12, 60, 2, 2, 8, 7));
  const layer_inputs<> full = ly.in();
  std::vector<float> v(std::size_t(60 * 2 * 8), 0.5f);
  const stored values = store(v, 60, 2, 8, dtype::f32, layout::nhd);
  const budget b{.capacity = 30, .sinks = 2, .recent = 6};
  for_each_policy(full, [&](const std::string& label, const auto& pol, const auto& with) {
    INFO(label);
    const capture_needs c = capture_needs_of(pol);
    // Only what the policy needs: no keys, values or queries it does not read, and just its
    // last c.queries queries.
    layer_inputs<> in{.tokens = ly.p.tokens};
    if (c.attention) in.accumulated = with(full).accumulated;
    if (c.keys) in.keys = full.keys;
    if (c.values) in.values = values.tensor;
    if (c.queries > 0) {
      REQUIRE(c.queries <= ly.p.nq);
      const std::int64_t drop = ly.p.nq - c.queries;
      in.queries = full.queries;
      in.queries.data = full.queries.row(drop, 0), in.queries.n_slots = c.queries;
      in.query_pos = std::span(ly.p.qpos).subspan(std::size_t(drop));
    }
    layer_inputs<> all = with(full);
    all.values = values.tensor;
    CHECK(cpu::select(pol, b, in) == cpu::select(pol, b, all));
  });
}

TEST_CASE("pipeline: PyramidKV's layer budgets are plain budgets, one plan per layer") {
  const layer ly(make_problem(11, 200, 2, 2, 8, 6));
  const layer_inputs<> in = ly.in();
  const cpu::backend be{};
  const auto budgets = pyramidkv{.beta = 4}.allocate(4, budget{.capacity = 60, .sinks = 2, .recent = 8});
  std::int64_t total = 0;
  for (std::size_t l = 0; l < budgets.size(); ++l) {
    CAPTURE(l);
    const plan pl = make_plan(be, inf_mllm{.window = 6}, budgets[l], shape_of(in), {.g = granularity::per_layer});
    CHECK(pl.kept_total == budgets[l].capacity);
    plan_buffers buf(pl);
    run(pl, be, std::span<const layer_inputs<>>(&in, 1), buf.ws.span(), buf.out);
    CHECK(keep_set::from_view(buf.out) == cpu::select(inf_mllm{.window = 6}, budgets[l], in, granularity::per_layer));
    if (l) CHECK(budgets[l].capacity <= budgets[l - 1].capacity);  // the pyramid narrows with depth
    total += pl.kept_total;
  }
  CHECK(total == 4 * 60);
}

TEST_CASE("cpu::select of a union: share 1 and 0 select as the first and the second policy alone") {
  const layer ly(make_problem(7, 90, 2, 4, 8, 6));
  const layer_inputs<> in = ly.in();
  const budget b{.capacity = 30, .sinks = 2};
  const snapkv first{.window = 4};  // protects its window: the union's protection covers keydiff's too
  const keydiff second{};
  const auto alone = [&](const auto& p) { return cpu::select(p, protect(first, b), in, granularity::per_layer); };
  CHECK(cpu::select(union_of<snapkv, keydiff>{first, second, 1.0}, b, in) == alone(first));
  CHECK(cpu::select(union_of<snapkv, keydiff>{first, second, 0.0}, b, in) == alone(second));
  const keep_set half = cpu::select(union_of<snapkv, keydiff>{first, second, 0.5}, b, in);
  CHECK(half.size(0) == 30);
  CHECK(half != alone(first));
  CHECK(half != alone(second));
}

TEST_CASE("pipeline: a union keeps what the set definition keeps over both policies' decision scores") {
  // ref_union: the protected slots, round(share * room) by the first score's ranking, then the
  // second's ranking until the budget is full; ties (repeated keys) and repeated positions included.
  std::mt19937_64 rng(23);
  const cpu::backend be{};
  for (int trial = 0; trial < 48; ++trial) {
    CAPTURE(trial);
    const std::int64_t n = 6 + std::int64_t(rng() % 90);
    problem p = make_problem(900 + std::uint64_t(trial), n, 2, 2, 8, 5, dtype::f32);
    for (std::int64_t j = 2; j < n; j += 3) std::copy_n(p.k.begin() + 2 * 8, 2 * 8, p.k.begin() + j * 2 * 8);
    if (trial % 3 == 0) p.tokens = random_tokens(rng, n);
    const layer ly(p);
    const layer_inputs<> in = ly.in();
    cpu::h2o_state heavy(h2o{}, 2);
    heavy.append(n);
    cpu::observe(heavy, in);
    const budget b{.capacity = 1 + std::int64_t(rng() % std::uint64_t(n + 4)),
                   .sinks = std::int64_t(rng() % 3),
                   .recent = std::int64_t(rng() % 4)};
    const double share = double(rng() % 9) / 8.0;
    const granularity g = trial % 2 ? granularity::per_layer : granularity::per_token;
    const auto check = [&](const auto& u, const layer_inputs<>& inputs, const char* what) {
      INFO(what, " share ", share, " capacity ", b.capacity, " ", to_string(g));
      const budget pb = protect(u, b);
      if (pb.capacity < pb.sinks + pb.recent) {  // cannot hold its protected tokens
        CHECK_THROWS_AS(make_plan(be, u, b, shape_of(inputs), {.g = g}), infkv::invalid_argument);
        return;
      }
      const plan pl = make_plan(be, u, b, shape_of(inputs), {.g = g});
      plan_buffers buf(pl);
      const std::span<const layer_inputs<>> one(&inputs, 1);
      run(pl, be, one, buf.ws.span(), buf.out);
      const keep_set got = keep_set::from_view(buf.out);
      const score_view a = run_decision_scores(pl, be, one, buf.ws.span(), 0);
      const std::vector<float> first(a.data, a.data + n);
      const score_view s = run_decision_scores(pl, be, one, buf.ws.span(), 1);
      const std::vector<float> second(s.data, s.data + n);
      CHECK(std::vector<std::int64_t>(got.unit(0).begin(), got.unit(0).end()) ==
            ref_union(first, second, p.tokens, pb.keep_count(n), pb.sinks, pb.recent, share));
    };
    check(union_of<inf_mllm, keydiff>{{.window = 3, .kernel = 3, .bias = {.beta = 0.5}}, {}, share}, in,
          "inf_mllm + keydiff");
    check(union_of<h2o, streaming_llm>{{}, {}, share}, heavy.attach(in), "h2o + streaming_llm");
    check(union_of<tova, snapkv>{{}, {.window = 2, .kernel = 3, .pool = pooling::max}, share}, in, "tova + snapkv");
  }
}

TEST_CASE("pipeline: a union refuses what it cannot serve, naming the argument") {
  const layer ly(make_problem(3, 40, 2, 2, 8, 4));
  const cpu::backend be{};
  const union_of<snapkv, keydiff> u{{.window = 4}, {}, 0.5};
  const budget b{.capacity = 20};
  CHECK_ERROR(make_plan(be, u, b, shape_of(ly.in()), {.g = granularity::per_head}), "plan_options.g = per_head");
  CHECK_ERROR(make_plan(be, u, b, shape_of(ly.in()), {.g = granularity::per_layer, .adakv = adakv{.alpha = 0.5}}),
              "plan_options.adakv.alpha");
  CHECK_ERROR((union_of<snapkv, keydiff>{.share = -0.1}.validate()), "union_of.share = -0.1");
  policy_spec spec = u.spec();
  spec.share = 1.5;
  CHECK_ERROR(make_plan(be, spec, b, shape_of(ly.in()), {.g = granularity::per_layer}), "union_of.share = 1.5");
  // H2O in a union reads the accumulated scores too.
  CHECK_ERROR(cpu::select(union_of<h2o, keydiff>{}, b, ly.in()), "accumulated.rows");
}
