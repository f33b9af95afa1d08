// Every policy on a cache small enough to work out by hand: 2 KV heads x 6 slots, head_dim 2,
// scale 1, keys (ln w, 0) and (0, ln u) so that the query (1, 0) gives head 0 the probabilities
// w / sum(w) and the query (0, 1) gives head 1 u / sum(u). Slots are shuffled: slot_of[rank] holds
// the token at position `rank`, so every expectation below is written by position and mapped.
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

constexpr std::array<double, 6> w = {1, 2, 1, 4, 1, 1};  // head 0 weights by position
constexpr std::array<double, 6> u = {3, 1, 1, 1, 1, 2};  // head 1 weights by position
constexpr std::array<std::int64_t, 6> slot_of = {4, 0, 5, 2, 1, 3};

struct hand_cache {
  std::vector<float> k = std::vector<float>(6 * 2 * 2, 0.f);  // [slot][head][2]
  std::vector<float> q;                                       // [query][head][2]
  std::vector<token> tokens = std::vector<token>(6);
  std::vector<std::int64_t> qpos;

  /// Queries at the given positions, each (1, 0) for head 0 and (0, 1) for head 1.
  explicit hand_cache(std::vector<std::int64_t> query_pos) : qpos(std::move(query_pos)) {
    for (std::int64_t r = 0; r < 6; ++r) {
      const auto s = std::size_t(slot_of[std::size_t(r)]);
      k[s * 4 + 0] = float(std::log(w[std::size_t(r)]));
      k[s * 4 + 3] = float(std::log(u[std::size_t(r)]));
      tokens[s] = {r, std::int32_t(r / 2), modality::text};
    }
    for (std::size_t i = 0; i < qpos.size(); ++i) q.insert(q.end(), {1.f, 0.f, 0.f, 1.f});
  }
  layer_inputs<> inputs() {
    return {nhd(k.data(), dtype::f32, 6, 2, 2),
            {},
            nhd(q.data(), dtype::f32, std::int64_t(qpos.size()), 2, 2),
            qpos,
            tokens,
            1.f};
  }
};

/// Checks row r of s, given by position, against `want`.
void check_row(const score_matrix& s, std::int64_t r, const std::array<double, 6>& want) {
  CAPTURE(r);
  for (std::int64_t pos = 0; pos < 6; ++pos) {
    CAPTURE(pos);
    CHECK(s(r, slot_of[std::size_t(pos)]) == doctest::Approx(want[std::size_t(pos)]).epsilon(1e-5));
  }
}

/// The sorted slots holding the given positions.
std::vector<std::int64_t> slots_at(std::vector<std::int64_t> positions) {
  std::vector<std::int64_t> s;
  for (auto p : positions) s.push_back(slot_of[std::size_t(p)]);
  std::sort(s.begin(), s.end());
  return s;
}

std::vector<std::int64_t> unit(const keep_set& k, std::int64_t u) { return {k.unit(u).begin(), k.unit(u).end()}; }

// Window of two queries at positions 3 and 5: query 3 sees positions 0..3 only.
// Head 0: [1,2,1,4]/8 + [1,2,1,4,1,1]/10; head 1: [3,1,1,1]/6 + [3,1,1,1,1,2]/9.
constexpr std::array<double, 6> mass0 = {0.125 + 0.1, 0.25 + 0.2, 0.125 + 0.1, 0.5 + 0.4, 0.1, 0.1};
constexpr std::array<double, 6> mass1 = {0.5 + 3 / 9.,    1 / 6. + 1 / 9., 1 / 6. + 1 / 9.,
                                         1 / 6. + 1 / 9., 1 / 9.,          2 / 9.};

}  // namespace

TEST_CASE("hand case: window attention with a causal mask") {
  hand_cache c({3, 5});
  const auto s = cpu::window_attention(c.inputs());
  check_row(s, 0, mass0);
  check_row(s, 1, mass1);
}

TEST_CASE("hand case: GQA averages the group's query heads") {
  hand_cache c({5});
  c.q = {1.f, 0.f, 0.f, 0.f};  // head 0's keys, one query (1, 0) and one (0, 0): uniform
  layer_inputs<> in{
      nhd(c.k.data(), dtype::f32, 6, 1, 2), {}, nhd(c.q.data(), dtype::f32, 1, 2, 2), c.qpos, c.tokens, 1.f};
  in.keys.slot_stride = 4;  // every slot holds two heads; view only the first
  const auto s = cpu::window_attention(in);
  check_row(s, 0,
            {(0.1 + 1 / 6.) / 2, (0.2 + 1 / 6.) / 2, (0.1 + 1 / 6.) / 2, (0.4 + 1 / 6.) / 2, (0.1 + 1 / 6.) / 2,
             (0.1 + 1 / 6.) / 2});
}

