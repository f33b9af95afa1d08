// infkv benchmarks: the CPU backend's kernels (window attention, KeyDiff, compaction, RoPE
// re-rotation, top-k selection) and what starting its threads costs. Throughput counters sit next to the ceilings of
// the same run: frac_peak = flop/s over the single-thread FMA peak times the thread count, frac_memcpy = bytes/s over
// memcpy bandwidth beyond the last-level cache (see bench_ceilings.cpp).
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include <infkv/cpu.hpp>

#include "bench_ceilings.hpp"

namespace {

using namespace infkv;

constexpr dtype dtypes[] = {dtype::f32, dtype::f16, dtype::bf16};

/// A contiguous [n][heads][d] tensor of N(0, 1) values stored as `t`, and its view.
struct nhd_buffer {
  std::vector<unsigned char> bytes;
  tensor_view view;
};

nhd_buffer random_nhd(dtype t, std::int64_t n, std::int32_t heads, std::int32_t d, std::uint32_t seed) {
  const std::int64_t count = n * heads * d;
  std::vector<float> f(static_cast<std::size_t>(count));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& x : f) x = dist(rng);
  nhd_buffer b;
  b.bytes.resize(std::size_t(count) * size_of(t));
  from_f32(t, f.data(), b.bytes.data(), count);
  b.view = nhd(b.bytes.data(), t, n, heads, d);
  return b;
}

