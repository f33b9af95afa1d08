// The top-k selector: protected sinks and recent window by position (not by slot), then the
// highest scores; ties to the newer position, then the lower slot; against a brute-force
// reference on random scores full of ties and repeated positions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/infkv.hpp>

#include "test_tokens.hpp"

using namespace infkv;

namespace {

using infkv_test::tokens_at;

score_matrix row_of(std::vector<float> v) {
  score_matrix s(1, std::int64_t(v.size()));
  s.data = std::move(v);
  return s;
}

std::vector<std::int64_t> unit(const keep_set& k, std::int64_t u = 0) { return {k.unit(u).begin(), k.unit(u).end()}; }

/// Brute force: sort slots by (position, slot); protect the first `sinks` and last `recent`;
/// rank the rest by (score desc, position desc, slot asc) and take the best.
std::vector<std::int64_t> naive_select(const std::vector<float>& score, const std::vector<token>& t, std::int64_t cap,
                                       std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(score.size());
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  if (cap >= n) return all;
  std::sort(all.begin(), all.end(), [&](std::int64_t a, std::int64_t b) {
    return t[std::size_t(a)].pos != t[std::size_t(b)].pos ? t[std::size_t(a)].pos < t[std::size_t(b)].pos : a < b;
  });
  std::vector<std::int64_t> kept(all.begin(), all.begin() + sinks), rest(all.begin() + sinks, all.end() - recent);
  kept.insert(kept.end(), all.end() - recent, all.end());
  std::sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t b) {
    const float sa = score[std::size_t(a)], sb = score[std::size_t(b)];
    if (sa != sb) return sa > sb;
    if (t[std::size_t(a)].pos != t[std::size_t(b)].pos) return t[std::size_t(a)].pos > t[std::size_t(b)].pos;
    return a < b;
  });
  kept.insert(kept.end(), rest.begin(), rest.begin() + (cap - std::int64_t(kept.size())));
  std::sort(kept.begin(), kept.end());
  return kept;
}

}  // namespace

TEST_CASE("select_top protects sinks and recent by position when slot order is not time order") {
  // slot:        0    1    2     3    4    5    6    7
  // position:    5    0    7     2    6    1    4    3
  // score:      .9   .1  .05    .8   .2   .3   .7   .6
  const auto t = tokens_at({5, 0, 7, 2, 6, 1, 4, 3});
  const auto s = row_of({.9f, .1f, .05f, .8f, .2f, .3f, .7f, .6f});
  // Sink: position 0 (slot 1); recent: positions 6, 7 (slots 4, 2); best two of the rest: slots 0, 3.
  CHECK(unit(select_top(s, t, budget{.capacity = 5, .sinks = 1, .recent = 2})) ==
        std::vector<std::int64_t>{0, 1, 2, 3, 4});
  // No protection: the five best scores.
  CHECK(unit(select_top(s, t, budget{.capacity = 5})) == std::vector<std::int64_t>{0, 3, 5, 6, 7});
  // Capacity exactly the protected count: nothing else.
  CHECK(unit(select_top(s, t, budget{.capacity = 3, .sinks = 1, .recent = 2})) == std::vector<std::int64_t>{1, 2, 4});
  // Ratio 0.5 of 8 = 4 with 2 sinks (positions 0, 1: slots 1, 5): then slots 0, 3.
  CHECK(unit(select_top(s, t, budget{.ratio = 0.5, .sinks = 2})) == std::vector<std::int64_t>{0, 1, 3, 5});
}

TEST_CASE("select_top breaks ties toward the newer position, then the lower slot") {
  SUBCASE("equal scores: the newest positions win") {
    const auto t = tokens_at({3, 9, 0, 4, 8, 1});
    CHECK(unit(select_top(row_of({1, 1, 1, 1, 1, 1}), t, budget{.capacity = 3})) == std::vector<std::int64_t>{1, 3, 4});
  }
  SUBCASE("equal scores at one position: the lower slot wins") {
    const auto t = tokens_at({1, 2, 1, 0, 1});
    const auto s = row_of({0, 0, 0, 0, 0});
    CHECK(unit(select_top(s, t, budget{.capacity = 2})) == std::vector<std::int64_t>{0, 1});
    CHECK(unit(select_top(s, t, budget{.capacity = 3})) == std::vector<std::int64_t>{0, 1, 2});
    CHECK(unit(select_top(s, t, budget{.capacity = 4})) == std::vector<std::int64_t>{0, 1, 2, 4});
  }
  SUBCASE("a higher score beats a newer position") {
    const auto t = tokens_at({0, 1, 2, 3});
    CHECK(unit(select_top(row_of({2, 1, 1, 1}), t, budget{.capacity = 2})) == std::vector<std::int64_t>{0, 3});
    CHECK(unit(select_top(row_of({1, 1, 1, 1.0000001f}), t, budget{.capacity = 1})) == std::vector<std::int64_t>{3});
    CHECK(unit(select_top(row_of({1.0000001f, 1, 1, 1}), t, budget{.capacity = 1})) == std::vector<std::int64_t>{0});
  }
  SUBCASE("infinities rank like any other score") {
    const float inf = std::numeric_limits<float>::infinity();
    const auto t = tokens_at({0, 1, 2, 3});
    CHECK(unit(select_top(row_of({inf, -inf, 0, -inf}), t, budget{.capacity = 2})) == std::vector<std::int64_t>{0, 2});
    CHECK(unit(select_top(row_of({-inf, -inf, -inf, -inf}), t, budget{.capacity = 2})) ==
          std::vector<std::int64_t>{2, 3});
  }
}

