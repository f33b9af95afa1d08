// Budgets: absolute and ratio capacities, rounding, protected sinks and recent window, what each
// policy's protect() adds, and the budgets that allocation (PyramidKV, AdaKV) hands out.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu/select.hpp>
#include <infkv/infkv.hpp>

using namespace infkv;

TEST_CASE("absolute budgets keep min(capacity, slots present)") {
  const budget b{.capacity = 10, .sinks = 2, .recent = 3};
  CHECK(b.keep_count(0) == 0);
  CHECK(b.keep_count(4) == 4);  // fewer slots than even the protected ones: keep them all
  CHECK(b.keep_count(10) == 10);
  CHECK(b.keep_count(11) == 10);
  CHECK(b.keep_count(1'000'000) == 10);
  CHECK(budget{.capacity = 5, .sinks = 5}.keep_count(9) == 5);  // capacity exactly the protected
  CHECK(budget{.capacity = 1}.keep_count(3) == 1);
}

TEST_CASE("ratio budgets round up, without overshooting exact products") {
  CHECK(budget{.ratio = 0.5}.keep_count(7) == 4);
  CHECK(budget{.ratio = 0.5}.keep_count(8) == 4);
  CHECK(budget{.ratio = 0.3}.keep_count(10) == 3);   // 0.3 * 10 is 3.0000000000000004 in double
  CHECK(budget{.ratio = 0.7}.keep_count(10) == 7);   // 0.7 * 10 is 7.000000000000001
  CHECK(budget{.ratio = 0.1}.keep_count(30) == 3);   // 3.0000000000000004
  CHECK(budget{.ratio = 0.25}.keep_count(10) == 3);  // 2.5 -> 3
  CHECK(budget{.ratio = 0.01}.keep_count(10) == 1);  // 0.1 -> 1
  CHECK(budget{.ratio = 1.0}.keep_count(13) == 13);
  CHECK(budget{.ratio = 0.5}.keep_count(0) == 0);
  CHECK(budget{.ratio = 0.5, .sinks = 1, .recent = 1}.keep_count(4) == 2);
  // Ratio 1 keeps everything even when the protected count exceeds the slots present.
  CHECK(budget{.ratio = 1.0, .sinks = 8, .recent = 8}.keep_count(5) == 5);
}

TEST_CASE("ratio budgets keep ceil(ratio * n) for every n, checked in exact integer arithmetic") {
  // ratio = p / 100 for integer p: ceil(p * n / 100) computed without floating point.
  for (int p = 1; p <= 100; ++p)
    for (std::int64_t n = 0; n <= 60; ++n) {
      CAPTURE(p);
      CAPTURE(n);
      const std::int64_t want = std::min<std::int64_t>(n, (p * n + 99) / 100);
      CHECK(budget{.ratio = p / 100.0}.keep_count(n) == want);
    }
}

TEST_CASE("validate accepts every well-formed budget") {
  CHECK_NOTHROW(budget{.capacity = 1}.validate());
  CHECK_NOTHROW(budget{.capacity = 7, .sinks = 3, .recent = 4}.validate());
  CHECK_NOTHROW(budget{.ratio = 1.0, .sinks = 100}.validate());  // checked against n in keep_count
  CHECK_NOTHROW(budget{.ratio = 1e-9}.validate());
}

TEST_CASE("protect: snapkv and inf_mllm keep their window, other policies keep the budget as is") {
  const budget b{.capacity = 64, .sinks = 4, .recent = 8};
  const auto s = protect(snapkv{.window = 32}, b);
  CHECK(s.recent == 32);
  CHECK(s.sinks == 4);
  CHECK(s.capacity == 64);
  CHECK(protect(snapkv{.window = 4}, b).recent == 8);  // already wider
  const auto same = [&](const budget& x) {
    return x.capacity == b.capacity && x.ratio == b.ratio && x.sinks == b.sinks && x.recent == b.recent;
  };
  CHECK(same(protect(streaming_llm{}, b)));
  CHECK(same(protect(tova{}, b)));
  CHECK(same(protect(keydiff{}, b)));
  CHECK(protect(inf_mllm{.window = 32}, b).recent == 32);  // its retrieval window, as SnapKV's
  CHECK(same(protect(h2o{}, b)));
  // A window that no longer fits the capacity makes the protected budget invalid.
  CHECK_THROWS_AS(protect(snapkv{.window = 80}, b).validate(), error);
}

TEST_CASE("pyramidkv hands every layer a valid budget that adds up to the total") {
  for (std::int32_t layers : {1, 2, 5, 32})
    for (const budget base : {budget{.capacity = 128, .sinks = 4, .recent = 16}, budget{.capacity = 40, .recent = 8},
                              budget{.capacity = 1000}}) {
      CAPTURE(layers);
      CAPTURE(base.capacity);
      const auto out = pyramidkv{}.allocate(layers, base);
      REQUIRE(std::int64_t(out.size()) == layers);
      std::int64_t total = 0;
      for (std::size_t l = 0; l < out.size(); ++l) {
        CHECK_NOTHROW(out[l].validate());
        CHECK(out[l].sinks == base.sinks);
        CHECK(out[l].recent == base.recent);
        CHECK(out[l].ratio == 0.0);
        if (l) CHECK(out[l].capacity <= out[l - 1].capacity);  // falls with depth
        total += out[l].capacity;
      }
      CHECK(total == std::int64_t(layers) * base.capacity);
      if (layers > 1) CHECK(out.front().capacity > out.back().capacity);
    }
}

TEST_CASE("adakv capacities hold every head's protected slots and add up to the layer's budget") {
  std::mt19937_64 gen(3);
  std::normal_distribution<float> normal;
  for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
    CAPTURE(alpha);
    score_matrix s(4, 50);
    for (std::int64_t r = 0; r < 4; ++r)
      for (auto& v : s.row(r)) v = normal(gen) * float(r + 1);  // heads of different spread
    const auto tokens = text_tokens(50);
    const budget b{.capacity = 20, .sinks = 2, .recent = 5};
    const auto caps = cpu::allocate(adakv{.alpha = alpha}, s, tokens, b);
    REQUIRE(caps.size() == 4);
    CHECK(std::accumulate(caps.begin(), caps.end(), std::int64_t{0}) == 4 * 20);
    for (auto c : caps) {
      CHECK(c >= b.sinks + b.recent);
      CHECK(c <= 50);
    }
    if (alpha == 1.0) CHECK(caps == std::vector<std::int64_t>(4, 20));
    const auto keep = cpu::select_top(s, tokens, caps, b.sinks, b.recent);
    for (std::int64_t h = 0; h < 4; ++h) CHECK(keep.size(h) == caps[std::size_t(h)]);
  }
  // A budget covering the cache keeps every slot of every head.
  const score_matrix small(3, 6, 1.f);
  CHECK(cpu::allocate(adakv{}, small, text_tokens(6), budget{.capacity = 6}) == std::vector<std::int64_t>(3, 6));
}