/// Wall-clock time of a benchmark's timed loop: construct it right before `for (auto _ : state)`.
struct loop_clock {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

/// flop/s, and frac_peak: flop/s over `threads` times the single-thread FMA peak.
void add_flop_counters(benchmark::State& state, const loop_clock& clock, double flops_per_iter, int threads) {
  const double secs = clock.seconds(), total = flops_per_iter * double(state.iterations());
  state.counters["flop/s"] = benchmark::Counter(flops_per_iter, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["frac_peak"] = total / secs / (infkv_bench::peak_flops() * threads);
}

/// bytes/s, and frac_memcpy: bytes/s over the memcpy bandwidth beyond the last-level cache.
void add_byte_counters(benchmark::State& state, const loop_clock& clock, double bytes_per_iter) {
  const double secs = clock.seconds(), total = bytes_per_iter * double(state.iterations());
  state.counters["bytes/s"] =
      benchmark::Counter(bytes_per_iter, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
  state.counters["frac_memcpy"] = total / secs / infkv_bench::memcpy_bandwidth();
}

/// Times Expected Attention's finished scores (value norms off, one thread) on random f16 keys and
/// f32 queries at the positions a prompt's last m tokens have.
void expected_scores(benchmark::State& state, std::int64_t n, std::int64_t m, std::int32_t d, std::int32_t hkv,
                     std::int32_t group, int threads = 1) {
  const auto keys = random_nhd(dtype::f16, n, hkv, d, 12);
  const auto queries = random_nhd(dtype::f32, m, hkv * group, d, 13);
  const auto tokens = text_tokens(n);
  std::vector<std::int64_t> qpos(static_cast<std::size_t>(m));
  for (std::int64_t i = 0; i < m; ++i) qpos[std::size_t(i)] = n - m + i;
  const layer_inputs<> in{.keys = keys.view, .queries = queries.view, .query_pos = qpos, .tokens = tokens};
  const expected_attention ea{.window = m, .value_norm = false};
  const cpu::backend be{.ex = {threads}};
  const plan pl = make_plan(be, ea, budget{.ratio = 1.0}, shape_of(in));
  cpu::workspace ws(pl.workspace_bytes);
  const loop_clock clock;
  for (auto _ : state) benchmark::DoNotOptimize(run_scores(pl, be, in, ws.span()).data);
  const bool matrix = covariance_as_matrix(m, d, n);
  const double hq = double(hkv) * group, nd = double(n) * d;
  const double fma = matrix ? double(m) * d * (d + 1) / 2 + nd * (d + 1) + nd : nd * double(m + 1) + double(n) * m;
  add_flop_counters(state, clock, 2.0 * hq * fma, threads);
  state.SetLabel(matrix ? "matrix" : "projections");
}

/// SnapKV-style window scoring of a small GQA layer (Hkv 4, G 4, window 32, the last 32 tokens
/// as queries). flop/s counts the logits GEMM only: 2 * Hq * w * n * d per call.
void BM_window_attention(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto d = std::int32_t(state.range(1));
  const dtype t = dtypes[state.range(2)];
  const int threads = int(state.range(3));
  constexpr std::int32_t hkv = 4, group = 4, window = 32;
  const auto keys = random_nhd(t, n, hkv, d, 1);
  const auto queries = random_nhd(t, window, hkv * group, d, 2);
  const auto tokens = text_tokens(n);
  std::vector<std::int64_t> qpos(window);
  for (std::int32_t i = 0; i < window; ++i) qpos[std::size_t(i)] = n - window + i;
  layer_inputs<> in;
  in.keys = keys.view;
  in.queries = queries.view;
  in.query_pos = qpos;
  in.tokens = tokens;
  const cpu::executor ex{threads};
  const loop_clock clock;
  for (auto _ : state) {
    auto s = cpu::window_attention(in, ex);
    benchmark::DoNotOptimize(s.data.data());
  }
  add_flop_counters(state, clock, 2.0 * hkv * group * window * double(n) * d, threads);
  state.SetLabel(to_string(t));
}
BENCHMARK(BM_window_attention)
    ->ArgNames({"n", "d", "dtype", "threads"})
    ->ArgsProduct({{1024, 4096, 16384}, {64, 128}, {0, 1, 2}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

/// KeyDiff scores (Hkv 4, d 128): bytes/s counts key bytes read.
void BM_keydiff_scores(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const dtype t = dtypes[state.range(1)];
  const int threads = int(state.range(2));
  constexpr std::int32_t hkv = 4, d = 128;
  const auto keys = random_nhd(t, n, hkv, d, 3);
  const cpu::executor ex{threads};
  const loop_clock clock;
  for (auto _ : state) {
    auto s = cpu::keydiff_scores(keys.view, ex);
    benchmark::DoNotOptimize(s.data.data());
  }
  add_byte_counters(state, clock, double(keys.bytes.size()));
  state.SetLabel(to_string(t));
}
BENCHMARK(BM_keydiff_scores)
    ->ArgNames({"n", "dtype", "threads"})
    ->ArgsProduct({{4096, 16384, 65536}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

/// In-place compaction of a contiguous NHD cache (K and V, Hkv 8, d 128) keeping a random half of
/// the slots: bytes/s counts the bytes of K and V rows that actually move.
void BM_compact_contiguous(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const dtype t = dtypes[state.range(1)];
  constexpr std::int32_t hkv = 8, d = 128;
  auto k = random_nhd(t, n, hkv, d, 4), v = random_nhd(t, n, hkv, d, 5);
  std::vector<std::int64_t> slots;
  std::mt19937 rng(6);
  for (std::int64_t j = 0; j < n; ++j)
    if (rng() & 1u) slots.push_back(j);
  keep_set keep(n);
  keep.add_unit(slots);
  std::int64_t moved = 0;
  for (std::size_t i = 0; i < slots.size(); ++i) moved += slots[i] != std::int64_t(i) ? 1 : 0;
  auto tokens = text_tokens(n);
  const loop_clock clock;
  for (auto _ : state) {
    kv_view kv{k.view, v.view};  // a fresh full-size view: the contents do not affect the cost
    benchmark::DoNotOptimize(cpu::compact(kv, tokens, keep));
    benchmark::ClobberMemory();
  }
  add_byte_counters(state, clock, 2.0 * double(moved) * hkv * d * double(size_of(t)));
  state.SetLabel(to_string(t));
}
BENCHMARK(BM_compact_contiguous)
    ->ArgNames({"n", "dtype"})
    ->ArgsProduct({{4096, 16384, 65536}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

/// RoPE re-rotation of every slot by its own delta (Hkv 8, d 128, keys only, in place): bytes/s
/// counts the key bytes rotated (each read and written once).
void BM_rerotate(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const dtype t = dtypes[state.range(1)];
  const int threads = int(state.range(2));
  constexpr std::int32_t hkv = 8, d = 128;
  auto k = random_nhd(t, n, hkv, d, 7);
  std::vector<std::int64_t> delta(static_cast<std::size_t>(n));
  std::mt19937 rng(8);
  for (auto& x : delta) x = -1 - std::int64_t(rng() % 4096);
  const cpu::executor ex{threads};
  const loop_clock clock;
  for (auto _ : state) {
    cpu::rerotate(k.view, delta, cpu::rope{}, ex);
    benchmark::ClobberMemory();
  }
  add_byte_counters(state, clock, double(k.bytes.size()));
  state.SetLabel(to_string(t));
}
BENCHMARK(BM_rerotate)
    ->ArgNames({"n", "dtype", "threads"})
    ->ArgsProduct({{4096, 16384, 65536}, {0, 1}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

/// Top-k selection per KV head (4 rows, keep 25%, 4 sinks, 32 recent): items/s counts scores.
void BM_select_top(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  constexpr std::int64_t rows = 4;
  score_matrix s(rows, n);
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(0.f, 1.f);
  for (auto& x : s.data) x = dist(rng);
  const auto tokens = text_tokens(n);
  budget b;
  b.ratio = 0.25;
  b.sinks = 4;
  b.recent = 32;
  const loop_clock clock;
  for (auto _ : state) {
    auto keep = cpu::select_top(s, tokens, b);
    benchmark::DoNotOptimize(keep.n_units());
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * rows * n);
}
BENCHMARK(BM_select_top)->ArgName("n")->Arg(4096)->Arg(16384)->Arg(65536)->UseRealTime()->Unit(benchmark::kMicrosecond);

/// One layer's whole selection through the convenience call (score, pool, bias, top-k; Hkv 4,
/// G 4, window 32, d 128, f16 keys, capacity n / 4): items/s counts slots.
struct policy_layer {
  static constexpr std::int32_t hkv = 4, group = 4, d = 128, window = 32;
  std::int64_t n;
  nhd_buffer keys, queries;
  std::vector<token> tokens;
  std::vector<std::int64_t> qpos;
  layer_inputs<> in;
  budget b;

  explicit policy_layer(std::int64_t n_slots)
      : n(n_slots),
        keys(random_nhd(dtype::f16, n, hkv, d, 10)),
        queries(random_nhd(dtype::f32, window, hkv * group, d, 11)),
        tokens(text_tokens(n)) {
    for (std::int32_t i = 0; i < window; ++i) qpos.push_back(n - window + i);
    in.keys = keys.view;
    in.queries = queries.view;
    in.query_pos = qpos;
    in.tokens = tokens;
    b.capacity = n / 4;
    b.sinks = 4;
    b.recent = 32;
  }
  policy_layer(const policy_layer&) = delete;
};

template <class P>
void policy_select(benchmark::State& state, const P& policy) {
  const std::int64_t n = state.range(0);
  const policy_layer l(n);
  for (auto _ : state) {
    auto keep = cpu::select(policy, l.b, l.in, granularity::per_head);
    benchmark::DoNotOptimize(keep.n_units());
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * n);
}
void BM_select_snapkv(benchmark::State& state) {
  policy_select(state, snapkv{.window = 32, .kernel = 7, .pool = pooling::max});
}
void BM_select_inf_mllm_bias(benchmark::State& state) {
  policy_select(state, inf_mllm{.window = 32, .bias = {.beta = 8.0}});
}
void BM_select_keydiff(benchmark::State& state) { policy_select(state, keydiff{}); }
BENCHMARK(BM_select_snapkv)->ArgName("n")->Arg(4096)->Arg(16384)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_inf_mllm_bias)->ArgName("n")->Arg(4096)->Arg(16384)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_keydiff)->ArgName("n")->Arg(4096)->Arg(16384)->UseRealTime()->Unit(benchmark::kMillisecond);

/// The same SnapKV selection as BM_select_snapkv, planned once and run in a reused workspace
/// (what an engine's decode loop does): the difference is the convenience call's allocations.
void BM_pipeline_run_snapkv(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const policy_layer l(n);
  const cpu::backend be{};
  const plan pl = make_plan(be, snapkv{.window = 32, .kernel = 7, .pool = pooling::max}, l.b, shape_of(l.in));
  cpu::workspace ws(pl.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size())), slots(std::size_t(pl.kept_total));
  const keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
  for (auto _ : state) {
    run(pl, be, l.in, ws.span(), out);
    benchmark::DoNotOptimize(slots.data());
  }
  state.SetItemsProcessed(std::int64_t(state.iterations()) * n);
}
BENCHMARK(BM_pipeline_run_snapkv)->ArgName("n")->Arg(4096)->Arg(16384)->UseRealTime()->Unit(benchmark::kMillisecond);

/// Expected Attention scoring of one layer (Hkv 4, G 4, f16 keys, value norms off), its
/// statistics from the last m queries, in the covariance form the backend picks for the shapes
/// (covariance_as_matrix): flop/s counts that form's multiply-adds, 2 Hq (n (m + 1) d + n m) for
/// the projections (mu' and the m centred queries against every key, the squares), 2 Hq
/// (m d (d + 1) / 2 + n (d + 1) d + n d) for the matrix (the covariance's upper triangle, mu' and
/// Sigma' against every key, k' (Sigma' k)).
void BM_expected_attention(benchmark::State& state) {
  const std::int64_t n = state.range(0), m = state.range(1);
  const auto d = std::int32_t(state.range(2));
  constexpr std::int32_t hkv = 4, group = 4;
  expected_scores(state, n, m, d, hkv, group);
}
BENCHMARK(BM_expected_attention)
    ->ArgNames({"n", "m", "d"})
    ->ArgsProduct({{2048, 16384}, {64, 1024, 8192}, {64, 128}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

/// The same on the shapes of SmolLM2-135M's layers (3 KV heads x 3, d = 64, a 1501-token prompt)
/// with kvpress's statistics (every query after its 4 sinks: m = 1497) and with the last 64
/// queries: one layer of the comparison with kvpress's ExpectedAttentionPress.score()
/// (scripts/kvpress_expected.py), on 1 or 2 threads.
void BM_expected_attention_smollm2(benchmark::State& state) {
  expected_scores(state, 1501, state.range(0), 64, 3, 3, int(state.range(1)));
}
BENCHMARK(BM_expected_attention_smollm2)
    ->ArgNames({"m", "threads"})
    ->ArgsProduct({{64, 1497}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

/// What starting a parallel loop of 2 workers costs: threads spawned for the loop (pool 0)
/// against a persistent pool lent through the executor (pool 1). The jobs do nothing.
void BM_parallel_loop_start(benchmark::State& state) {
  cpu::thread_pool pool(2);
  const cpu::executor ex{.threads = 2, .pool = state.range(0) ? &pool : nullptr};
  for (auto _ : state) cpu::parallel_for(ex, 2, [](std::int64_t i) { benchmark::DoNotOptimize(i); });
}
BENCHMARK(BM_parallel_loop_start)->ArgName("pool")->Arg(0)->Arg(1)->UseRealTime()->Unit(benchmark::kMicrosecond);

/// The planned SnapKV run of BM_pipeline_run_snapkv on 2 threads, spawned for every parallel loop
/// (pool 0) or lent once (pool 1), where an engine evicts small caches often: flop/s counts the
/// logits GEMM (2 * Hq * w * n * d), frac_peak against twice the single-thread FMA peak.
void BM_pipeline_run_threads(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const policy_layer l(n);
  cpu::thread_pool pool(2);
  const cpu::backend be{.ex = {.threads = 2, .pool = state.range(1) ? &pool : nullptr}};
  const plan pl = make_plan(be, snapkv{.window = 32, .kernel = 7, .pool = pooling::max}, l.b, shape_of(l.in));
  cpu::workspace ws(pl.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size())), slots(std::size_t(pl.kept_total));
  const keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
  const loop_clock clock;
  for (auto _ : state) {
    run(pl, be, l.in, ws.span(), out);
    benchmark::DoNotOptimize(slots.data());
  }
  add_flop_counters(state, clock, 2.0 * l.hkv * l.group * l.window * double(n) * l.d, 2);
}
BENCHMARK(BM_pipeline_run_threads)
    ->ArgNames({"n", "pool"})
    ->ArgsProduct({{1024, 4096}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
