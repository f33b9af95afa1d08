// Attention bias (DESIGN.md section 4): in a multi-round synthetic stream, plain window scoring
// stays on the first round's attention saddles; with the bias the cache moves to the current
// round's saddles.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

constexpr std::int32_t dim = 32;
constexpr std::int64_t rounds = 4, round_len = 512, block = 64, saddles_per_round = 40;

/// A stream of `rounds` rounds (segment = round). Round r has a query direction u_r (basis vector
/// r + 1) mixed with a direction c shared by every round (basis vector 0); its saddle keys align
/// with u_r. The first round's saddles are longer and also point along c, so every later round's
/// queries keep giving them somewhat more attention than their own round's saddles get.
struct stream {
  std::vector<float> keys, queries;  // [rounds * round_len][dim]
  std::vector<token> tokens;
  std::vector<std::int32_t> saddle_round;  // per token: its round if it is a saddle, else -1

  stream() {
    std::mt19937 rng(61);
    std::normal_distribution<float> key_noise(0.f, 0.5f), query_noise(0.f, 0.2f), saddle_noise(0.f, 0.1f);
    const std::int64_t n = rounds * round_len;
    keys.resize(static_cast<std::size_t>(n * dim));
    queries.resize(static_cast<std::size_t>(n * dim));
    saddle_round.assign(static_cast<std::size_t>(n), -1);
    for (std::int64_t r = 0; r < rounds; ++r) {
      // saddles: spread over the round, away from its first sink positions
      std::vector<std::int64_t> picks;
      while (std::int64_t(picks.size()) < saddles_per_round) {
        const std::int64_t t = r * round_len + 8 + std::int64_t(rng() % (round_len - 8));
        if (saddle_round[std::size_t(t)] < 0) saddle_round[std::size_t(t)] = std::int32_t(r), picks.push_back(t);
      }
    }
    for (std::int64_t t = 0; t < n; ++t) {
      const auto r = t / round_len;
      tokens.push_back({t, std::int32_t(r), modality::text});
      float* k = keys.data() + t * dim;
      float* q = queries.data() + t * dim;
      for (std::int32_t e = 0; e < dim; ++e) q[e] = query_noise(rng);
      q[0] += 4.f, q[r + 1] += 4.f;
      if (saddle_round[std::size_t(t)] < 0) {
        for (std::int32_t e = 0; e < dim; ++e) k[e] = key_noise(rng);
      } else {
        for (std::int32_t e = 0; e < dim; ++e) k[e] = saddle_noise(rng);
        if (r == 0)
          k[0] += 8.2f, k[1] += 2.f;  // |k| ~ 8.4, along c and u_0
        else
          k[r + 1] += 7.07f;  // |k| ~ 7.1, along u_r only
      }
    }
  }
};

/// Saddles of each round held by the cache at the end of every round.
using census = std::array<std::array<std::int64_t, rounds>, rounds>;

/// Streams `s` through a cache of `capacity` slots, evicting after every block of 64 tokens with
/// the Inf-MLLM-style policy `p`; the retrieval window holds the block's last queries.
census run(const stream& s, const inf_mllm& p, const budget& b) {
  std::vector<float> cache(static_cast<std::size_t>((b.capacity + block) * dim));
  std::vector<token> cached;
  census out{};
  for (std::int64_t t0 = 0; t0 < rounds * round_len; t0 += block) {
    const auto n0 = std::int64_t(cached.size());
    std::copy(s.keys.begin() + t0 * dim, s.keys.begin() + (t0 + block) * dim, cache.begin() + n0 * dim);
    cached.insert(cached.end(), s.tokens.begin() + t0, s.tokens.begin() + t0 + block);
    const auto n = std::int64_t(cached.size());
    if (n > b.capacity) {
      const std::int64_t first_q = t0 + block - p.window;
      std::vector<std::int64_t> qpos;
      for (std::int64_t i = first_q; i < t0 + block; ++i) qpos.push_back(i);
      const tensor_view keys = nhd(cache.data(), dtype::f32, n, 1, dim);
      layer_inputs<> in{.keys = keys,
                        .queries = nhd(s.queries.data() + first_q * dim, dtype::f32, p.window, 1, dim),
                        .query_pos = qpos,
                        .tokens = cached};
      const auto keep = cpu::select(p, b, in);
      kv_view kv{keys, {}};
      const auto m = cpu::compact(kv, cached, keep);
      cached.resize(std::size_t(m));
      REQUIRE(m == b.capacity);
    }
    if ((t0 + block) % round_len == 0) {
      const auto r = (t0 + block) / round_len - 1;
      for (const auto& t : cached)
        if (const auto sr = s.saddle_round[std::size_t(t.pos)]; sr >= 0) ++out[std::size_t(r)][std::size_t(sr)];
    }
  }
  return out;
}