TEST_CASE("hand case: snapkv pools along time before its window and keeps the window") {
  hand_cache c({3, 5});
  const snapkv avg{.window = 2, .kernel = 3, .pool = pooling::avg};
  const auto s = cpu::layer_scores(avg, c.inputs());
  const auto& m = mass0;
  // Positions 4 and 5 are the observation window: pooling covers 0..3 only (zero padding at
  // both ends of the prefix), and the window gets the mean pooled score of the rest.
  const std::array<double, 4> pooled = {(m[0] + m[1]) / 3, (m[0] + m[1] + m[2]) / 3, (m[1] + m[2] + m[3]) / 3,
                                        (m[2] + m[3]) / 3};
  const double w = (pooled[0] + pooled[1] + pooled[2] + pooled[3]) / 4;
  check_row(s, 0, {pooled[0], pooled[1], pooled[2], pooled[3], w, w});
  // Capacity 4 with window 2: positions 4 and 5 always, then the best two of 0..3 per head.
  // Head 0 pooled: .225 .300 .525 .375; head 1: .370 .463 .278 .185.
  const auto keep = cpu::select(avg, budget{.capacity = 4}, c.inputs(), granularity::per_head);
  REQUIRE(keep.n_units() == 2);
  CHECK(unit(keep, 0) == slots_at({2, 3, 4, 5}));
  CHECK(unit(keep, 1) == slots_at({0, 1, 4, 5}));
  // Per layer (mean of the heads): .298 .381 .401 .280: positions 2 and 1.
  const auto layer = cpu::select(avg, budget{.capacity = 4}, c.inputs(), granularity::per_layer);
  REQUIRE(layer.n_units() == 1);
  CHECK(unit(layer, 0) == slots_at({1, 2, 4, 5}));

  // Last query only: [.1 .2 .1 .4 .1 .1]; position 5 is the window, max pooling over 0..4.
  const snapkv mx{.window = 1, .kernel = 3, .pool = pooling::max};
  check_row(cpu::layer_scores(mx, c.inputs()), 0, {0.2, 0.2, 0.4, 0.4, 0.4, (0.2 + 0.2 + 0.4 + 0.4 + 0.4) / 5});
}

TEST_CASE("hand case: inf_mllm sums locally before its window, normalises by the mean and adds the recency bias") {
  hand_cache c({3, 5});
  const auto& m = mass0;
  // The retrieval window (positions 4, 5) is left out of the local sum and gets the others' mean.
  const std::array<double, 4> local = {m[0] + m[1], m[0] + m[1] + m[2], m[1] + m[2] + m[3], m[2] + m[3]};
  const double w = (local[0] + local[1] + local[2] + local[3]) / 4;
  const std::array<double, 6> sum = {local[0], local[1], local[2], local[3], w, w};
  const double mean = (sum[0] + sum[1] + sum[2] + sum[3] + sum[4] + sum[5]) / 6;
  inf_mllm p{.window = 2, .kernel = 3, .pool = pooling::sum, .bias = {}};
  check_row(cpu::layer_scores(p, c.inputs()), 0, sum);
  const budget three{.capacity = 3};
  // Without bias: the window (4, 5) and the largest local sum of 0..3: position 2 (1.575).
  CHECK(unit(cpu::select(p, three, c.inputs()), 0) == slots_at({2, 4, 5}));

  p.bias = {.beta = 3.0, .shape = decay::linear};  // f = pos / 5
  std::array<double, 6> biased{};
  for (std::size_t i = 0; i < 6; ++i) biased[i] = sum[i] / mean + 3.0 * double(i) / 5;
  check_row(cpu::layer_scores(p, c.inputs()), 0, biased);
  // 0.63 1.44 2.67 2.85 ...: the choice moves to the newer position 3.
  CHECK(unit(cpu::select(p, three, c.inputs()), 0) == slots_at({3, 4, 5}));

  p.bias = {.beta = 0.5, .shape = decay::exponential, .unit = age_unit::segments, .rate = 4.0};
  const double mid = (std::exp(-2.0) - std::exp(-4.0)) / (1 - std::exp(-4.0));  // segment 1: age 1/2
  const std::array<double, 6> f = {0, 0, mid, mid, 1, 1};
  for (std::size_t i = 0; i < 6; ++i) biased[i] = sum[i] / mean + 0.5 * f[i];
  check_row(cpu::layer_scores(p, c.inputs()), 0, biased);
}

TEST_CASE("hand case: tova keeps the slots the last query attends to, averaged over heads") {
  hand_cache c({3, 5});
  const auto s = cpu::layer_scores(tova{}, c.inputs());
  REQUIRE(s.rows == 1);
  const std::array<double, 6> want = {(0.1 + 3 / 9.) / 2, (0.2 + 1 / 9.) / 2, (0.1 + 1 / 9.) / 2,
                                      (0.4 + 1 / 9.) / 2, (0.1 + 1 / 9.) / 2, (0.1 + 2 / 9.) / 2};
  check_row(s, 0, want);
  // .217 .156 .106 .256 .106 .161: top three are positions 3, 0, 5.
  const auto keep = cpu::select(tova{}, budget{.capacity = 3}, c.inputs(), granularity::per_head);
  REQUIRE(keep.n_units() == 1);
  CHECK(unit(keep, 0) == slots_at({0, 3, 5}));
}

