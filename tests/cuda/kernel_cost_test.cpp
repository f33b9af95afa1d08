// The cost model of the CUDA kernels as written (bench/kernel_cost.hpp): its traffic counter
// counts what a step touches, and its recording launcher records what the steps launch and do.
// Its own program: the arena's fault handlers and the sanitizers' do not mix, so the sanitizer
// build leaves it out.
#include <doctest/doctest.h>

#include <cstring>

#include "kernel_cost.hpp"

using namespace infkv_bench;

TEST_CASE("the traffic arena counts the pages a step reads and writes, and the sectors of its precise range") {
  traffic_arena a(std::size_t(64) << 20);
  auto* p = a.take<std::byte>(std::size_t(32) << 20);
  constexpr std::size_t page = traffic_arena::page;
  volatile std::byte* v = p;
  a.begin();
  std::byte sink{};
  for (int i = 0; i < 3; ++i) sink ^= v[std::size_t(10 + i) * page + 100];  // 3 pages read
  v[20 * page] = std::byte{1};                                              // 2 pages written only
  v[21 * page + 4000] = std::byte{2};
  v[10 * page + 7] = std::byte{3};  // a page read, then written
  sink ^= v[20 * page + 1];         // a written page read again: nothing new
  auto f = a.end();
  CHECK(f.read == 3 * page);
  CHECK(f.written == 3 * page);
  // Precise: distinct 32-byte sectors of the range, pages outside it as before.
  a.begin(p + 100 * page, p + 200 * page);
  for (int i = 0; i < 5; ++i) sink ^= v[150 * page + std::size_t(i) * 64];  // 5 sectors of one page
  sink ^= v[150 * page + 1];                                                // the first sector again
  v[160 * page + 32] = std::byte{4};                                        // one sector written
  sink ^= v[300 * page];                                                    // a page outside
  f = a.end();
  CHECK(f.read == 5 * 32 + page);
  CHECK(f.written == 32);
  CHECK(std::to_integer<int>(v[160 * page + 32]) == 4);  // the accesses themselves happened
  (void)sink;
}

TEST_CASE("the recording launcher records cuBLAS's GEMMs from their arguments, f32 ones as such") {
  // Expected Attention multiplies f32 keys with its f32 operand rows through the GEMM.
  const layer_data c{.n = 2048};
  const auto ls = record_eviction(c, 256, false, infkv::expected_attention{.window = 32}.spec(), false);
  int gemms = 0;
  for (const auto& l : ls)
    if (l.kind == "gemm") {
      ++gemms;
      CHECK(l.f32);
      CHECK(l.tc_flops > 0);
      CHECK(gpu_model{}.time(l).tensor > l.tc_flops / (gpu_model{}.tc_peak * gpu_model{}.tc_eff));  // f32 rate
    }
  CHECK(gemms >= 2);  // Sigma' or the projections, then a tile of keys at least
}

TEST_CASE("the recording launcher records every launch of an eviction with the work its steps do") {
  const layer_data c{.n = 2048};
  const std::int64_t kept = 256;
  for (const bool paged : {false, true}) {
    CAPTURE(paged);
    const std::int64_t each0 = infkv_test::host_launcher::each_launches,
                       blocks0 = infkv_test::host_launcher::block_launches;
    const auto ls = record_eviction(c, kept, paged);
    std::int64_t each = 0, blocks = 0;
    for (const auto& l : ls) each += l.kind == "for_each", blocks += l.kind == "for_blocks";
    CHECK(each == infkv_test::host_launcher::each_launches - each0);
    CHECK(blocks == infkv_test::host_launcher::block_launches - blocks0);
    const double key_bytes = double(c.n * c.hkv * c.d * 2), rows = double(c.hq * c.w);  // query rows, all heads
    int fused = 0, statistics = 0;
    for (const auto& l : ls) {
      if (l.step != "score" || l.kind != "for_blocks") continue;
      if (l.tc_flops == 0) {  // the rows' statistics: one exponential per (row, part) at most
        ++statistics;
        CHECK(l.exps <= rows * double((c.n + 1023) / 1024));
        continue;
      }
      ++fused;
      // Each pass reads every key once (and the queries, tokens, statistics: a little more).
      CHECK(l.read >= key_bytes);
      CHECK(l.read <= key_bytes + double(std::int64_t(1) << 20));
      // Every (query row, key) logit by tensor cores once per pass: rows x n x d multiply-adds.
      CHECK(l.tc_flops == doctest::Approx(2.0 * rows * double(c.n) * double(c.d)));
      // At least one exponential per visible (row, key) pair: a key is hidden from the queries
      // before it (the last w - 1 keys from some).
      CHECK(l.exps >= rows * (double(c.n) - double(c.w)));
    }
    CHECK(fused == 2);
    CHECK(statistics == 1);
    // The compaction: one phase at this size, a gather (with the keep set's check) that stages
    // only the rows whose source is another kept row's destination, then a move that reads
    // exactly the kept K and V rows and token entries (sectors), the keep set and page table
    // (pages) and what the gather staged.
    std::vector<const launch_record*> comp;
    for (const auto& l : ls)
      if (l.step == "compact") comp.push_back(&l);
    REQUIRE(comp.size() == 2);
    const double rows_kept = double(2 * c.hkv * kept * c.d * 2), tokens_kept = double(c.hkv * kept * 16),
                 keep_set = double(c.hkv * kept * 8), staged = comp[0]->written;
    CHECK(staged > 0);
    CHECK(staged <= rows_kept / 2);  // staging every row of a head (the code before) fails here
    CHECK(comp[0]->read <= staged + keep_set + 3.0 * traffic_arena::page);
    CHECK(comp[1]->read >= rows_kept + tokens_kept);
    CHECK(comp[1]->read <= rows_kept + 2 * tokens_kept + keep_set + staged + 4.0 * traffic_arena::page);
    // The model times every launch, the gaps at least.
    const gpu_model g;
    for (const auto& l : ls) CHECK(g.time(l).total >= g.launch_gap * l.count);
  }
}