std::int64_t later(const std::array<std::int64_t, rounds>& held) {
  std::int64_t sum = 0;
  for (std::int64_t r = 1; r < rounds; ++r) sum += held[std::size_t(r)];
  return sum;
}

/// The census as text, one line per round end.
std::string describe(const std::string& name, const census& c) {
  std::ostringstream os;
  for (std::int64_t r = 0; r < rounds; ++r) {
    os << name << ": end of round " << r + 1 << ", saddles held per round:";
    for (auto held : c[std::size_t(r)]) os << ' ' << held;
    os << '\n';
  }
  return os.str();
}

const budget cache_budget{.capacity = 64, .sinks = 4, .recent = 16};

}  // namespace

TEST_CASE("attention bias: without it the cache stays on round 1's saddles, with it it moves on") {
  const stream s;
  const inf_mllm plain{.window = 16, .kernel = 1};  // no pooling: each saddle counts on its own
  const auto none = run(s, plain, cache_budget);
  INFO(describe("beta 0", none));
  const auto& end_none = none[rounds - 1];
  CHECK(end_none[0] >= saddles_per_round * 7 / 8);  // still on round 1's saddles
  CHECK(later(end_none) <= saddles_per_round / 4);  // few of the later rounds'

  census tuned_positions{};
  for (age_unit unit : {age_unit::positions, age_unit::segments}) {
    CAPTURE(int(unit));
    inf_mllm biased = plain;
    biased.bias = {.beta = 10.0, .shape = decay::linear, .unit = unit};
    const auto with = run(s, biased, cache_budget);
    INFO(describe(unit == age_unit::positions ? "beta 10, positions" : "beta 10, segments", with));
    if (unit == age_unit::positions) tuned_positions = with;
    const auto& end = with[rounds - 1];
    CHECK(end[0] <= saddles_per_round / 8);               // round 1's saddles let go
    CHECK(end[rounds - 1] >= saddles_per_round * 7 / 8);  // the current round's held
    CHECK(end[rounds - 1] >= 4 * end_none[rounds - 1]);
    for (std::int64_t r = 1; r < rounds; ++r) {  // at the end of every later round
      CHECK(with[std::size_t(r)][std::size_t(r)] > with[std::size_t(r)][0]);
      if (r >= 2) CHECK(with[std::size_t(r)][std::size_t(r)] >= saddles_per_round * 3 / 4);
    }
  }

  // the bias steers, it does not replace attention: far too strong a decay over positions turns
  // the cache into a recent window that holds fewer of the current round's saddles
  inf_mllm overwhelmed = plain;
  overwhelmed.bias = {.beta = 100.0, .shape = decay::linear, .unit = age_unit::positions};
  const auto strong = run(s, overwhelmed, cache_budget);
  INFO(describe("beta 100, positions", strong));
  CHECK(strong[rounds - 1][rounds - 1] < tuned_positions[rounds - 1][rounds - 1] * 3 / 4);
}

