// Expected Attention and value-norm weighting on the CPU backend: against their float64
// references (ref_expected builds kvpress's matrices: RoPE as d x d rotations, the covariance as
// a d x d matrix; the backend never forms either), invariant to where the stream stands, and
// refusing bad input by name. The CUDA steps are compared with these in cuda/steps_test.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"

using namespace infkv;
using namespace infkv_test;

#define CHECK_ERROR(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), infkv::invalid_argument)

namespace {

/// Values [n][hkv][dv] of a problem, random, and their norms per KV head (double, as stored).
struct values {
  std::vector<float> v;
  stored s;
  ref_matrix norms;
  values(const problem& p, std::int32_t dv, dtype t, layout l, std::uint64_t seed) {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (std::int64_t i = 0; i < p.n * p.hkv * dv; ++i) v.push_back(round_to(t, normal(gen) * (1.f + float(i % 7))));
    s = store(v, p.n, p.hkv, dv, t, l);
    norms.assign(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
    for (std::int64_t j = 0; j < p.n; ++j)
      for (std::int32_t h = 0; h < p.hkv; ++h) {
        double sum = 0;
        for (std::int32_t e = 0; e < dv; ++e) sum += std::pow(double(v[std::size_t((j * p.hkv + h) * dv + e)]), 2);
        norms[std::size_t(h)][std::size_t(j)] = std::sqrt(sum);
      }
  }
};

/// cpu::select for a policy given as a spec (the covariance form is chosen in the spec).
keep_set select_spec(const policy_spec& spec, const budget& b, const layer_inputs<>& in) {
  const cpu::backend be{};
  const plan pl = make_plan(be, spec, b, shape_of(in), {.g = granularity::per_head});
  plan_buffers buf(pl);
  run(pl, be, in, buf.ws.span(), buf.out);
  return keep_set::from_view(buf.out);
}

/// cpu::layer_scores for a policy given as a spec.
score_matrix scores_spec(const policy_spec& spec, const layer_inputs<>& in) {
  const cpu::backend be{};
  const plan pl = make_plan(be, spec, budget{.ratio = 1.0}, shape_of(in));
  cpu::workspace ws(pl.workspace_bytes);
  const score_view s = run_scores(pl, be, in, ws.span());
  score_matrix out(s.rows, s.cols);
  for (std::int64_t r = 0; r < s.rows; ++r) std::copy(s.row(r), s.row(r) + s.cols, out.row(r).begin());
  return out;
}

}  // namespace

TEST_CASE("expected attention: both covariance forms within 5e-6 of float64 (row-max relative) up to 8K queries") {
  std::uint64_t seed = 300;
  for (const std::int64_t m : {16, 64, 2048, 8192})
    for (const std::int32_t d : {64, 128, 256}) {  // 256: wider than a tile of 192 (Gemma 3)
      if (m == 8192 && d > 64) continue;           // the float64 reference alone would take seconds
      CAPTURE(m);
      CAPTURE(d);
      const problem p = make_problem(seed++, 257, 1, 2, d, m);
      const layer ly(p);
      const rope rot{.style = d == 128 ? rope_style::neox : rope_style::normal};
      const expected_attention ea{.window = m, .rotary = rot, .sinks = 0, .value_norm = false};
      const ref_matrix want = ref_expected(p, ea);
      const budget b{.capacity = 64};
      std::vector<keep_set> keeps;
      for (const auto form : {covariance_form::projections, covariance_form::matrix}) {
        policy_spec spec = ea.spec();
        spec.score.expect.form = form;
        check_close(scores_spec(spec, ly.in()), want, 0.0, 5e-6,
                    form == covariance_form::matrix ? "matrix form" : "projections form");
        keeps.push_back(select_spec(spec, b, ly.in()));
      }
      CHECK(keeps[0] == keeps[1]);
      CHECK(ea.spec().score.expect.matrix(m, d, 257) == covariance_as_matrix(m, d, 257));
    }
  CHECK_FALSE(covariance_as_matrix(16, 64, 4096));  // short windows: projections
  CHECK(covariance_as_matrix(2048, 64, 4096));      // long ones (kvpress's whole-prefill statistics): the matrix
}

TEST_CASE("expected attention and value-weighted inf_mllm match their float64 references (values of another width)") {
  std::uint64_t seed = 40;
  for (const dtype t : {dtype::f32, dtype::f16})
    for (const layout l : {layout::nhd, layout::paged})
      for (const std::int32_t group : {1, 3}) {
        const problem p = make_problem(seed++, 90, 2, group, 12, 7, t);
        const layer ly(p);
        const values val(p, 10, t, l, seed++);
        const stored keys = store(p.k, p.n, p.hkv, p.d, t, l);
        keys.visit([&](const auto& k) {
          return val.s.visit([&](const auto& v) {
            using R = std::decay_t<decltype(k)>;
            if constexpr (std::is_same_v<R, std::decay_t<decltype(v)>>) {
              const layer_inputs<R> in{k, v, ly.queries.tensor, p.qpos, p.tokens, 0.f};
              const std::string label = std::string(to_string(t)) + "/" + to_string(l) + "/G=" + std::to_string(group);
              INFO(label);
              for (const auto& ea :
                   {expected_attention{.window = 5, .future = 64, .sinks = 3},
                    expected_attention{
                        .window = 7, .rotary = rope{.theta = 1e6, .style = rope_style::neox}, .future = 3, .sinks = 0},
                    expected_attention{.window = 2, .rotary = std::nullopt, .sinks = 90}}) {
                const auto got = cpu::layer_scores(ea, in);
                check_close(got, ref_expected(p, ea, &val.norms), 2e-4, 2e-6, label + " expected_attention");
                CHECK(cpu::layer_scores(ea, in, cpu::executor{2}).data == got.data);
              }
              const inf_mllm im{.window = 4, .kernel = 3, .bias = {.beta = 0.5}, .value_norm = true};
              check_close(cpu::layer_scores(im, in), ref_inf_mllm(p, im, &val.norms), 2e-4, 2e-6, label + " inf_mllm");
            }
            return 0;
          });
        });
      }
}

TEST_CASE("expected attention does not depend on where the stream stands: shifting every position changes nothing") {
  // Keys and queries given before RoPE, rotated at positions p and at p + 5000: scores agree. Fails
  // when the future positions do not start after the window's queries (a fixed origin) or the
  // queries are turned back by anything but their own positions.
  const problem base = make_problem(77, 60, 2, 2, 16, 6, dtype::f32, false);
  const rope r{.theta = 10000.0};
  const auto rotated = [&](std::int64_t shift) {
    problem p = base;
    const auto turn = [&](std::vector<float>& x, std::int64_t rows, std::int32_t heads, auto pos_of) {
      for (std::int64_t j = 0; j < rows; ++j) {
        const auto m = ref_rotation(r, p.d, double(pos_of(j) + shift));
        for (std::int32_t h = 0; h < heads; ++h) {
          float* row = x.data() + (j * heads + h) * p.d;
          std::vector<double> out(std::size_t(p.d), 0.0);
          for (std::int32_t a = 0; a < p.d; ++a)
            for (std::int32_t b = 0; b < p.d; ++b) out[std::size_t(a)] += m[std::size_t(a * p.d + b)] * row[b];
          for (std::int32_t a = 0; a < p.d; ++a) row[a] = float(out[std::size_t(a)]);
        }
      }
    };
    turn(p.k, p.n, p.hkv, [&](std::int64_t j) { return p.tokens[std::size_t(j)].pos; });
    turn(p.q, p.nq, p.hq, [&](std::int64_t i) { return p.qpos[std::size_t(i)]; });
    for (auto& t : p.tokens) t.pos += shift;
    for (auto& q : p.qpos) q += shift;
    return p;
  };
  const layer a(rotated(0)), b(rotated(5000));
  const expected_attention ea{.window = 6, .rotary = r, .value_norm = false};
  const auto sa = cpu::layer_scores(ea, a.in()), sb = cpu::layer_scores(ea, b.in());
  check_close(sb, ref_expected(a.p, ea), 2e-3, 2e-5, "shifted by 5000 vs the reference at 0");
  check_close(sa, ref_expected(a.p, ea), 2e-4, 2e-6, "at 0");
}

TEST_CASE("expected attention keeps its sinks whatever the budget's sinks, however small their values") {
  // Found by a float64 reference written from kvpress's code: the sinks scored 1 and were then
  // multiplied by |v|, so with budget.sinks below the policy's sinks a sink with a small value
  // vector was evicted (kvpress keeps its n_sink slots). n = 32, d = 16, one KV head, window 28.
  const problem p = make_problem(77, 32, 1, 1, 16, 28, dtype::f32, false);  // slot j at time rank j
  const layer ly(p);
  std::vector<float> v(std::size_t(p.n * 16));
  std::mt19937 gen(78);
  std::normal_distribution<float> normal;
  for (auto& x : v) x = normal(gen);
  for (std::size_t i = 0; i < 4 * 16; ++i) v[i] *= 1e-3f;  // the 4 sinks: tiny values
  layer_inputs<> in = ly.in();
  in.values = nhd(v.data(), dtype::f32, p.n, 1, 16);
  for (const std::int64_t sinks : {0, 2, 4}) {
    CAPTURE(sinks);
    const keep_set keep = cpu::select(expected_attention{.window = 28}, {.capacity = 8, .sinks = sinks}, in);
    REQUIRE(keep.size(0) == 8);
    for (std::int64_t s = 0; s < 4; ++s) CHECK(std::binary_search(keep.unit(0).begin(), keep.unit(0).end(), s));
  }
  CHECK(protect(expected_attention{.sinks = 6}, {.capacity = 8, .sinks = 2}).sinks == 6);
  CHECK_ERROR(cpu::select(expected_attention{.sinks = 6}, {.capacity = 8, .recent = 4}, in),
              "budget.capacity = 8: cannot hold its protected tokens: sinks (6) + recent (4)");
}

TEST_CASE("expected attention and value norms refuse bad input by name") {
  const problem p = make_problem(5, 40, 2, 2, 8, 4);
  const layer ly(p);
  const values val(p, 8, dtype::f32, layout::nhd, 9);
  const budget b{.capacity = 20, .sinks = 4, .recent = 4};
  layer_inputs<> in = ly.in();
  CHECK_ERROR(cpu::select(expected_attention{}, b, in), "layers[0].values.data = null");
  CHECK_ERROR(cpu::select(inf_mllm{.window = 4, .value_norm = true}, b, in), "layers[0].values.data = null");
  in.values = val.s.tensor;
  CHECK_NOTHROW(cpu::select(expected_attention{}, b, in));
  CHECK_ERROR(cpu::select(expected_attention{.future = 0}, b, in), "expected_attention.future = 0");
  CHECK_ERROR(cpu::select(expected_attention{.sinks = -1}, b, in), "expected_attention.sinks = -1");
  CHECK_ERROR(cpu::select(expected_attention{.window = 0}, b, in), "expected_attention.window = 0");
  CHECK_ERROR(cpu::select(expected_attention{.rotary = rope{.dims = 10}}, b, in), "rope.dims = 10");
  CHECK_ERROR(cpu::select(expected_attention{.rotary = rope{.theta = -1}}, b, in), "rope.theta = -1");
  layer_inputs<> narrow = in;
  narrow.values.n_heads = 1;
  CHECK_ERROR(cpu::select(expected_attention{}, b, narrow), "layers[0].values.n_slots");
  std::vector<float> bad = val.v;
  bad[std::size_t((17 * 2 + 1) * 8 + 3)] = std::numeric_limits<float>::quiet_NaN();
  const stored bad_values = store(bad, p.n, p.hkv, 8, dtype::f32, layout::nhd);
  in.values = bad_values.tensor;
  CHECK_ERROR(cpu::select(expected_attention{}, b, in), "values[slot 17, head 1][3] = nan");
  in.values = val.s.tensor;
  std::vector<float> qnan = p.q;
  qnan[5] = std::numeric_limits<float>::infinity();
  const stored bad_q = store(qnan, p.nq, p.hq, p.d, p.type, layout::nhd);
  in.queries = bad_q.tensor;
  CHECK_ERROR(cpu::select(expected_attention{}, b, in), "queries[slot 0, head 0][5] = inf");
  in.queries = ly.queries.tensor;
  CHECK_ERROR(cpu::select(expected_attention{.future = (1 << 20) + 1}, b, in), "expected_attention.future = 1048577");
  // Found by fuzz_select: a query position of 2^63 - 1 overflowed the first future position.
  std::vector<std::int64_t> qpos = p.qpos;
  qpos[2] = std::numeric_limits<std::int64_t>::max();
  in.query_pos = qpos;
  CHECK_ERROR(cpu::select(expected_attention{}, b, in), "query_pos[2] = 9223372036854775807");
  qpos[2] = std::numeric_limits<std::int64_t>::min();
  CHECK_ERROR(cpu::select(expected_attention{}, b, in), "query_pos[2] = -9223372036854775808");
  // Found by a float64 reference of kvpress's press: finite keys or queries near 1e19 (representable
  // in bf16) overflowed the covariance term in f32; the error named "scores[0, 4] = nan" instead of
  // the input. The logits are now computed in double (1e19 keys score), and logits beyond f32 raise
  // naming the key (slot and head) and the queries' largest element.
  in.query_pos = p.qpos;
  const auto slot =
      std::int64_t(std::find_if(p.tokens.begin(), p.tokens.end(), [](const token& t) { return t.pos == 20; }) -
                   p.tokens.begin());  // a slot that is not a sink
  const auto with_key = [&](float value) {
    std::vector<float> k = p.k;
    for (std::int32_t e = 0; e < p.d; ++e) k[std::size_t((slot * p.hkv + 1) * p.d + e)] = value;
    return store(k, p.n, p.hkv, p.d, p.type, layout::nhd);
  };
  for (const auto form : {covariance_form::projections, covariance_form::matrix}) {
    CAPTURE(int(form));
    policy_spec ea = expected_attention{}.spec();
    ea.score.expect.form = form;
    const stored finite_key = with_key(1e19f);
    in.keys = finite_key.tensor;
    CHECK_NOTHROW(select_spec(ea, b, in));
    const stored big_key = with_key(1e30f);
    in.keys = big_key.tensor;
    const std::string at =
        "keys[slot " + std::to_string(slot) + ", head 1]: expected_attention's logit under the window";
    CHECK_ERROR(select_spec(ea, b, in), at.c_str());
    const std::string why = "overflows f32 (largest |element|: keys 1e+30 at slot " + std::to_string(slot);
    CHECK_ERROR(select_spec(ea, b, in), why.c_str());
  }
  in.keys = ly.keys.tensor;
  std::vector<float> big_q = p.q;
  for (const std::int64_t i : {1, 2})
    for (std::int32_t e = 0; e < p.d; ++e) big_q[std::size_t((i * p.hq + 3) * p.d + e)] = 3e38f;
  const stored big_queries = store(big_q, p.nq, p.hq, p.d, p.type, layout::nhd);
  in.queries = big_queries.tensor;
  CHECK_ERROR(cpu::select(expected_attention{}, b, in),
              "queries[slot 1, head 3] (largest |element| 3e+38): the mean and covariance");
  in.queries = ly.queries.tensor;
  // A one-row score (all heads together) has no KV head to take value norms from.
  const policy_spec tova_v{.name = "tova_v",
                           .score = {.source = score_source::last_query, .queries = 1, .value_norm = true}};
  CHECK_ERROR(make_plan(cpu::backend{}, tova_v, b, shape_of(ly.in())), "tova_v.value_norm = true");
}
