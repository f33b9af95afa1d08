// infkv CUDA backend benchmarks (Google Benchmark, CUDA-event timing): each kernel at realistic
// shapes (head dim 128, 8 KV heads, 4K-128K slots, window 32, f16), reported as bytes/s next to
// a device-to-device copy and as flop/s next to a tensor-core GEMM (cuBLAS f16, f32 accumulate),
// both measured in the same binary. Counters: `of_copy` (fraction of the copy bandwidth, counted
// on the least traffic the step needs) for memory-bound kernels, `of_gemm` for the scoring of
// window queries. Needs a device; exits 77 without one.
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <infkv/cuda.hpp>

#include "cost_model.hpp"

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

double g_copy_bw = 0, g_gemm_flops = 0, g_sgemm_flops = 0;
infkv::cuda::status_word* g_status = nullptr;  // every benchmark's status word (checked at the end)

/// A kernel's memory traffic (bytes read + written) per iteration as a fraction of the copy's
/// (which reads and writes each byte it copies).
benchmark::Counter of_copy(double traffic) {
  return benchmark::Counter(traffic / (2 * g_copy_bw), benchmark::Counter::kIsIterationInvariantRate);
}

/// Rates of a kernel against the cost model's least traffic and FLOPs: bytes/s and the fraction
/// of the copy bandwidth; flop/s and the fraction of the GEMM peak where it computes (the f16
/// tensor-core GEMM's, or the f32 GEMM's for a kernel whose products are f32).
void report(benchmark::State& state, const infkv_bench::cost& c) {
  using benchmark::Counter;
  state.counters["bytes_per_s"] = Counter(c.bytes, Counter::kIsIterationInvariantRate);
  state.counters["of_copy"] = of_copy(c.bytes);
  if (c.flops > 0) {
    state.counters["flop_per_s"] = Counter(c.flops, Counter::kIsIterationInvariantRate);
    state.counters["of_gemm"] =
        Counter(c.flops / (c.f32 ? g_sgemm_flops : g_gemm_flops), Counter::kIsIterationInvariantRate);
  }
}

