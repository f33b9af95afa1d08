// infkv CUDA backend benchmarks (Google Benchmark, CUDA-event timing): each kernel at realistic
// shapes (head dim 128, 8 KV heads, 4K-128K slots, window 32, f16), reported as bytes/s next to
// a device-to-device copy and as flop/s next to a tensor-core GEMM (cuBLAS f16, f32 accumulate),
// both measured in the same binary. Counters: `of_copy` (fraction of the copy bandwidth) for
// memory-bound kernels, `of_gemm` for window scoring. Needs a device; exits 77 without one.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <infkv/cuda.hpp>

namespace {

void ok(cudaError_t e) {
  if (e != cudaSuccess) {
    std::cerr << "CUDA: " << cudaGetErrorString(e) << "\n";
    std::exit(1);
  }
}

template <class T>
T* dmalloc(std::size_t n) {
  void* p = nullptr;
  ok(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}

/// Times `f` (queued on the default stream) with CUDA events per iteration.
template <class F>
void timed(benchmark::State& state, F&& f) {
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a)), ok(cudaEventCreate(&b));
  f();  // warm-up
  for (auto _ : state) {
    ok(cudaEventRecord(a));
    f();
    ok(cudaEventRecord(b));
    ok(cudaEventSynchronize(b));
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, a, b));
    state.SetIterationTime(double(ms) / 1e3);
  }
  cudaEventDestroy(a), cudaEventDestroy(b);
}

double g_copy_bw = 0, g_gemm_flops = 0;

/// A kernel's memory traffic (bytes read + written) per iteration as a fraction of the copy's
/// (which reads and writes each byte it copies).
benchmark::Counter of_copy(double traffic) {
  return benchmark::Counter(traffic / (2 * g_copy_bw), benchmark::Counter::kIsIterationInvariantRate);
}

