// infkv benchmarks: peak FMA throughput and memcpy bandwidth (the ceilings for the kernels).
#include "bench_ceilings.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define INFKV_BENCH_X86 1
#endif

namespace infkv_bench {

namespace {

constexpr int chains = 12;  // independent accumulators of 8 lanes

#ifdef INFKV_BENCH_X86
// Twelve named accumulators (12 independent chains cover FMA latency x pipes on current x86),
// written out so the blocking does not depend on the optimisation level.
#define INFKV_FMA12                                                                               \
  a0 = _mm256_fmadd_ps(a0, m, b), a1 = _mm256_fmadd_ps(a1, m, b), a2 = _mm256_fmadd_ps(a2, m, b), \
  a3 = _mm256_fmadd_ps(a3, m, b), a4 = _mm256_fmadd_ps(a4, m, b), a5 = _mm256_fmadd_ps(a5, m, b), \
  a6 = _mm256_fmadd_ps(a6, m, b), a7 = _mm256_fmadd_ps(a7, m, b), a8 = _mm256_fmadd_ps(a8, m, b), \
  a9 = _mm256_fmadd_ps(a9, m, b), a10 = _mm256_fmadd_ps(a10, m, b), a11 = _mm256_fmadd_ps(a11, m, b)

__attribute__((target("avx2,fma"))) float fma_kernel_avx2(std::int64_t iters) {
  const __m256 m = _mm256_set1_ps(0.9999999f), b = _mm256_set1_ps(1e-7f);
  __m256 a0 = _mm256_set1_ps(1.f), a1 = _mm256_set1_ps(2.f), a2 = _mm256_set1_ps(3.f), a3 = _mm256_set1_ps(4.f);
  __m256 a4 = _mm256_set1_ps(5.f), a5 = _mm256_set1_ps(6.f), a6 = _mm256_set1_ps(7.f), a7 = _mm256_set1_ps(8.f);
  __m256 a8 = _mm256_set1_ps(9.f), a9 = _mm256_set1_ps(10.f), a10 = _mm256_set1_ps(11.f), a11 = _mm256_set1_ps(12.f);
  for (std::int64_t i = 0; i < iters; i += 4) {  // four rounds per trip: branch and code alignment out of the way
    INFKV_FMA12;
    INFKV_FMA12;
    INFKV_FMA12;
    INFKV_FMA12;
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                                               _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11))));
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[7];
}
#undef INFKV_FMA12
#endif

float fma_kernel_scalar(std::int64_t iters) {
  float acc[chains][8];
  for (int c = 0; c < chains; ++c)
    for (int l = 0; l < 8; ++l) acc[c][l] = 1.f + float(c);
  for (std::int64_t i = 0; i < (iters + 3) / 4 * 4; ++i)
    for (int c = 0; c < chains; ++c)
      for (int l = 0; l < 8; ++l) acc[c][l] = acc[c][l] * 0.9999999f + 1e-7f;
  float s = 0.f;
  for (int c = 0; c < chains; ++c) s += acc[c][0] + acc[c][7];
  return s;
}

}  // namespace

std::int64_t fma_kernel_flops(std::int64_t iters) { return (iters + 3) / 4 * 4 * chains * 8 * 2; }

bool fma_kernel_is_vector() {
#ifdef INFKV_BENCH_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

float fma_kernel(std::int64_t iters) {
#ifdef INFKV_BENCH_X86
  if (fma_kernel_is_vector()) return fma_kernel_avx2(iters);
#endif
  return fma_kernel_scalar(iters);
}

double peak_flops() {
  static const double peak = [] {
    double best = 0.0;
    for (int run = 0; run < 7; ++run) {
      std::int64_t iters = 2'000'000;
      const auto t0 = std::chrono::steady_clock::now();
      benchmark::DoNotOptimize(iters);  // opaque: the kernel cannot be hoisted out of the timing
      benchmark::DoNotOptimize(fma_kernel(iters));
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      best = std::max(best, double(fma_kernel_flops(iters)) / dt.count());
    }
    return best;
  }();
  return peak;
}

std::size_t beyond_llc_bytes() { return std::size_t(256) << 20; }

double memcpy_bandwidth() {
  static const double bw = [] {
    const std::size_t bytes = beyond_llc_bytes();
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    double best = 0.0;
    for (int run = 0; run < 4; ++run) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      benchmark::ClobberMemory();
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      best = std::max(best, double(bytes) / dt.count());
    }
    return best;
  }();
  return bw;
}

namespace {

/// Peak f32 FMA throughput of one thread: flop/s, and frac_peak of the process-wide estimate.
void BM_peak_fma(benchmark::State& state) {
  constexpr std::int64_t iters = 100'000;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) benchmark::DoNotOptimize(fma_kernel(iters));
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  const double flops = double(fma_kernel_flops(iters));
  state.counters["flop/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["frac_peak"] = flops * double(state.iterations()) / dt.count() / peak_flops();
  state.SetLabel(fma_kernel_is_vector() ? "avx2+fma, 12 chains x 8 lanes" : "scalar fallback");
}
BENCHMARK(BM_peak_fma)->UseRealTime();

/// memcpy of a buffer larger than the last-level cache: bytes/s counts bytes copied (each read
/// once and written once).
void BM_memcpy_beyond_llc(benchmark::State& state) {
  const std::size_t bytes = beyond_llc_bytes();
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * std::int64_t(bytes));
}
BENCHMARK(BM_memcpy_beyond_llc)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

}  // namespace infkv_bench