TEST_CASE("attention bias: beta 0 leaves scores alone, otherwise rows are normalised and aged") {
  score_matrix m(2, 4);
  const std::vector<float> row0{1.f, 3.f, 0.f, 4.f}, row1{2.f, 2.f, 2.f, 2.f};
  std::copy(row0.begin(), row0.end(), m.row(0).begin());
  std::copy(row1.begin(), row1.end(), m.row(1).begin());
  // slot order is not time order: positions 30, 10, 20, 40; segments 2, 0, 1, 3
  const std::vector<token> t{
      {30, 2, modality::video}, {10, 0, modality::video}, {20, 1, modality::video}, {40, 3, modality::video}};
  auto same = m;
  cpu::apply_bias(attention_bias{}, same, t);
  CHECK(same.data == m.data);

  auto lin = m;  // mean of row 0 is 2, of row 1 is 2; ages (40 - pos) / 30
  cpu::apply_bias(attention_bias{.beta = 3.0}, lin, t);
  const std::vector<double> f{2.0 / 3, 0.0, 1.0 / 3, 1.0};
  for (std::size_t c = 0; c < 4; ++c) {
    CHECK(lin(0, std::int64_t(c)) == doctest::Approx(row0[c] / 2.0 + 3.0 * f[c]));
    CHECK(lin(1, std::int64_t(c)) == doctest::Approx(1.0 + 3.0 * f[c]));
  }
  auto seg = m;  // segments 2, 0, 1, 3 give the same ages here
  cpu::apply_bias(attention_bias{.beta = 3.0, .unit = age_unit::segments}, seg, t);
  CHECK(seg.data == lin.data);

  auto ranked = m;  // ranks 2, 0, 1, 3 of the positions: the same ages again
  cpu::apply_bias(attention_bias{.beta = 3.0, .unit = age_unit::ranks}, ranked, t);
  CHECK(ranked.data == lin.data);

  auto ex = m;  // exponential: f(0) = 1, f(1) = 0, in between below the linear ramp
  cpu::apply_bias(attention_bias{.beta = 1.0, .shape = decay::exponential, .rate = 4.0}, ex, t);
  CHECK(ex(1, 3) == doctest::Approx(2.0));
  CHECK(ex(1, 1) == doctest::Approx(1.0));
  CHECK(ex(1, 0) > 1.0);
  CHECK(ex(1, 0) < 1.0 + 2.0 / 3);

  CHECK_THROWS_WITH_AS(cpu::apply_bias(attention_bias{.beta = -1.0}, ex, t), doctest::Contains("bias.beta = -1"),
                       error);
  const attention_bias flat{.beta = 1.0, .rate = 0.0};
  CHECK_THROWS_WITH_AS(cpu::apply_bias(flat, ex, t), doctest::Contains("bias.rate = 0"), error);
}

TEST_CASE("attention bias: ages in ranks do not fade as kept positions grow apart") {
  // keep mode after a long stream: sinks at 0 and 1, the rest far later; two slots share position 5000
  const std::vector<token> t{{0, 0, modality::text},     {1, 0, modality::text},    {5000, 0, modality::image},
                             {5000, 0, modality::image}, {5001, 0, modality::text}, {5003, 0, modality::text}};
  score_matrix zero(1, 6);  // all scores 0: only the bias is left (the row mean is 0, kept as is)
  auto by_pos = zero, by_rank = zero;
  cpu::apply_bias(attention_bias{.beta = 1.0}, by_pos, t);
  cpu::apply_bias(attention_bias{.beta = 1.0, .unit = age_unit::ranks}, by_rank, t);
  // positions: every non-sink slot is within 3 / 5003 of the newest, so the bias hardly separates them
  CHECK(by_pos(0, 2) > 0.999f);
  // ranks: distinct positions 0, 1, 5000, 5001, 5003 -> ages 4, 3, 2, 1, 0 of 4
  const std::vector<float> expect{0.f, 0.25f, 0.5f, 0.5f, 0.75f, 1.f};
  for (std::int64_t c = 0; c < 6; ++c) CHECK(by_rank(0, c) == doctest::Approx(expect[std::size_t(c)]));
}