/// Device-to-device copy bandwidth (bytes copied per second, best of 10 copies of 1 GiB).
double copy_bandwidth() {
  const std::size_t bytes = std::size_t(1) << 30;
  auto* a = dmalloc<char>(bytes);
  auto* b = dmalloc<char>(bytes);
  cudaEvent_t e0, e1;
  ok(cudaEventCreate(&e0)), ok(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    ok(cudaEventRecord(e0));
    ok(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    ok(cudaEventRecord(e1));
    ok(cudaEventSynchronize(e1));
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaFree(a), cudaFree(b);
  return double(bytes) / (double(best) / 1e3);
}

/// Tensor-core GEMM flop/s (cuBLAS f16 inputs, f32 accumulate, 8192^3, best of 10).
double gemm_flops() {
  const int n = 8192;
  auto* a = dmalloc<std::uint16_t>(std::size_t(n) * n);
  auto* b = dmalloc<std::uint16_t>(std::size_t(n) * n);
  auto* c = dmalloc<float>(std::size_t(n) * n);
  ok(cudaMemset(a, 0, std::size_t(n) * n * 2)), ok(cudaMemset(b, 0, std::size_t(n) * n * 2));
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
  const float one = 1, zero = 0;
  cudaEvent_t e0, e1;
  ok(cudaEventCreate(&e0)), ok(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    ok(cudaEventRecord(e0));
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16F, n, b, CUDA_R_16F, n, &zero, c, CUDA_R_32F,
                 n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    ok(cudaEventRecord(e1));
    ok(cudaEventSynchronize(e1));
    float ms = 0;
    ok(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cublasDestroy(h);
  cudaFree(a), cudaFree(b), cudaFree(c);
  return 2.0 * n * n * double(n) / (double(best) / 1e3);
}

/// One layer on the device: f16 keys [n][8][128], 32 queries of 32 query heads, positions 0..n-1.
struct layer {
  std::int64_t n;
  std::int32_t hkv = 8, hq = 32, d = 128;
  std::int64_t nq = 32;
  void *k = nullptr, *v = nullptr, *q = nullptr;
  infkv::token* tokens = nullptr;
  std::int64_t* qpos = nullptr;
  explicit layer(std::int64_t slots) : n(slots) {
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    std::vector<float> x(static_cast<std::size_t>(n * hkv * d));
    for (auto& e : x) e = normal(gen);
    std::vector<std::uint16_t> h(x.size());
    infkv::from_f32(infkv::dtype::f16, x.data(), h.data(), std::int64_t(x.size()));
    k = dmalloc<std::uint16_t>(h.size()), v = dmalloc<std::uint16_t>(h.size());
    ok(cudaMemcpy(k, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    ok(cudaMemcpy(v, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    q = dmalloc<std::uint16_t>(std::size_t(nq * hq * d));
    ok(cudaMemcpy(q, h.data(), std::size_t(nq * hq * d) * 2, cudaMemcpyHostToDevice));
    const auto t = infkv::text_tokens(n);
    tokens = dmalloc<infkv::token>(t.size());
    ok(cudaMemcpy(tokens, t.data(), t.size() * sizeof(infkv::token), cudaMemcpyHostToDevice));
    std::vector<std::int64_t> p(static_cast<std::size_t>(nq));
    for (std::int64_t i = 0; i < nq; ++i) p[std::size_t(i)] = n - nq + i;
    qpos = dmalloc<std::int64_t>(p.size());
    ok(cudaMemcpy(qpos, p.data(), p.size() * 8, cudaMemcpyHostToDevice));
  }
  ~layer() { cudaFree(k), cudaFree(v), cudaFree(q), cudaFree(tokens), cudaFree(qpos); }
  infkv::layer_inputs<> in() const {
    return {infkv::nhd(k, infkv::dtype::f16, n, hkv, d),
            infkv::nhd(v, infkv::dtype::f16, n, hkv, d),
            infkv::nhd(q, infkv::dtype::f16, nq, hq, d),
            {qpos, std::size_t(nq)},
            {tokens, std::size_t(n)},
            0.f,
            {}};
  }
};

/// Scores of one layer from a source (no pooling): the scoring kernels alone.
void score(benchmark::State& state, infkv::score_source src) {
  const layer ly(state.range(0));
  const infkv::cuda::backend be{};
  infkv::policy_spec spec{.name = "bench", .source = src, .queries = src == infkv::score_source::last_query ? 1 : 32};
  const auto in = ly.in();
  const infkv::plan p = infkv::make_plan(be, spec, {.ratio = 1.0}, infkv::shape_of(in));
  auto* ws = dmalloc<std::byte>(p.workspace_bytes);
  const std::span<std::byte> w(ws, p.workspace_bytes);
  timed(state, [&] { infkv::run_scores(p, be, in, w); });
  cudaFree(ws);
  const double key_bytes = double(ly.n) * ly.hkv * ly.d * 2;
  if (src == infkv::score_source::key_diversity) {
    state.counters["bytes_per_s"] = benchmark::Counter(3 * key_bytes, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["of_copy"] = of_copy(3 * key_bytes);  // three passes over the keys
  } else {
    const double flops = 2.0 * 2.0 * double(ly.hq) * double(spec.queries) * double(ly.n) * ly.d;  // logits twice
    state.counters["flop_per_s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["of_gemm"] = benchmark::Counter(flops / g_gemm_flops, benchmark::Counter::kIsIterationInvariantRate);
  }
}

void BM_window_scoring(benchmark::State& s) { score(s, infkv::score_source::window_attention); }
void BM_tova_scoring(benchmark::State& s) { score(s, infkv::score_source::last_query); }
void BM_keydiff(benchmark::State& s) { score(s, infkv::score_source::key_diversity); }

/// Top-k per KV head over random scores (8 heads x n), keeping n / 4 (the selection alone).
void BM_topk(benchmark::State& state) {
  const std::int64_t n = state.range(0), heads = 8;
  const infkv::cuda::backend be{};
  std::vector<float> s(static_cast<std::size_t>(heads * n));
  std::mt19937 gen(2);
  std::uniform_real_distribution<float> u;
  for (auto& x : s) x = u(gen);
  const auto t = infkv::text_tokens(n);
  auto* ds = dmalloc<float>(s.size());
  auto* dt = dmalloc<infkv::token>(t.size());
  ok(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
  ok(cudaMemcpy(dt, t.data(), t.size() * sizeof(infkv::token), cudaMemcpyHostToDevice));
  infkv::layer_inputs<> in;
  in.tokens = {dt, std::size_t(n)}, in.accumulated = {ds, heads, n, n};
  const infkv::policy_spec spec{.name = "bench", .source = infkv::score_source::accumulated};
  const infkv::plan p = infkv::make_plan(be, spec, {.capacity = n / 4, .sinks = 4, .recent = 64}, infkv::shape_of(in),
                                         {.g = infkv::granularity::per_head});
  auto* ws = dmalloc<std::byte>(p.workspace_bytes);
  auto* slots = dmalloc<std::int64_t>(std::size_t(p.kept_total));
  auto* offsets = dmalloc<std::int64_t>(std::size_t(p.offsets_size()));
  const infkv::keep_view out{slots, offsets, p.units, n};
  const std::span<std::byte> w(ws, p.workspace_bytes);
  auto* order = reinterpret_cast<std::int64_t*>(ws + p.order);
  be.time_order(in.tokens, order, w.subspan(p.backend));
  timed(state, [&] {
    be.select({ds, heads, n, n}, in.tokens, order, nullptr, p.keep_per_unit, p.keep, out, w.subspan(p.backend));
  });
  cudaFree(ds), cudaFree(dt), cudaFree(ws), cudaFree(slots), cudaFree(offsets);
}

/// Pooling along time (avg, kernel 7) of 8 rows x n.
void BM_pool(benchmark::State& state) {
  const std::int64_t n = state.range(0), rows = 8;
  const infkv::cuda::backend be{};
  auto* s = dmalloc<float>(std::size_t(rows * n));
  ok(cudaMemset(s, 0, std::size_t(rows * n) * 4));
  const auto t = infkv::text_tokens(n);
  std::vector<std::int64_t> o(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) o[std::size_t(i)] = i;
  auto* order = dmalloc<std::int64_t>(o.size());
  ok(cudaMemcpy(order, o.data(), o.size() * 8, cudaMemcpyHostToDevice));
  const infkv::policy_spec spec{.name = "bench", .pool = infkv::pooling::avg, .kernel = 7, .pool_tail = 32};
  auto* scratch = dmalloc<std::byte>(std::size_t(rows * n) * 4 + 4096);
  timed(state, [&] { be.pool({s, rows, n, n}, order, spec, {scratch, std::size_t(rows * n) * 4 + 4096}); });
  state.counters["of_copy"] = of_copy(double(rows * n) * 4 * 4 + double(rows * n) * 8 * 2);  // scores x4, order x2
  cudaFree(s), cudaFree(order), cudaFree(scratch);
}

/// Contiguous compaction of K and V (keep every other slot): kept rows copied twice (through the
/// workspace).
void BM_compact(benchmark::State& state) {
  const std::int64_t n = state.range(0), m = n / 2;
  const layer ly(n);
  std::vector<std::int64_t> s(static_cast<std::size_t>(m));
  for (std::int64_t i = 0; i < m; ++i) s[std::size_t(i)] = 2 * i;
  auto* slots = dmalloc<std::int64_t>(s.size());
  auto* offsets = dmalloc<std::int64_t>(2);
  const std::int64_t off[2] = {0, m};
  ok(cudaMemcpy(slots, s.data(), s.size() * 8, cudaMemcpyHostToDevice));
  ok(cudaMemcpy(offsets, off, 16, cudaMemcpyHostToDevice));
  const std::size_t wsb = infkv::cuda::compact_scratch_bytes(m, ly.hkv, ly.d * 2);
  auto* ws = dmalloc<std::byte>(wsb);
  auto kv = infkv::contiguous_nhd(ly.k, ly.v, infkv::dtype::f16, n, ly.hkv, ly.d);
  const std::span<infkv::token> toks(ly.tokens, std::size_t(n));
  timed(state, [&] {
    infkv::cuda::compact(kv.k, kv.v, toks, infkv::keep_view{slots, offsets, 1, n}, m, std::span<std::byte>(ws, wsb),
                         nullptr);
  });
  state.counters["of_copy"] = of_copy(2.0 * 2.0 * 2.0 * double(m) * ly.hkv * ly.d * 2);  // K, V; 2 copies; read + write
  cudaFree(slots), cudaFree(offsets), cudaFree(ws);
}

/// RoPE re-rotation of every key (delta 1000): read and written once.
void BM_rerotate(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const layer ly(n);
  std::vector<std::int64_t> d(static_cast<std::size_t>(n), 1000);
  auto* delta = dmalloc<std::int64_t>(d.size());
  ok(cudaMemcpy(delta, d.data(), d.size() * 8, cudaMemcpyHostToDevice));
  const auto keys = infkv::nhd(ly.k, infkv::dtype::f16, n, ly.hkv, ly.d);
  timed(state, [&] { infkv::cuda::rerotate(keys, delta, {}, nullptr); });
  state.counters["of_copy"] = of_copy(2.0 * double(n) * ly.hkv * ly.d * 2);  // read + write
  cudaFree(delta);
}

}  // namespace

BENCHMARK(BM_window_scoring)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tova_scoring)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_keydiff)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_topk)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_pool)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_compact)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_rerotate)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  if (!infkv::cuda::device_available()) {
    std::cerr << "infkv_bench_cuda: no CUDA device: skipped\n";
    return 77;
  }
  g_copy_bw = copy_bandwidth();
  g_gemm_flops = gemm_flops();
  benchmark::AddCustomContext("copy_bytes_per_s", std::to_string(g_copy_bw));
  benchmark::AddCustomContext("gemm_f16_flop_per_s", std::to_string(g_gemm_flops));
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
