// Budget allocation: PyramidKV across layers, AdaKV across heads, and per-unit top-k selection.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu/select.hpp>
#include <infkv/infkv.hpp>

using namespace infkv;

namespace {

std::vector<std::int64_t> capacities(const std::vector<budget>& b) {
  std::vector<std::int64_t> out;
  for (const auto& x : b) out.push_back(x.capacity);
  return out;
}

}  // namespace

TEST_CASE("pyramidkv shares a budget linearly over depth, as computed by hand") {
  // B = 100 - 10 = 90; beta 10: min = 9, max = 171, step (171 - 9) / 3 = 54
  const budget base{.capacity = 100, .sinks = 4, .recent = 10};
  const auto exact = pyramidkv{.beta = 10}.allocate(4, base);
  CHECK(capacities(exact) == std::vector<std::int64_t>{181, 127, 73, 19});
  for (const auto& b : exact) {
    CHECK(b.sinks == 4);
    CHECK(b.recent == 10);
    CHECK_NOTHROW(b.validate());
  }

  // beta 20: min = 4.5, max = 175.5, step 57: shares 175.5, 118.5, 61.5, 4.5 (+ recent)
  const auto half = pyramidkv{.beta = 20}.allocate(4, base);
  const std::vector<double> share{185.5, 128.5, 71.5, 14.5};
  std::int64_t sum = 0;
  for (std::size_t l = 0; l < half.size(); ++l) {
    CHECK((half[l].capacity == std::int64_t(std::floor(share[l])) ||
           half[l].capacity == std::int64_t(std::ceil(share[l]))));
    if (l) CHECK(half[l].capacity < half[l - 1].capacity);
    sum += half[l].capacity;
  }
  CHECK(sum == 400);

  // one layer keeps the base budget; beta 1 gives every layer the same share
  CHECK(capacities(pyramidkv{}.allocate(1, base)) == std::vector<std::int64_t>{100});
  CHECK(capacities(pyramidkv{.beta = 1}.allocate(3, base)) == std::vector<std::int64_t>{100, 100, 100});
}

TEST_CASE("pyramidkv sums to n_layers x capacity and decreases with depth for many shapes") {
  for (std::int32_t layers : {2, 3, 7, 32, 80})
    for (std::int64_t cap : {64, 100, 1000, 4099})
      for (double beta : {2.0, 5.0, 20.0}) {
        CAPTURE(layers);
        CAPTURE(cap);
        CAPTURE(beta);
        const budget base{.capacity = cap, .sinks = 0, .recent = 8};
        const auto out = pyramidkv{.beta = beta}.allocate(layers, base);
        REQUIRE(std::int64_t(out.size()) == layers);
        std::int64_t sum = 0;
        for (std::size_t l = 0; l < out.size(); ++l) {
          sum += out[l].capacity;
          REQUIRE(out[l].capacity >= base.recent);
          if (l) REQUIRE(out[l].capacity <= out[l - 1].capacity);
        }
        CHECK(sum == std::int64_t(layers) * cap);
        CHECK(out.front().capacity > cap);
        CHECK(out.back().capacity < cap);
      }
}

TEST_CASE("pyramidkv rejects budgets it cannot share, naming the argument") {
  CHECK_THROWS_WITH_AS(pyramidkv{}.allocate(0, {.capacity = 100}), doctest::Contains("n_layers = 0"), error);
  CHECK_THROWS_WITH_AS(pyramidkv{}.allocate(4, {.ratio = 0.5}), doctest::Contains("budget.capacity = 0"), error);
  CHECK_THROWS_WITH_AS(pyramidkv{.beta = 0.5}.allocate(4, {.capacity = 100}), doctest::Contains("pyramidkv.beta = 0.5"),
                       error);
  // the deepest layer would keep 10 + 0 or 1 slots, fewer than sinks + recent = 18
  CHECK_THROWS_WITH_AS(pyramidkv{}.allocate(4, {.capacity = 20, .sinks = 8, .recent = 10}),
                       doctest::Contains("budget.capacity = 20"), error);
}

namespace {

/// Scores of `rows` heads over `n` slots: head h holds `high[h]` of the unprotected slots with
/// scores far above every other unprotected score; protected slots of the last head score highest.
score_matrix planted_scores(const std::vector<std::int64_t>& high, std::int64_t n, const budget& b, std::mt19937& rng) {
  const auto rows = std::int64_t(high.size());
  score_matrix s(rows, n);
  std::uniform_real_distribution<float> low(0.f, 1.f), top(100.f, 101.f);
  for (std::int64_t h = 0; h < rows; ++h) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(n - b.sinks - b.recent));
    std::iota(idx.begin(), idx.end(), b.sinks);
    std::shuffle(idx.begin(), idx.end(), rng);
    for (std::int64_t j = 0; j < n; ++j) s(h, j) = low(rng);
    for (std::int64_t i = 0; i < high[std::size_t(h)]; ++i) s(h, idx[std::size_t(i)]) = top(rng);
  }
  for (std::int64_t j = 0; j < n; ++j)
    if (j < b.sinks || j >= n - b.recent) s(rows - 1, j) = 1000.f;  // protected: never counted
  return s;
}

}  // namespace

