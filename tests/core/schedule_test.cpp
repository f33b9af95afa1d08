// Schedules: every_step, on_overflow and budgeted block-wise prefill (block planning aligned to
// segments, and a 100K-token multimodal stream prefilled under a fixed budget with KeyDiff).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

/// Tokens with consecutive positions whose segments have the given lengths.
std::vector<token> segmented(const std::vector<std::int64_t>& lens) {
  std::vector<token> t;
  for (std::size_t s = 0; s < lens.size(); ++s)
    for (std::int64_t i = 0; i < lens[s]; ++i) t.push_back({std::int64_t(t.size()), std::int32_t(s), modality::text});
  return t;
}

/// Checks the promises of a block plan over `input`.
void check_plan(const block_prefill& bp, const std::vector<token>& input, const std::vector<block_range>& plan) {
  const auto n = std::int64_t(input.size());
  const auto boundary = [&](std::int64_t k) {
    return k == 0 || k == n || input[std::size_t(k)].segment != input[std::size_t(k - 1)].segment;
  };
  std::int64_t at = 0;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto [b, e] = plan[i];
    const std::int64_t limit = i == 0 && bp.first_block_fills_budget ? std::max(bp.budget, bp.block) : bp.block;
    REQUIRE(b == at);  // exact cover, in order
    REQUIRE(e > b);
    REQUIRE(e - b <= limit);
    if (bp.snap_to_segments && !boundary(e)) {
      // the block ends inside a segment only when that segment fills the whole block
      REQUIRE(e - b == limit);
      for (std::int64_t k = b + 1; k < e; ++k) REQUIRE_FALSE(boundary(k));
    }
    at = e;
  }
  REQUIRE(at == n);
  if (!bp.snap_to_segments) return;
  // no segment that fits in a block is ever split
  std::vector<bool> cut(static_cast<std::size_t>(n + 1), false);
  for (const auto& r : plan) cut[std::size_t(r.end)] = true;
  for (std::int64_t s = 0; s < n;) {
    std::int64_t e = s + 1;
    while (!boundary(e)) ++e;
    if (e - s <= bp.block)
      for (std::int64_t k = s + 1; k < e; ++k) REQUIRE_FALSE(cut[std::size_t(k)]);
    s = e;
  }
}

}  // namespace

TEST_CASE("block_prefill plans small inputs as computed by hand") {
  const auto input = segmented({2, 3, 1, 6});  // segments [0,2) [2,5) [5,6) [6,12)
  using plan_t = std::vector<block_range>;
  const block_prefill b4{.block = 4, .budget = 4};
  CHECK(b4.plan(input) == plan_t{{0, 2}, {2, 6}, {6, 10}, {10, 12}});
  check_plan(b4, input, b4.plan(input));
  const block_prefill first7{.block = 4, .budget = 7};  // the first block may fill the budget
  CHECK(first7.plan(input) == plan_t{{0, 6}, {6, 10}, {10, 12}});
  check_plan(first7, input, first7.plan(input));
  const block_prefill plain7{.block = 4, .budget = 7, .first_block_fills_budget = false};
  CHECK(plain7.plan(input) == plan_t{{0, 2}, {2, 6}, {6, 10}, {10, 12}});
  const block_prefill no_snap{.block = 4, .budget = 4, .snap_to_segments = false};
  CHECK(no_snap.plan(input) == plan_t{{0, 4}, {4, 8}, {8, 12}});
  check_plan(no_snap, input, no_snap.plan(input));
  const block_prefill b3{.block = 3, .budget = 2};  // first limit max(2, 3) = 3
  CHECK(b3.plan(input) == plan_t{{0, 2}, {2, 5}, {5, 6}, {6, 9}, {9, 12}});

  const auto one = segmented({10});  // one long segment is split
  CHECK(b4.plan(one) == plan_t{{0, 4}, {4, 8}, {8, 10}});
  CHECK(b4.plan(segmented({3})) == plan_t{{0, 3}});
  CHECK(b4.plan(segmented({4, 4})) == plan_t{{0, 4}, {4, 8}});
  CHECK(b4.plan(std::vector<token>{}).empty());
  CHECK(b4.peak() == 8);
  CHECK_THROWS_WITH_AS(block_prefill{.block = 0}.plan(input), doctest::Contains("block_prefill.block = 0"), error);
  CHECK_THROWS_WITH_AS(block_prefill{.budget = -3}.plan(input), doctest::Contains("block_prefill.budget = -3"), error);
}

TEST_CASE("block_prefill plans random segmentations correctly") {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::int64_t> lens(1 + rng() % 30);
    for (auto& l : lens) l = 1 + std::int64_t(rng() % (trial % 2 ? 40 : 9));
    const auto input = segmented(lens);
    const block_prefill bp{.block = 1 + std::int64_t(rng() % 16),
                           .budget = 1 + std::int64_t(rng() % 40),
                           .snap_to_segments = rng() % 4 != 0,
                           .first_block_fills_budget = rng() % 2 == 0};
    CAPTURE(trial);
    check_plan(bp, input, bp.plan(input));
  }
}

