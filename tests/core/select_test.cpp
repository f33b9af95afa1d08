// The top-k selector: protected sinks and recent window by position (not by slot), then the
// highest scores; ties to the newer position, then the lower slot; against a brute-force
// reference on random scores full of ties and repeated positions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu/select.hpp>
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
  CHECK(unit(cpu::select_top(s, t, budget{.capacity = 5, .sinks = 1, .recent = 2})) ==
        std::vector<std::int64_t>{0, 1, 2, 3, 4});
  // No protection: the five best scores.
  CHECK(unit(cpu::select_top(s, t, budget{.capacity = 5})) == std::vector<std::int64_t>{0, 3, 5, 6, 7});
  // Capacity exactly the protected count: nothing else.
  CHECK(unit(cpu::select_top(s, t, budget{.capacity = 3, .sinks = 1, .recent = 2})) ==
        std::vector<std::int64_t>{1, 2, 4});
  // Ratio 0.5 of 8 = 4 with 2 sinks (positions 0, 1: slots 1, 5): then slots 0, 3.
  CHECK(unit(cpu::select_top(s, t, budget{.ratio = 0.5, .sinks = 2})) == std::vector<std::int64_t>{0, 1, 3, 5});
}

TEST_CASE("select_top breaks ties toward the newer position, then the lower slot") {
  SUBCASE("equal scores: the newest positions win") {
    const auto t = tokens_at({3, 9, 0, 4, 8, 1});
    CHECK(unit(cpu::select_top(row_of({1, 1, 1, 1, 1, 1}), t, budget{.capacity = 3})) ==
          std::vector<std::int64_t>{1, 3, 4});
  }
  SUBCASE("equal scores at one position: the lower slot wins") {
    const auto t = tokens_at({1, 2, 1, 0, 1});
    const auto s = row_of({0, 0, 0, 0, 0});
    CHECK(unit(cpu::select_top(s, t, budget{.capacity = 2})) == std::vector<std::int64_t>{0, 1});
    CHECK(unit(cpu::select_top(s, t, budget{.capacity = 3})) == std::vector<std::int64_t>{0, 1, 2});
    CHECK(unit(cpu::select_top(s, t, budget{.capacity = 4})) == std::vector<std::int64_t>{0, 1, 2, 4});
  }
  SUBCASE("a higher score beats a newer position") {
    const auto t = tokens_at({0, 1, 2, 3});
    CHECK(unit(cpu::select_top(row_of({2, 1, 1, 1}), t, budget{.capacity = 2})) == std::vector<std::int64_t>{0, 3});
    CHECK(unit(cpu::select_top(row_of({1, 1, 1, 1.0000001f}), t, budget{.capacity = 1})) ==
          std::vector<std::int64_t>{3});
    CHECK(unit(cpu::select_top(row_of({1.0000001f, 1, 1, 1}), t, budget{.capacity = 1})) ==
          std::vector<std::int64_t>{0});
  }
  SUBCASE("infinities rank like any other score") {
    const float inf = std::numeric_limits<float>::infinity();
    const auto t = tokens_at({0, 1, 2, 3});
    CHECK(unit(cpu::select_top(row_of({inf, -inf, 0, -inf}), t, budget{.capacity = 2})) ==
          std::vector<std::int64_t>{0, 2});
    CHECK(unit(cpu::select_top(row_of({-inf, -inf, -inf, -inf}), t, budget{.capacity = 2})) ==
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
    const keep_set k = cpu::select_top(s, t, b);
    REQUIRE(k.n_units() == rows);
    CHECK(k == cpu::select_top(s, t, b));  // deterministic
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
  const auto k = cpu::select_top(s, t, budget{.capacity = 2, .recent = 1});
  CHECK(unit(k, 0) == std::vector<std::int64_t>{0, 3});  // recent: slot 3 (position 3)
  // Unit 1: slot 0 holds position 3 (recent); slots 1..3 tie at 1 and the newest, slot 1, wins.
  CHECK(unit(k, 1) == std::vector<std::int64_t>{0, 1});

  const std::int64_t caps[] = {1, 3};
  const auto shared = tokens_at({0, 1, 2, 3});
  const auto kc = cpu::select_top(s, shared, caps, 0, 1);
  CHECK(unit(kc, 0) == std::vector<std::int64_t>{3});
  CHECK(unit(kc, 1) == std::vector<std::int64_t>{0, 2, 3});
  const std::int64_t all[] = {4, 9};  // at or above the slot count: keep everything
  const auto ka = cpu::select_top(s, shared, all, 2, 2);
  CHECK(ka == keep_set::all(4, 2));
}

TEST_CASE("select_top keeps everything when the budget covers the cache, and handles empty caches") {
  const auto t = tokens_at({4, 2, 0});
  CHECK(cpu::select_top(row_of({1, 2, 3}), t, budget{.capacity = 3, .sinks = 1, .recent = 2}) == keep_set::all(3));
  CHECK(cpu::select_top(row_of({1, 2, 3}), t, budget{.capacity = 100}) == keep_set::all(3));
  CHECK(cpu::select_top(row_of({1, 2, 3}), t, budget{.ratio = 1.0}) == keep_set::all(3));
  const score_matrix empty(2, 0);
  const auto k = cpu::select_top(empty, {}, budget{.capacity = 4, .sinks = 2});
  CHECK(k.n_units() == 2);
  CHECK(k.size(0) == 0);
  CHECK(k.size(1) == 0);
}

TEST_CASE("a policy's protect() widens what select_top keeps") {
  const auto t = tokens_at({0, 1, 2, 3, 4, 5, 6, 7});
  const auto s = row_of({8, 7, 6, 5, 4, 3, 2, 1});
  const budget b{.capacity = 4};
  CHECK(unit(cpu::select_top(s, t, b)) == std::vector<std::int64_t>{0, 1, 2, 3});
  // SnapKV keeps its observation window: recent becomes 3.
  const auto wide = protect(snapkv{.window = 3}, b);
  CHECK(wide.recent == 3);
  CHECK(unit(cpu::select_top(s, t, wide)) == std::vector<std::int64_t>{0, 5, 6, 7});
}

namespace {

/// Whole positions by brute force (long double means): protect every position holding one of the
/// first `sinks` or last `recent` slots in time order, then repeatedly add the position group with
/// the highest mean (the newer on equal means) among those that still fit `cap`.
std::vector<std::int64_t> naive_whole(const std::vector<float>& score, const std::vector<token>& t, std::int64_t cap,
                                      std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(t.size());
  std::vector<std::int64_t> by_time(static_cast<std::size_t>(n));
  std::iota(by_time.begin(), by_time.end(), std::int64_t{0});
  std::stable_sort(by_time.begin(), by_time.end(),
                   [&](std::int64_t a, std::int64_t b) { return t[std::size_t(a)].pos < t[std::size_t(b)].pos; });
  std::vector<std::int64_t> positions;
  for (auto s : by_time)
    if (positions.empty() || positions.back() != t[std::size_t(s)].pos) positions.push_back(t[std::size_t(s)].pos);
  std::vector<bool> taken(positions.size(), false);
  std::int64_t held = 0;
  const auto members = [&](std::int64_t p) {
    std::vector<std::int64_t> m;
    for (std::int64_t s = 0; s < n; ++s)
      if (t[std::size_t(s)].pos == p) m.push_back(s);
    return m;
  };
  for (std::int64_t i = 0; i < n; ++i)
    if (i < sinks || i >= n - recent || cap >= n) {
      const auto g =
          std::size_t(std::find(positions.begin(), positions.end(), t[std::size_t(by_time[std::size_t(i)])].pos) -
                      positions.begin());
      if (!taken[g]) taken[g] = true, held += std::int64_t(members(positions[g]).size());
    }
  for (;;) {
    std::optional<std::size_t> best;
    long double best_mean = 0;
    for (std::size_t g = 0; g < positions.size(); ++g) {
      if (taken[g]) continue;
      const auto m = members(positions[g]);
      if (held + std::int64_t(m.size()) > cap) continue;
      long double sum = 0;
      for (auto s : m) sum += score[std::size_t(s)];
      const long double mean = sum / (long double)(m.size());
      if (!best || mean > best_mean || (mean == best_mean && positions[g] > positions[*best]))
        best = g, best_mean = mean;
    }
    if (!best) break;
    taken[*best] = true;
    held += std::int64_t(members(positions[*best]).size());
  }
  std::vector<std::int64_t> kept;
  for (std::int64_t s = 0; s < n; ++s)
    if (taken[std::size_t(std::find(positions.begin(), positions.end(), t[std::size_t(s)].pos) - positions.begin())])
      kept.push_back(s);
  return kept;
}

}  // namespace

TEST_CASE("select_whole_positions keeps or drops each position whole, as a brute-force reference does") {
  std::mt19937_64 rng(23);
  for (int trial = 0; trial < 400; ++trial) {
    // Text tokens (one position each) and images (one position for many tokens), in shuffled slot order.
    std::vector<token> t;
    std::int64_t pos = 0;
    while (std::int64_t(t.size()) < 20 + std::int64_t(rng() % 60)) {
      const std::int64_t run = rng() % 4 == 0 ? 2 + std::int64_t(rng() % 12) : 1;
      for (std::int64_t i = 0; i < run; ++i) t.push_back({pos, 0, run > 1 ? modality::image : modality::text});
      pos += run > 1 ? 1 + std::int64_t(rng() % 3) : 1;
    }
    std::shuffle(t.begin(), t.end(), rng);
    const auto n = std::int64_t(t.size());
    std::vector<float> score(t.size());
    for (auto& s : score) s = float(int(rng() % 7)) * 0.5f;  // many equal scores and means
    const std::int64_t sinks = std::int64_t(rng() % 4), recent = std::int64_t(rng() % 4);
    const std::int64_t cap = std::int64_t(rng() % std::uint64_t(n + 4));
    // The protected groups alone (the reference with no room for anything else) predict the error.
    const auto protected_only = naive_whole(score, t, 0, sinks, recent);
    CAPTURE(trial);
    CAPTURE(cap);
    if (cap < n && std::int64_t(protected_only.size()) > cap) {
      const std::string what = "cap = " + std::to_string(cap);
      CHECK_THROWS_WITH_AS(cpu::select_whole_positions(score, t, cap, sinks, recent), doctest::Contains(what.c_str()),
                           infkv::error);
      continue;
    }
    const auto got = unit(cpu::select_whole_positions(score, t, cap, sinks, recent));
    CHECK(got == naive_whole(score, t, cap, sinks, recent));
    CHECK(std::int64_t(got.size()) <= std::min(cap, n));
    // Every position whole: a kept position keeps all of its slots.
    for (std::size_t a = 0; a < t.size(); ++a)
      for (std::size_t b = 0; b < t.size(); ++b)
        if (t[a].pos == t[b].pos)
          CHECK((std::ranges::binary_search(got, std::int64_t(a)) == std::ranges::binary_search(got, std::int64_t(b))));
  }
}

TEST_CASE("select_whole_positions and select_whole_segments equal select_top when every group is one slot") {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const std::int64_t n = 1 + std::int64_t(rng() % 50);
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    std::iota(p.begin(), p.end(), std::int64_t{3});
    std::shuffle(p.begin(), p.end(), rng);
    const auto t = tokens_at(p);
    std::vector<float> score(t.size());
    for (auto& s : score) s = rng() % 3 == 0 ? -0.f : float(int(rng() % 5)) - 2.f;  // ties, and -0 against +0
    const std::int64_t sinks = std::int64_t(rng() % 3), recent = std::int64_t(rng() % 3);
    const std::int64_t cap = sinks + recent + std::int64_t(rng() % std::uint64_t(n + 1));
    const std::vector<std::int64_t> caps{cap};
    CAPTURE(trial);
    const auto top = unit(cpu::select_top(row_of(score), t, caps, sinks, recent));
    CHECK(unit(cpu::select_whole_positions(score, t, cap, sinks, recent)) == top);
    auto own = t;  // one segment per slot
    for (auto& x : own) x.segment = std::int32_t(x.pos);
    CHECK(unit(cpu::select_whole_segments(score, own, cap, sinks, recent)) == top);
  }
}

TEST_CASE("select_whole_positions skips an image that does not fit and fills with text") {
  // Positions: text 0..3, an image of 5 tokens at 4, text 5..7. Budget 6 with 1 sink and 1 recent.
  std::vector<token> t = tokens_at({0, 1, 2, 3, 4, 4, 4, 4, 4, 5, 6, 7});
  std::vector<float> s{0, 1, 2, 3, 9, 9, 9, 9, 9, 4, 5, 0};
  // The image scores best but needs 5 of the 4 slots left after the sink (0) and the recent (7).
  CHECK(unit(cpu::select_whole_positions(s, t, 6, 1, 1)) == std::vector<std::int64_t>{0, 2, 3, 9, 10, 11});
  // With room for it, the image goes in whole and the best text fills the rest.
  CHECK(unit(cpu::select_whole_positions(s, t, 8, 1, 1)) == std::vector<std::int64_t>{0, 4, 5, 6, 7, 8, 10, 11});
  // A recent window reaching into the image protects all of it; a budget below that is refused.
  CHECK(unit(cpu::select_whole_positions(s, t, 9, 0, 4)) == std::vector<std::int64_t>{3, 4, 5, 6, 7, 8, 9, 10, 11});
  CHECK_THROWS_WITH_AS(cpu::select_whole_positions(s, t, 7, 0, 4), doctest::Contains("cap = 7"), infkv::error);
  s[6] = std::nanf("");
  CHECK_THROWS_WITH_AS(cpu::select_whole_positions(s, t, 9, 0, 4), doctest::Contains("score[6] = nan"), infkv::error);
  CHECK_THROWS_WITH_AS(cpu::select_whole_positions(std::vector<float>(3, 0.f), t, 9, 0, 4),
                       doctest::Contains("score.size() = 3"), infkv::error);
}

namespace {

/// The brute-force reference of select_whole_segments: protected slots by rank in time order
/// (position, then slot), then repeatedly the unprotected segment of highest mean (long double;
/// newer segment on a tie) among those whose remaining slots still fit, then the best single
/// slots (higher score, newer position, lower slot) until `cap`.
std::vector<std::int64_t> naive_segments(const std::vector<float>& score, const std::vector<token>& t, std::int64_t cap,
                                         std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(t.size());
  std::vector<std::int64_t> by_time(static_cast<std::size_t>(n));
  std::iota(by_time.begin(), by_time.end(), std::int64_t{0});
  std::sort(by_time.begin(), by_time.end(), [&](std::int64_t a, std::int64_t b) {
    return t[std::size_t(a)].pos != t[std::size_t(b)].pos ? t[std::size_t(a)].pos < t[std::size_t(b)].pos : a < b;
  });
  std::vector<bool> keep(static_cast<std::size_t>(n), cap >= n), guarded(static_cast<std::size_t>(n), false);
  std::int64_t held = cap >= n ? n : 0;
  for (std::int64_t r = 0; r < n && cap < n; ++r)
    if (r < sinks || r >= n - recent)
      keep[std::size_t(by_time[std::size_t(r)])] = guarded[std::size_t(by_time[std::size_t(r)])] = true, ++held;
  std::set<std::int32_t> segments;
  for (const auto& x : t) segments.insert(x.segment);
  std::set<std::int32_t> done;
  while (cap < n) {
    std::optional<std::int32_t> best;
    long double best_mean = 0;
    std::int64_t best_newest = 0;
    for (const auto seg : segments) {
      if (done.contains(seg)) continue;
      long double sum = 0;
      std::int64_t size = 0, newest = -1;
      for (std::int64_t s = 0; s < n; ++s)
        if (t[std::size_t(s)].segment == seg && !guarded[std::size_t(s)])
          sum += score[std::size_t(s)], ++size, newest = std::max(newest, t[std::size_t(s)].pos);
      if (size == 0 || held + size > cap) continue;
      const long double mean = sum / (long double)size;
      if (!best || mean > best_mean || (mean == best_mean && newest > best_newest))
        best = seg, best_mean = mean, best_newest = newest;
    }
    if (!best) break;
    done.insert(*best);
    for (std::int64_t s = 0; s < n; ++s)
      if (t[std::size_t(s)].segment == *best && !guarded[std::size_t(s)]) keep[std::size_t(s)] = true, ++held;
  }
  while (held < std::min(cap, n)) {
    std::int64_t best = -1;
    for (std::int64_t s = 0; s < n; ++s) {
      if (keep[std::size_t(s)]) continue;
      if (best < 0 || score[std::size_t(s)] > score[std::size_t(best)] ||
          (score[std::size_t(s)] == score[std::size_t(best)] && t[std::size_t(s)].pos > t[std::size_t(best)].pos))
        best = s;
    }
    keep[std::size_t(best)] = true, ++held;
  }
  std::vector<std::int64_t> kept;
  for (std::int64_t s = 0; s < n; ++s)
    if (keep[std::size_t(s)]) kept.push_back(s);
  return kept;
}

}  // namespace

TEST_CASE("select_whole_segments keeps whole segments first, then single slots, as a brute-force reference does") {
  std::mt19937_64 rng(31);
  for (int trial = 0; trial < 400; ++trial) {
    // Segments of 1-12 slots in time order (positions distinct, some with holes), slots shuffled.
    std::vector<token> t;
    std::int64_t pos = 0;
    for (std::int32_t seg = 0; std::int64_t(t.size()) < 15 + std::int64_t(rng() % 60); ++seg) {
      const std::int64_t run = 1 + std::int64_t(rng() % 12);
      for (std::int64_t i = 0; i < run; ++i, pos += 1 + std::int64_t(rng() % 2))
        t.push_back({pos, seg, modality::text});
    }
    std::shuffle(t.begin(), t.end(), rng);
    const auto n = std::int64_t(t.size());
    std::vector<float> score(t.size());
    for (auto& s : score) s = float(int(rng() % 7)) * 0.5f;  // many equal scores and means
    const std::int64_t sinks = std::int64_t(rng() % 4), recent = std::int64_t(rng() % 4);
    const std::int64_t cap = std::int64_t(rng() % std::uint64_t(n + 4));
    CAPTURE(trial);
    CAPTURE(cap);
    if (cap < n && cap < sinks + recent) {
      CHECK_THROWS_WITH_AS(cpu::select_whole_segments(score, t, cap, sinks, recent),
                           doctest::Contains(("cap = " + std::to_string(cap)).c_str()), infkv::error);
      continue;
    }
    const auto got = unit(cpu::select_whole_segments(score, t, cap, sinks, recent));
    CHECK(got == naive_segments(score, t, cap, sinks, recent));
    CHECK(std::int64_t(got.size()) == std::min(cap, n));
  }
}

TEST_CASE("select_whole_segments keeps a sentence whole where single slots would keep pieces") {
  // Segments: 0 = slots 0-3, 1 = slots 4-8 (the statement: one high score, the rest middling),
  // 2 = slots 9-11. Budget 7 with 1 sink and 1 recent.
  std::vector<token> t = tokens_at({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  for (std::size_t i = 0; i < t.size(); ++i) t[i].segment = i < 4 ? 0 : i < 9 ? 1 : 2;
  const std::vector<float> s{0, 3, 3, 3, 9, 2, 2, 2, 2, 3, 3, 0};
  // By single slots: 4 and the newest 3s, pieces of every segment; whole segments: all of
  // segment 1 (mean 3.4 against 3 and 3).
  CHECK(unit(cpu::select_top(row_of(s), t, std::vector<std::int64_t>{7}, 1, 1)) ==
        std::vector<std::int64_t>{0, 2, 3, 4, 9, 10, 11});
  CHECK(unit(cpu::select_whole_segments(s, t, 7, 1, 1)) == std::vector<std::int64_t>{0, 4, 5, 6, 7, 8, 11});
  // With room for 3: segment 1 does not fit, segment 2 (mean 3 like segment 0, but newer) does,
  // segment 0 then does not, and the last slot goes to the best single score, in segment 1.
  CHECK(unit(cpu::select_whole_segments(s, t, 5, 1, 1)) == std::vector<std::int64_t>{0, 4, 9, 10, 11});
  CHECK_THROWS_WITH_AS(cpu::select_whole_segments(s, t, 1, 1, 1), doctest::Contains("cap = 1"), infkv::error);
  CHECK(unit(cpu::select_whole_segments(s, t, 20, 1, 1)).size() == 12);
}