TEST_CASE("hand case: keydiff scores by angle to the mean unit key, not by length") {
  // One head, d = 2: keys (2,0), (0,1), (0,3), (1,1), (0,4), (-1,0); unit keys (1,0), (0,1) x3,
  // (r,r), (-1,0) with r = 1/sqrt(2): anchor = (r, 3 + r) / 6.
  std::vector<float> k = {2, 0, 0, 1, 0, 3, 1, 1, 0, 4, -1, 0};
  const auto view = nhd(k.data(), dtype::f32, 6, 1, 2);
  const double r = 1 / std::sqrt(2.0);
  const double ax = r / 6, ay = (3 + r) / 6, an = std::hypot(ax, ay);
  const auto s = cpu::keydiff_scores(view);
  const double want[] = {-ax / an, -ay / an, -ay / an, -(ax + ay) * r / an, -ay / an, ax / an};
  for (std::int64_t j = 0; j < 6; ++j) CHECK(s(0, j) == doctest::Approx(want[j]).epsilon(1e-5));
  // Ranking: (-1,0) .19, (1,0) -.19, (1,1) -.83, then the three (0,y) keys tied at -.98, of
  // which the newest (position 4) wins.
  const auto tokens = text_tokens(6);
  const layer_inputs<> in{view, {}, {}, {}, tokens, 0.f};
  CHECK(unit(cpu::select(keydiff{}, budget{.capacity = 2}, in), 0) == std::vector<std::int64_t>{0, 5});
  CHECK(unit(cpu::select(keydiff{}, budget{.capacity = 3}, in), 0) == std::vector<std::int64_t>{0, 3, 5});
  CHECK(unit(cpu::select(keydiff{}, budget{.capacity = 4}, in), 0) == std::vector<std::int64_t>{0, 3, 4, 5});
  CHECK(unit(cpu::select(keydiff{}, budget{.capacity = 4, .sinks = 2}, in), 0) ==
        std::vector<std::int64_t>{0, 1, 3, 5});
}

TEST_CASE("hand case: h2o sums steps, forgets old mass and normalises by lifetime") {
  hand_cache step1({3}), step2({5});
  const std::array<double, 6> p1 = {0.125, 0.25, 0.125, 0.5, 0, 0}, p2 = {0.1, 0.2, 0.1, 0.4, 0.1, 0.1};
  SUBCASE("plain running sum, then heavy hitters + recent") {
    cpu::h2o_state st(h2o{}, 2);
    st.append(6);
    cpu::observe(st, step1.inputs());
    cpu::observe(st, step2.inputs());
    check_row(st.scores(), 0, mass0);
    check_row(st.scores(), 1, mass1);
    // Recent 1 keeps position 5; heavy hitters: head 0 positions 3 and 1; head 1 position 0, then
    // positions 1..3 tie exactly at 1/6 + 1/9 (equal logits) and the newest, 3, wins.
    const auto keep = cpu::select(h2o{}, budget{.capacity = 3, .recent = 1}, st.attach(step2.inputs()));
    REQUIRE(keep.n_units() == 2);
    CHECK(unit(keep, 0) == slots_at({1, 3, 5}));
    CHECK(unit(keep, 1) == slots_at({0, 3, 5}));
  }
  SUBCASE("forgetting factor 0.5") {
    cpu::h2o_state st(h2o{.forgetting = 0.5}, 2);
    st.append(6);
    cpu::observe(st, step1.inputs());
    cpu::observe(st, step2.inputs());
    std::array<double, 6> want{};
    for (std::size_t i = 0; i < 6; ++i) want[i] = 0.5 * p1[i] + p2[i];
    check_row(st.scores(), 0, want);
  }
  SUBCASE("lifetime: positions 4 and 5 were seen by one query, the rest by two") {
    cpu::h2o_state st(h2o{.normalize_lifetime = true}, 2);
    st.append(6);
    cpu::observe(st, step1.inputs());
    cpu::observe(st, step2.inputs());
    check_row(st.scores(), 0, {mass0[0] / 2, mass0[1] / 2, mass0[2] / 2, mass0[3] / 2, mass0[4], mass0[5]});
  }
}

TEST_CASE("hand case: streaming_llm keeps the sinks and the newest positions") {
  hand_cache c({5});
  const auto keep = cpu::select(streaming_llm{}, budget{.capacity = 4, .sinks = 1, .recent = 2}, c.inputs());
  REQUIRE(keep.n_units() == 1);
  CHECK(unit(keep, 0) == slots_at({0, 3, 4, 5}));
  // Window without sinks: the four newest.
  CHECK(unit(cpu::select(streaming_llm{}, budget{.capacity = 4}, c.inputs()), 0) == slots_at({2, 3, 4, 5}));
}