TEST_CASE("adakv gives heads holding more of the top scores more slots, as computed by hand") {
  std::mt19937 rng(51);
  const std::int64_t n = 40;
  const budget b{.capacity = 12, .sinks = 2, .recent = 2};  // 8 free slots per head, 32 in all
  const auto tokens = text_tokens(n);
  const auto s = planted_scores({16, 10, 6, 0}, n, b, rng);
  // alpha 0: shares are the winners; + 4 protected each
  CHECK(cpu::allocate(adakv{.alpha = 0.0}, s, tokens, b) == std::vector<std::int64_t>{20, 14, 10, 4});
  // alpha 0.5: 16 * .5 + 4 = 12, 9, 7, 4
  CHECK(cpu::allocate(adakv{.alpha = 0.5}, s, tokens, b) == std::vector<std::int64_t>{16, 13, 11, 8});
  // alpha 1: equal shares
  CHECK(cpu::allocate(adakv{.alpha = 1.0}, s, tokens, b) == std::vector<std::int64_t>{12, 12, 12, 12});
  // default alpha 0.2: 14.4, 9.6, 6.4, 1.6 -> floors 14, 9, 6, 1, the two largest remainders
  // (0.6) round up
  CHECK(cpu::allocate(adakv{}, s, tokens, b) == std::vector<std::int64_t>{18, 14, 10, 6});

  // slot order is not time order: shuffle the slots, the allocation does not change
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  std::iota(perm.begin(), perm.end(), std::int64_t{0});
  std::shuffle(perm.begin(), perm.end(), rng);
  score_matrix ps(s.rows, n);
  std::vector<token> pt(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    pt[std::size_t(j)] = tokens[std::size_t(perm[std::size_t(j)])];
    for (std::int64_t h = 0; h < s.rows; ++h) ps(h, j) = s(h, perm[std::size_t(j)]);
  }
  CHECK(cpu::allocate(adakv{.alpha = 0.0}, ps, pt, b) == std::vector<std::int64_t>{20, 14, 10, 4});
}

TEST_CASE("adakv sums to rows x capacity and keeps every head's protected tokens") {
  std::mt19937 rng(52);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (int trial = 0; trial < 50; ++trial) {
    const std::int64_t rows = 1 + std::int64_t(rng() % 8), n = 30 + std::int64_t(rng() % 100);
    const budget b{
        .capacity = 8 + std::int64_t(rng() % 20), .sinks = std::int64_t(rng() % 4), .recent = std::int64_t(rng() % 4)};
    score_matrix s(rows, n);
    for (std::int64_t h = 0; h < rows; ++h)  // every score of a later head beats the earlier heads'
      for (std::int64_t j = 0; j < n; ++j) s(h, j) = u(rng) + 2.f * float(h);
    const auto tokens = text_tokens(n);
    const double alpha = double(trial % 5) / 4;
    CAPTURE(trial);
    const auto caps = cpu::allocate(adakv{.alpha = alpha}, s, tokens, b);
    REQUIRE(std::int64_t(caps.size()) == rows);
    CHECK(std::accumulate(caps.begin(), caps.end(), std::int64_t{0}) == rows * b.capacity);
    for (std::int64_t h = 0; h < rows; ++h) {
      CHECK(caps[std::size_t(h)] >= b.sinks + b.recent);
      CHECK(caps[std::size_t(h)] <= n);
      if (h) CHECK(caps[std::size_t(h)] >= caps[std::size_t(h - 1)] - 1);  // more mass, no fewer slots
    }
    if (alpha == 1.0)
      for (auto c : caps) CHECK(c == b.capacity);
  }
  // a budget that holds every slot gives every head all of them
  score_matrix s(3, 10);
  CHECK(cpu::allocate(adakv{}, s, text_tokens(10), {.capacity = 50}) == std::vector<std::int64_t>{10, 10, 10});
  CHECK_THROWS_WITH_AS(cpu::allocate(adakv{.alpha = 1.5}, s, text_tokens(10), {.capacity = 5}),
                       doctest::Contains("adakv.alpha = 1.5"), error);
}

TEST_CASE("select_top with per-unit capacities keeps each unit's own count and its top scores") {
  std::mt19937 rng(53);
  const std::int64_t n = 40;
  const budget b{.capacity = 12, .sinks = 2, .recent = 2};
  const auto tokens = text_tokens(n);
  const auto s = planted_scores({16, 10, 6, 0}, n, b, rng);
  const auto caps = cpu::allocate(adakv{.alpha = 0.0}, s, tokens, b);
  const auto keep = cpu::select_top(s, tokens, caps, b.sinks, b.recent);
  REQUIRE(keep.n_units() == 4);
  for (std::int64_t h = 0; h < 4; ++h) {
    CAPTURE(h);
    CHECK(keep.size(h) == caps[std::size_t(h)]);
    const auto m = keep.mask(h);
    for (std::int64_t j = 0; j < n; ++j) {
      if (j < b.sinks || j >= n - b.recent)
        CHECK(m[std::size_t(j)]);  // protected
      else
        CHECK(m[std::size_t(j)] == (s(h, j) >= 100.f));  // exactly the planted winners
    }
  }
  const std::vector<std::int64_t> too_small{12, 3, 12, 12};
  CHECK_THROWS_WITH_AS(cpu::select_top(s, tokens, too_small, b.sinks, b.recent), doctest::Contains("capacities[1] = 3"),
                       error);
  const std::vector<std::int64_t> wrong_count{12, 12};
  CHECK_THROWS_WITH_AS(cpu::select_top(s, tokens, wrong_count, b.sinks, b.recent),
                       doctest::Contains("capacities.size() = 2"), error);
}