TEST_CASE("select_top matches a brute-force selection on random scores with ties") {
  std::mt19937_64 gen(42);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, 40)(gen);
    std::vector<token> t(static_cast<std::size_t>(n));
    for (auto& x : t) x.pos = std::uniform_int_distribution<std::int64_t>(0, n)(gen);  // repeats
    const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, 3)(gen);
    score_matrix s(rows, n);
    for (auto& v : s.data) v = float(std::uniform_int_distribution<int>(0, 4)(gen));  // many ties
    budget b;
    b.sinks = std::uniform_int_distribution<std::int64_t>(0, 3)(gen);
    b.recent = std::uniform_int_distribution<std::int64_t>(0, 3)(gen);
    if (trial % 2) {
      b.capacity =
          std::uniform_int_distribution<std::int64_t>(b.sinks + b.recent, std::max(b.sinks + b.recent, n + 2))(gen);
      if (b.capacity == 0) b.capacity = 1;
    } else {
      b.ratio = std::uniform_real_distribution<double>(0.0, 1.0)(gen);
      if (b.ratio == 0.0 || std::int64_t(std::ceil(b.ratio * double(n))) - 1 < std::min(n, b.sinks + b.recent)) {
        b.ratio = 1.0;
      }
    }
    CAPTURE(trial);
    CAPTURE(n);
    CAPTURE(b.capacity);
    CAPTURE(b.ratio);
    CAPTURE(b.sinks);
    CAPTURE(b.recent);
    const keep_set k = select_top(s, t, b);
    REQUIRE(k.n_units() == rows);
    CHECK(k == select_top(s, t, b));  // deterministic
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::vector<float> row(s.row(r).begin(), s.row(r).end());
      const auto want = naive_select(row, t, b.keep_count(n), b.sinks, b.recent);
      CHECK(unit(k, r) == want);
      CHECK(std::int64_t(want.size()) == std::min(n, b.keep_count(n)));
    }
  }
}

TEST_CASE("select_top with one token list per unit and with per-row capacities") {
  // Two units over 4 slots: unit 0 sees slot order = time order, unit 1 the reverse.
  const auto t = tokens_at({0, 1, 2, 3, 3, 2, 1, 0});
  score_matrix s(2, 4);
  s.data = {5, 1, 1, 1, 5, 1, 1, 1};
  const auto k = select_top(s, t, budget{.capacity = 2, .recent = 1});
  CHECK(unit(k, 0) == std::vector<std::int64_t>{0, 3});  // recent: slot 3 (position 3)
  // Unit 1: slot 0 holds position 3 (recent); slots 1..3 tie at 1 and the newest, slot 1, wins.
  CHECK(unit(k, 1) == std::vector<std::int64_t>{0, 1});

  const std::int64_t caps[] = {1, 3};
  const auto shared = tokens_at({0, 1, 2, 3});
  const auto kc = select_top(s, shared, caps, 0, 1);
  CHECK(unit(kc, 0) == std::vector<std::int64_t>{3});
  CHECK(unit(kc, 1) == std::vector<std::int64_t>{0, 2, 3});
  const std::int64_t all[] = {4, 9};  // at or above the slot count: keep everything
  const auto ka = select_top(s, shared, all, 2, 2);
  CHECK(ka == keep_set::all(4, 2));
}

TEST_CASE("select_top keeps everything when the budget covers the cache, and handles empty caches") {
  const auto t = tokens_at({4, 2, 0});
  CHECK(select_top(row_of({1, 2, 3}), t, budget{.capacity = 3, .sinks = 1, .recent = 2}) == keep_set::all(3));
  CHECK(select_top(row_of({1, 2, 3}), t, budget{.capacity = 100}) == keep_set::all(3));
  CHECK(select_top(row_of({1, 2, 3}), t, budget{.ratio = 1.0}) == keep_set::all(3));
  const score_matrix empty(2, 0);
  const auto k = select_top(empty, {}, budget{.capacity = 4, .sinks = 2});
  CHECK(k.n_units() == 2);
  CHECK(k.size(0) == 0);
  CHECK(k.size(1) == 0);
}

TEST_CASE("a policy's protect() widens what select_top keeps") {
  const auto t = tokens_at({0, 1, 2, 3, 4, 5, 6, 7});
  const auto s = row_of({8, 7, 6, 5, 4, 3, 2, 1});
  const budget b{.capacity = 4};
  CHECK(unit(select_top(s, t, b)) == std::vector<std::int64_t>{0, 1, 2, 3});
  // SnapKV keeps its observation window: recent becomes 3.
  const auto wide = protect(snapkv{.window = 3}, b);
  CHECK(wide.recent == 3);
  CHECK(unit(select_top(s, t, wide)) == std::vector<std::int64_t>{0, 5, 6, 7});
}
