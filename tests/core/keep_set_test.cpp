// keep_set: CSR units of sorted slots, masks, and the conversion to and from position runs
// (maximal [begin, end) ranges in time order) for engines that remove by position.
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/infkv.hpp>

#include "test_tokens.hpp"

using namespace infkv;

namespace {

using infkv_test::tokens_at;

keep_set one_unit(std::int64_t n, std::vector<std::int64_t> slots) {
  keep_set k(n);
  k.add_unit(slots);
  return k;
}

using runs = std::vector<position_run>;

/// Runs are sorted, non-empty and disjoint.
void check_well_formed(const runs& r) {
  for (std::size_t i = 0; i < r.size(); ++i) {
    CHECK(r[i].begin < r[i].end);
    if (i) CHECK(r[i - 1].end <= r[i].begin);
  }
}

bool covers(const runs& r, std::int64_t pos) {
  return std::ranges::any_of(r, [&](const position_run& x) { return pos >= x.begin && pos < x.end; });
}

}  // namespace

TEST_CASE("keep_set stores sorted units and answers size, unit, mask and uniform") {
  keep_set k(6);
  CHECK(k.n_slots() == 6);
  CHECK(k.n_units() == 0);
  k.add_unit(std::vector<std::int64_t>{0, 2, 5});
  k.add_unit(std::vector<std::int64_t>{0, 2, 5});
  CHECK(k.n_units() == 2);
  CHECK(k.size(1) == 3);
  CHECK(k.uniform());
  CHECK(k.mask(1) == std::vector<bool>{true, false, true, false, false, true});
  k.add_unit(std::vector<std::int64_t>{});
  CHECK(k.size(2) == 0);
  CHECK_FALSE(k.uniform());
  CHECK(k.mask(2) == std::vector<bool>(6, false));

  const auto all = keep_set::all(4, 3);
  CHECK(all.n_units() == 3);
  for (std::int64_t u = 0; u < 3; ++u) CHECK(std::ranges::equal(all.unit(u), std::vector<std::int64_t>{0, 1, 2, 3}));
  CHECK(all == keep_set::all(4, 3));
  CHECK_FALSE(all == keep_set::all(4, 2));
  CHECK_FALSE(keep_set::all(4) == keep_set::all(5));
  CHECK(keep_set::all(0).size(0) == 0);
}

TEST_CASE("runs are maximal in time order and may span positions no slot holds") {
  // slot:      0  1  2  3  4  5
  // position:  9  1  5  0  2  6   time order: 0(s3) 1(s1) 2(s4) 5(s2) 6(s5) 9(s0)
  const auto t = tokens_at({9, 1, 5, 0, 2, 6});
  SUBCASE("kept 0, 1 | evicted 2 | kept 5, 6 | evicted 9") {
    const auto k = one_unit(6, {1, 2, 3, 5});
    CHECK(k.kept_runs(t) == runs{{0, 2}, {5, 7}});
    CHECK(k.evicted_runs(t) == runs{{2, 3}, {9, 10}});
  }
  SUBCASE("kept 2 and 5 are consecutive in time: one run [2, 6)") {
    const auto k = one_unit(6, {2, 4});
    CHECK(k.kept_runs(t) == runs{{2, 6}});
    CHECK(k.evicted_runs(t) == runs{{0, 2}, {6, 10}});
  }
  SUBCASE("everything kept or nothing kept") {
    CHECK(keep_set::all(6).kept_runs(t) == runs{{0, 10}});
    CHECK(keep_set::all(6).evicted_runs(t).empty());
    CHECK(one_unit(6, {}).kept_runs(t).empty());
    CHECK(one_unit(6, {}).evicted_runs(t) == runs{{0, 10}});
  }
  SUBCASE("one unit among several") {
    keep_set k(6);
    k.add_unit(std::vector<std::int64_t>{0});
    k.add_unit(std::vector<std::int64_t>{3});
    CHECK(k.kept_runs(t, 0) == runs{{9, 10}});
    CHECK(k.kept_runs(t, 1) == runs{{0, 1}});
    CHECK(k.evicted_runs(t, 1) == runs{{1, 10}});
  }
}

TEST_CASE("slots sharing a position with the same fate share a run") {
  const auto t = tokens_at({3, 3, 1, 3, 4, 0});  // position 3 held by slots 0, 1, 3 (M-RoPE style)
  const auto k = one_unit(6, {0, 1, 3, 5});
  CHECK(k.kept_runs(t) == runs{{0, 1}, {3, 4}});
  CHECK(k.evicted_runs(t) == runs{{1, 2}, {4, 5}});
  CHECK(keep_set::from_runs(k.kept_runs(t), t) == k);
}

TEST_CASE("from_runs keeps the slots whose position falls in a run") {
  const auto t = tokens_at({9, 1, 5, 0, 2, 6});
  const runs r{{1, 3}, {8, 100}};
  CHECK(keep_set::from_runs(r, t) == one_unit(6, {0, 1, 4}));
  CHECK(keep_set::from_runs(runs{}, t) == one_unit(6, {}));
  CHECK(keep_set::from_runs(runs{{0, 10}}, t) == keep_set::all(6));
  CHECK(keep_set::from_runs(runs{{3, 5}, {7, 9}}, t) == one_unit(6, {}));  // holes only
}

TEST_CASE("kept and evicted runs round trip and partition the positions present, on random caches") {
  std::mt19937_64 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(0, 30)(gen);
    const std::int64_t span = std::uniform_int_distribution<std::int64_t>(1, 3 * n + 1)(gen);
    std::vector<token> t(static_cast<std::size_t>(n));
    for (auto& x : t) x.pos = std::uniform_int_distribution<std::int64_t>(0, span)(gen);  // holes, repeats
    std::vector<bool> keep_pos(static_cast<std::size_t>(span + 1));                       // a fate per position, so
    for (std::size_t i = 0; i < keep_pos.size(); ++i) keep_pos[i] = gen() % 2;            // repeats agree
    std::vector<std::int64_t> slots;
    for (std::int64_t s = 0; s < n; ++s)
      if (keep_pos[std::size_t(t[std::size_t(s)].pos)]) slots.push_back(s);
    const auto k = one_unit(n, slots);
    CAPTURE(trial);
    CAPTURE(n);
    const auto kept = k.kept_runs(t), evicted = k.evicted_runs(t);
    check_well_formed(kept);
    check_well_formed(evicted);
    CHECK(keep_set::from_runs(kept, t) == k);
    const auto mask = k.mask();
    for (std::int64_t s = 0; s < n; ++s) {
      const auto p = t[std::size_t(s)].pos;
      CHECK(covers(kept, p) == bool(mask[std::size_t(s)]));
      CHECK(covers(evicted, p) == !mask[std::size_t(s)]);
    }
    // Kept and evicted runs never overlap, and alternate: between two kept runs an evicted one.
    for (const auto& a : kept)
      for (const auto& b : evicted) CHECK((a.end <= b.begin || b.end <= a.begin));
    for (std::size_t i = 1; i < kept.size(); ++i)
      CHECK(std::ranges::any_of(
          evicted, [&](const position_run& e) { return e.begin >= kept[i - 1].end && e.end <= kept[i].begin; }));
    CHECK(std::int64_t(kept.size() + evicted.size()) <= n);
  }
}