TEST_CASE("every_step and on_overflow say when to evict and to how many slots") {
  const every_step es{.capacity = 10};
  CHECK_FALSE(es.due(9));
  CHECK_FALSE(es.due(10));
  CHECK(es.due(11));
  CHECK(es.target(11) == 10);
  CHECK(es.target(500) == 10);

  const on_overflow ov{.capacity = 10, .slack = 5};
  CHECK_FALSE(ov.due(15));
  CHECK(ov.due(16));
  CHECK(ov.target(16) == 10);
  // a stream of 100 tokens appended one by one: the first eviction at 16 tokens, then every 6
  std::int64_t n = 0, evictions = 0, peak = 0, every = 0;
  for (int t = 0; t < 100; ++t) {
    ++n;
    peak = std::max(peak, n);
    if (ov.due(n)) n = ov.target(n), ++evictions;
  }
  CHECK(evictions == 15);
  CHECK(peak == 16);
  CHECK(n == 10);
  n = 0;
  for (int t = 0; t < 100; ++t)
    if (es.due(++n)) n = es.target(n), ++every;
  CHECK(every == 90);

  const block_prefill bp{.block = 256, .budget = 1024};
  CHECK_FALSE(bp.due(1024));
  CHECK(bp.due(1025));
  CHECK(bp.target(1280) == 1024);
  CHECK(bp.peak() == 1280);
}

TEST_CASE("budgeted block-wise prefill of a 100K-token multimodal stream stays within M + b") {
  // stream: text runs, images of 196-token tiles and videos of 256-token frames, one segment each
  std::mt19937 rng(42);
  std::vector<token> input;
  std::int32_t seg = 0;
  std::int64_t tiles = 0, frames = 0;
  while (input.size() < 100000) {
    const auto add = [&](std::int64_t len, modality m) {
      for (std::int64_t i = 0; i < len; ++i) input.push_back({std::int64_t(input.size()), seg, m});
      ++seg;
    };
    switch (rng() % 3) {
      case 0: add(5 + std::int64_t(rng() % 80), modality::text); break;
      case 1:
        for (unsigned i = 0, k = 1 + rng() % 4; i < k; ++i, ++tiles) add(196, modality::image);
        break;
      default:
        for (unsigned i = 0, k = 2 + rng() % 8; i < k; ++i, ++frames) add(256, modality::video);
        break;
    }
  }
  const auto n = std::int64_t(input.size());
  REQUIRE(tiles > 10);
  REQUIRE(frames > 10);

  // keys: per head a shared mean direction plus noise; a few planted outliers point the other way
  const std::int32_t heads = 2, d = 32;
  const std::int64_t row = std::int64_t(heads) * d;
  std::normal_distribution<float> noise(0.f, 1.f);
  std::vector<float> mean(static_cast<std::size_t>(row));
  for (auto& x : mean) x = noise(rng);
  std::vector<std::int64_t> outliers;
  for (int i = 0; i < 40; ++i) outliers.push_back(4 + std::int64_t(rng() % std::uint64_t(n - 4)));
  std::sort(outliers.begin(), outliers.end());
  outliers.erase(std::unique(outliers.begin(), outliers.end()), outliers.end());
  std::vector<std::uint16_t> keys(static_cast<std::size_t>(n * row));
  std::vector<float> k(static_cast<std::size_t>(row));
  for (std::int64_t t = 0; t < n; ++t) {
    const bool out = std::binary_search(outliers.begin(), outliers.end(), t);
    for (std::int64_t e = 0; e < row; ++e)
      k[std::size_t(e)] = (out ? -2.f : 2.f) * mean[std::size_t(e)] + 0.5f * noise(rng);
    from_f32(dtype::f16, k.data(), keys.data() + t * row, row);
  }

  const block_prefill bp{.block = 256, .budget = 1024};
  const auto plan = bp.plan(input);
  check_plan(bp, input, plan);
  REQUIRE(plan.front().end - plan.front().begin <= std::max(bp.budget, bp.block));
  REQUIRE(std::int64_t(plan.size()) > n / bp.block);

  std::vector<std::uint16_t> cache(static_cast<std::size_t>(bp.peak() * row));
  std::vector<token> cached;
  std::int64_t n_cached = 0, peak = 0, evictions = 0;
  for (const auto& blk : plan) {
    const std::int64_t len = blk.end - blk.begin;
    REQUIRE(n_cached + len <= bp.peak());  // the buffer never needs more than M + b slots
    std::memcpy(cache.data() + n_cached * row, keys.data() + blk.begin * row, std::size_t(len * row) * 2);
    cached.insert(cached.end(), input.begin() + blk.begin, input.begin() + blk.end);
    n_cached += len;
    peak = std::max(peak, n_cached);
    if (!bp.due(n_cached)) continue;
    kv_view kv{nhd(cache.data(), dtype::f16, n_cached, heads, d), {}};
    const layer_inputs<> in{.keys = kv.k, .tokens = cached};
    const auto keep =
        cpu::select(keydiff{}, budget{.capacity = bp.target(n_cached), .sinks = 4}, in, granularity::per_token);
    REQUIRE(keep.n_units() == 1);
    n_cached = cpu::compact(kv, cached, keep);
    cached.resize(std::size_t(n_cached));
    REQUIRE(n_cached == bp.budget);
    ++evictions;
  }
  CHECK(peak <= bp.budget + bp.block);
  CHECK(peak > bp.budget);
  CHECK(evictions >= std::int64_t(plan.size()) - 1);
  REQUIRE(n_cached == bp.budget);

  // the cache is in time order, holds the sinks and every planted outlier, with their bytes
  for (std::int64_t i = 0; i < n_cached; ++i) {
    const auto pos = cached[std::size_t(i)].pos;
    if (i) REQUIRE(pos > cached[std::size_t(i - 1)].pos);
    if (i < 4) CHECK(pos == i);
    REQUIRE(cached[std::size_t(i)].segment == input[std::size_t(pos)].segment);
    REQUIRE(std::memcmp(cache.data() + i * row, keys.data() + pos * row, std::size_t(row) * 2) == 0);
  }
  std::int64_t found = 0;
  for (const auto& t : cached) found += std::binary_search(outliers.begin(), outliers.end(), t.pos);
  CHECK(found == std::int64_t(outliers.size()));
}