/// The cost model's case for a layer of n slots (the benchmarks' shapes), `kept` slots kept.
infkv_bench::layer_case shape(std::int64_t n, std::int64_t kept, std::int64_t window = 32) {
  return {.n = n, .hkv = 8, .hq = 32, .d = 128, .m = window, .elem = 2, .kept = kept};
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

/// GEMM flop/s of cuBLAS, 8192^3, best of 10: f16 inputs on tensor cores (f32 accumulate), or f32
/// throughout (CUBLAS_COMPUTE_32F: no TF32).
double gemm_flops(bool f32) {
  const int n = 8192;
  const std::size_t elem = f32 ? 4 : 2;
  const cudaDataType_t type = f32 ? CUDA_R_32F : CUDA_R_16F;
  auto* a = dmalloc<char>(std::size_t(n) * n * elem);
  auto* b = dmalloc<char>(std::size_t(n) * n * elem);
  auto* c = dmalloc<float>(std::size_t(n) * n);
  ok(cudaMemset(a, 0, std::size_t(n) * n * elem)), ok(cudaMemset(b, 0, std::size_t(n) * n * elem));
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
  const float one = 1, zero = 0;
  cudaEvent_t e0, e1;
  ok(cudaEventCreate(&e0)), ok(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    ok(cudaEventRecord(e0));
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, type, n, b, type, n, &zero, c, CUDA_R_32F, n,
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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

/// One layer on the device: f16 keys [n][8][128], the last 32 (or `queries`) queries of 32 query
/// heads, positions 0..n-1.
struct layer {
  std::int64_t n;
  std::int32_t hkv = 8, hq = 32, d = 128;
  std::int64_t nq = 32;
  void *k = nullptr, *v = nullptr, *q = nullptr;
  infkv::token* tokens = nullptr;
  std::int64_t* qpos = nullptr;
  explicit layer(std::int64_t slots, std::int64_t queries = 32) : n(slots), nq(queries) {
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
void score(benchmark::State& state, infkv::policy_spec spec) {
  const layer ly(state.range(0));
  const infkv::cuda::backend be{nullptr, g_status};
  const infkv::score_source src = spec.score.source;
  spec.score.pool = infkv::pooling::none, spec.score.value_norm = false, spec.score.bias = {};
  const auto in = ly.in();
  const infkv::plan p = infkv::make_plan(be, spec, {.ratio = 1.0}, infkv::shape_of(in));
  auto* ws = dmalloc<std::byte>(p.workspace_bytes);
  const std::span<std::byte> w(ws, p.workspace_bytes);
  timed(state, [&] { infkv::run_scores(p, be, in, w); });
  cudaFree(ws);
  const auto c = shape(ly.n, ly.n, spec.score.queries);
  report(state, src == infkv::score_source::key_diversity        ? infkv_bench::keydiff(c)
                : src == infkv::score_source::expected_attention ? infkv_bench::expected_attention(c)
                : src == infkv::score_source::last_query         ? infkv_bench::window_scoring(c, 1)
                                                                 : infkv_bench::window_scoring(c, spec.score.queries));
}

void BM_window_scoring(benchmark::State& s) { score(s, infkv::snapkv{.window = 32}.spec()); }
void BM_tova_scoring(benchmark::State& s) { score(s, infkv::tova{}.spec()); }
void BM_keydiff(benchmark::State& s) { score(s, infkv::keydiff{}.spec()); }
void BM_expected_attention(benchmark::State& s) { score(s, infkv::expected_attention{.window = 32}.spec()); }

/// H2O's accumulation of one decode step (one query of 32 heads) over n slots of 8 KV heads.
void BM_h2o_observe(benchmark::State& state) {
  const layer ly(state.range(0), 1);
  const auto in = ly.in();
  const std::int64_t n = ly.n;
  auto* st = dmalloc<float>(std::size_t(3 * ly.hkv * n));
  ok(cudaMemset(st, 0, std::size_t(3 * ly.hkv * n) * 4));
  const infkv::cuda::h2o_state_view view{st, st + ly.hkv * n, st + 2 * ly.hkv * n, ly.hkv, n, n};
  const std::size_t wsb = infkv::cuda::h2o_scratch_bytes(infkv::shape_of(in));
  auto* ws = dmalloc<std::byte>(wsb);
  timed(state, [&] { infkv::cuda::h2o_observe(view, infkv::h2o{}, in, {ws, wsb}, g_status, nullptr); });
  report(state, infkv_bench::h2o_observe(shape(n, n, 1)));
  cudaFree(st), cudaFree(ws);
}

/// Top-k per KV head over random scores (8 heads x n), keeping n / 4 (the selection alone; with
/// AdaKV's allocation between heads first when `adakv`).
void select(benchmark::State& state, bool adakv) {
  const std::int64_t n = state.range(0), heads = 8;
  const infkv::cuda::backend be{nullptr, g_status};
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
  const infkv::policy_spec spec{.name = "bench", .score = {.source = infkv::score_source::accumulated}};
  infkv::plan_options opt{.g = infkv::granularity::per_head};
  if (adakv) opt.adakv = infkv::adakv{.alpha = 0.2};
  const infkv::plan p =
      infkv::make_plan(be, spec, {.capacity = n / 4, .sinks = 4, .recent = 64}, infkv::shape_of(in), opt);
  auto* ws = dmalloc<std::byte>(p.workspace_bytes);
  auto* slots = dmalloc<std::int64_t>(std::size_t(p.kept_total));
  auto* offsets = dmalloc<std::int64_t>(std::size_t(p.offsets_size()));
  const infkv::keep_view out{slots, offsets, p.units, n};
  const std::span<std::byte> w(ws, p.workspace_bytes);
  auto* order = reinterpret_cast<std::int64_t*>(ws + p.order);
  be.time_order(in.tokens, order, w.subspan(p.backend));
  auto* caps = adakv ? reinterpret_cast<std::int64_t*>(ws + p.caps) : nullptr;
  timed(state, [&] {
    if (adakv)
      be.allocate(*opt.adakv, {ds, heads, n, n}, order, p.effective, p.keep_per_unit, caps, w.subspan(p.backend));
    be.keep_top({ds, heads, n, n}, in.tokens, order, caps, p.keep_per_unit, p.effective, out, w.subspan(p.backend));
  });
  report(state, infkv_bench::selection(shape(n, p.keep_per_unit)));
  cudaFree(ds), cudaFree(dt), cudaFree(ws), cudaFree(slots), cudaFree(offsets);
}
void BM_topk(benchmark::State& s) { select(s, false); }
void BM_adakv(benchmark::State& s) { select(s, true); }

/// Pooling along time (avg, kernel 7) of 8 rows x n.
void BM_pool(benchmark::State& state) {
  const std::int64_t n = state.range(0), rows = 8;
  const infkv::cuda::backend be{nullptr, g_status};
  auto* s = dmalloc<float>(std::size_t(rows * n));
  ok(cudaMemset(s, 0, std::size_t(rows * n) * 4));
  const auto t = infkv::text_tokens(n);
  std::vector<std::int64_t> o(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) o[std::size_t(i)] = i;
  auto* order = dmalloc<std::int64_t>(o.size());
  ok(cudaMemcpy(order, o.data(), o.size() * 8, cudaMemcpyHostToDevice));
  const infkv::score_spec spec{.pool = infkv::pooling::avg, .kernel = 7, .pool_tail = 32};
  auto* scratch = dmalloc<std::byte>(std::size_t(rows * n) * 4 + 4096);
  timed(state, [&] { be.pool({s, rows, n, n}, order, spec, {scratch, std::size_t(rows * n) * 4 + 4096}); });
  state.counters["of_copy"] = of_copy(double(rows * n) * 4 * 4 + double(rows * n) * 8 * 2);  // scores x4, order x2
  cudaFree(s), cudaFree(order), cudaFree(scratch);
}

/// Compaction of K and V (keep every other slot), contiguous or paged (pages of 16 slots);
/// counted on the least traffic: every moved row read and written once.
void compact(benchmark::State& state, bool paged) {
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
  const infkv::keep_view keep{slots, offsets, 1, n};
  const std::span<std::byte> w(ws, wsb);
  const std::int32_t page = 16;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n / page));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::int32_t(ids.size() - 1 - i);  // pages in reverse
  auto* pages = dmalloc<std::int32_t>(ids.size());
  ok(cudaMemcpy(pages, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  const std::int64_t row = std::int64_t(ly.hkv) * ly.d;
  const infkv::paged_rows pk{{ly.k, page * row, row, ly.d}, pages, infkv::dtype::f16, n, ly.hkv, ly.d, page},
      pv{{ly.v, page * row, row, ly.d}, pages, infkv::dtype::f16, n, ly.hkv, ly.d, page};
  timed(state, [&] {
    if (paged)
      infkv::cuda::compact(pk, pv, toks, keep, m, w, g_status, nullptr);
    else
      infkv::cuda::compact(kv.k, kv.v, toks, keep, m, w, g_status, nullptr);
  });
  report(state, infkv_bench::compaction(shape(n, m)));
  cudaFree(slots), cudaFree(offsets), cudaFree(ws), cudaFree(pages);
}
void BM_compact(benchmark::State& s) { compact(s, false); }
void BM_compact_paged(benchmark::State& s) { compact(s, true); }

/// RoPE re-rotation of every key (delta 1000): read and written once.
void BM_rerotate(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const layer ly(n);
  std::vector<std::int64_t> d(static_cast<std::size_t>(n), 1000);
  auto* delta = dmalloc<std::int64_t>(d.size());
  ok(cudaMemcpy(delta, d.data(), d.size() * 8, cudaMemcpyHostToDevice));
  const auto keys = infkv::nhd(ly.k, infkv::dtype::f16, n, ly.hkv, ly.d);
  timed(state, [&] { infkv::cuda::rerotate(keys, delta, {}, g_status, nullptr); });
  report(state, infkv_bench::rerotate(shape(n, n)));
  cudaFree(delta);
}

}  // namespace

BENCHMARK(BM_window_scoring)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_tova_scoring)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_keydiff)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_expected_attention)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_h2o_observe)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_topk)->Arg(4096)->Arg(32768)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_adakv)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_pool)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_compact)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_compact_paged)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_rerotate)->Arg(4096)->Arg(131072)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  if (!infkv::cuda::device_available()) {
    std::cerr << "infkv_bench_cuda: no CUDA device: skipped\n";
    return 77;
  }
  g_copy_bw = copy_bandwidth();
  g_gemm_flops = gemm_flops(false);
  g_sgemm_flops = gemm_flops(true);
  g_status = dmalloc<infkv::cuda::status_word>(1);
  infkv::cuda::reset_status(g_status, nullptr);
  benchmark::AddCustomContext("copy_bytes_per_s", std::to_string(g_copy_bw));
  benchmark::AddCustomContext("gemm_f16_flop_per_s", std::to_string(g_gemm_flops));
  benchmark::AddCustomContext("gemm_f32_flop_per_s", std::to_string(g_sgemm_flops));
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  infkv::cuda::check(g_status, nullptr, "infkv_bench_cuda");  // random inputs: nothing may be recorded
  return 0;
}
