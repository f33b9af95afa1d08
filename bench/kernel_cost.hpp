// infkv CUDA backend: a cost model of the kernels as written. One eviction runs on the host
// through the very steps the GPU runs (cuda/detail/*.hpp), with a launcher that records, for
// every kernel the device launcher would launch, its grid, its block, its shared memory, the
// distinct bytes it reads and writes (traffic_arena: every buffer lives in an arena whose pages
// report their first read and first write), the tensor-core FLOPs its warps' tile products do and
// the exponentials its block-level steps evaluate (counted by the host emulation's blocks). CUB's
// sort and scan and cuBLAS's GEMM are recorded from their arguments (their launches and traffic
// as those libraries do them). Each launch is then timed on a GPU model (gpu_model): a launch
// gap, then the slowest of its memory traffic, its tensor-core work and its exponentials at the
// share of the GPU its grid can occupy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <infkv/infkv.hpp>

#include "cuda/host_launcher.hpp"
#include "traffic.hpp"

namespace infkv_bench {

/// One kernel launch (or one library call: `count` kernels) as the code makes it.
struct launch_record {
  std::string step;  ///< the pipeline primitive or cache step that made it
  std::string kind;  ///< for_each, for_blocks, sort, scan, gemm
  std::int64_t blocks = 0, threads = 0, shared = 0, items = 0;
  int count = 1;  ///< kernels it is on a GPU (CUB's sort: a histogram and one per 8-bit digit)
  double read = 0, written = 0, tc_flops = 0, exps = 0;
  bool f32 = false;  ///< its products are f32 GEMMs (CUDA cores), not 16-bit ones on tensor cores
};

/// What one H200 (SXM) does, and what fraction of it this code may reach. Every number is a
/// parameter of the model, written out with the results.
struct gpu_model {
  std::string name = "H200 SXM";
  int sms = 132;
  double bandwidth = 4.8e12;    ///< HBM3e bytes/s
  double bandwidth_eff = 0.85;  ///< fraction a copy reaches
  double tc_peak = 989e12;      ///< dense f16 tensor-core FLOP/s
  double tc_eff = 0.5;          ///< fraction WMMA (mma.sync, not wgmma) tiles among other work reach
  double f32_peak = 67e12;      ///< f32 FLOP/s (cuBLAS f32 GEMMs: Expected Attention), at tc_eff too
  double exp_rate = 2.1e12;     ///< expf with the scalar work around it (~16 FP32 instructions, 128 lanes
                                ///< per SM per clock at 1.98 GHz)
  double latency = 0.6e-6;      ///< a global load's round trip (s)
  double in_flight = 32;        ///< bytes each resident thread keeps in flight
  double launch_gap = 1.5e-6;   ///< between two dependent kernels of a captured graph (s)
  std::int64_t shared_per_sm = 227 * 1024, threads_per_sm = 2048, blocks_per_sm = 32;

  /// Blocks of `threads` threads using `shared` bytes each that one SM holds at once.
  std::int64_t resident(std::int64_t threads, std::int64_t shared) const {
    std::int64_t r = std::min(blocks_per_sm, threads_per_sm / std::max<std::int64_t>(threads, 1));
    if (shared > 0) r = std::min(r, shared_per_sm / shared);
    return std::max<std::int64_t>(r, 1);
  }
  /// Seconds the launch takes by this model, and the terms it took the slowest of.
  struct timing {
    double total = 0, memory = 0, tensor = 0, exp = 0, sm_share = 0, memory_share = 0;
  };
  timing time(const launch_record& l) const {
    timing t;
    const std::int64_t slots = sms * resident(l.threads, l.shared);
    const std::int64_t waves = std::max<std::int64_t>((l.blocks + slots - 1) / slots, 1);
    // The SMs' share: a grid within one wave occupies min(blocks, SMs) SMs; a longer one loses its
    // last wave's empty slots.
    t.sm_share = l.blocks <= slots ? double(std::min<std::int64_t>(l.blocks, sms)) / double(sms)
                                   : double(l.blocks) / double(waves * slots);
    // The memory's share: Little's law, the bytes the resident threads keep in flight over the
    // round trip, against the bandwidth.
    const double threads = double(std::min<std::int64_t>(l.blocks, slots) * l.threads);
    t.memory_share = std::min(1.0, threads * in_flight / latency / (bandwidth * bandwidth_eff));
    t.memory = (l.read + l.written) / (bandwidth * bandwidth_eff * t.memory_share);
    t.tensor = l.tc_flops / ((l.f32 ? f32_peak : tc_peak) * tc_eff * t.sm_share);
    t.exp = l.exps / (exp_rate * t.sm_share);
    t.total = launch_gap * l.count + std::max({t.memory, t.tensor, t.exp});
    return t;
  }
};

/// Where the recording launcher writes (one recording at a time).
struct recording {
  traffic_arena* arena = nullptr;
  std::string step = "?";
  std::vector<launch_record> launches;
  /// Buffers counted per sector (traffic_arena::begin) while set: those a step gathers from.
  const void *precise_begin = nullptr, *precise_end = nullptr;
  void begin() const { arena->begin(precise_begin, precise_end); }
};
inline recording* current_recording = nullptr;

/// The host launcher (tests/cuda/host_launcher.hpp) with every launch recorded: the steps run as
/// they do in the tests, so what is recorded is what the code does for this input.
struct recording_launcher : infkv_test::host_launcher {
  using base = infkv_test::host_launcher;

  static recording& rec() { return *current_recording; }

  template <class F>
  void for_each(std::int64_t n, F f) const {
    if (n <= 0) return;  // the device launcher launches nothing
    launch_record r{.step = rec().step, .kind = "for_each", .blocks = (n + 255) / 256, .threads = 256, .items = n};
    rec().begin();
    base::for_each(n, f);
    const auto fp = rec().arena->end();
    r.read = fp.read, r.written = fp.written;
    rec().launches.push_back(r);
  }

  template <class F>
  void for_blocks(std::int64_t blocks, int threads, std::size_t shared, F f) const {
    if (blocks <= 0) return;
    launch_record r{.step = rec().step,
                    .kind = "for_blocks",
                    .blocks = blocks,
                    .threads = threads,
                    .shared = std::int64_t(shared),
                    .items = blocks * threads};
    const double flops0 = infkv_test::fiber_block::product_flops, exps0 = infkv_test::fiber_block::exps;
    rec().begin();
    base::for_blocks(blocks, threads, shared, f);
    const auto fp = rec().arena->end();
    r.read = fp.read, r.written = fp.written;
    r.tc_flops = infkv_test::fiber_block::product_flops - flops0, r.exps = infkv_test::fiber_block::exps - exps0;
    rec().launches.push_back(r);
  }

  struct temp_space {
    /// CUB's onesweep radix sort of (8-byte key, 8-byte value) pairs: one histogram kernel reading
    /// the keys, then per 8-bit digit one kernel reading and writing keys and values.
    void sort_pairs(const std::uint64_t* kin, std::uint64_t* kout, const std::int64_t* vin, std::int64_t* vout,
                    std::int64_t n, int bits) const {
      if (n <= 0) return;
      const int passes = (std::max(bits, 1) + 7) / 8;
      rec().launches.push_back({.step = rec().step,
                                .kind = "sort",
                                .blocks = (n + 255) / 256,
                                .threads = 256,
                                .items = n,
                                .count = 1 + passes,
                                .read = double(n) * (8 + 16 * passes),
                                .written = double(n) * 16 * passes});
      base::temp_space{}.sort_pairs(kin, kout, vin, vout, n, bits);
    }
    /// CUB's exclusive sum: a tile-status initialisation and one single-pass scan kernel.
    void exclusive_scan(const std::int64_t* in, std::int64_t* out, std::int64_t n) const {
      if (n <= 0) return;
      rec().launches.push_back({.step = rec().step,
                                .kind = "scan",
                                .blocks = (n + 255) / 256,
                                .threads = 256,
                                .items = n,
                                .count = 2,
                                .read = double(n) * 8,
                                .written = double(n) * 8});
      base::temp_space{}.exclusive_scan(in, out, n);
    }
  };
  temp_space temp(std::span<std::byte>) const { return {}; }

  struct gemmer {
    /// cuBLAS's strided batched GEMM: A and B read once, C written (and read when beta != 0).
    void gemm_strided_batched(infkv::cuda::blas_op ta, infkv::cuda::blas_op tb, std::int64_t m, std::int64_t n,
                              std::int64_t k, float alpha, const void* a, infkv::dtype at, std::int64_t lda,
                              std::int64_t sa, const void* b, infkv::dtype bt, std::int64_t ldb, std::int64_t sb,
                              float beta, void* c, infkv::dtype ct, std::int64_t ldc, std::int64_t sc,
                              std::int64_t batch) const {
      const double ea = double(infkv::size_of(at)), eb = double(infkv::size_of(bt));
      rec().launches.push_back(
          {.step = rec().step,
           .kind = "gemm",
           .blocks = (m * n * batch + 16383) / 16384,
           .threads = 256,
           .items = m * n * batch,
           .read = double(batch) * (double(m * k) * ea + double(k * n) * eb + (beta != 0.f ? double(m * n) * 4 : 0.0)),
           .written = double(batch) * double(m * n) * 4,
           .tc_flops = 2.0 * double(m) * double(n) * double(k) * double(batch),
           .f32 = at == infkv::dtype::f32});
      infkv_test::host_gemm_strided_batched(ta, tb, m, n, k, alpha, a, at, lda, sa, b, bt, ldb, sb, beta, c, ct, ldc,
                                            sc, batch);
    }
  };
  gemmer gemm_scratch(std::span<std::byte>) const { return {}; }
};

/// A backend that names the primitive each launch comes from, then runs B's.
template <class B>
struct labelled {
  B be;
  template <class... A>
  std::size_t scratch_bytes(const A&... a) const {
    return be.scratch_bytes(a...);
  }
#define INFKV_LABELLED(name)         \
  template <class... A>              \
  void name(A&&... a) const {        \
    current_recording->step = #name; \
    be.name(std::forward<A>(a)...);  \
  }
  INFKV_LABELLED(time_order)
  INFKV_LABELLED(score)
  INFKV_LABELLED(value_norm)
  INFKV_LABELLED(pool)
  INFKV_LABELLED(group_mean)
  INFKV_LABELLED(fill_tail)
  INFKV_LABELLED(bias)
  INFKV_LABELLED(reduce)
  INFKV_LABELLED(finish_reduction)
  INFKV_LABELLED(allocate)
  INFKV_LABELLED(keep_top)
  INFKV_LABELLED(mark)
#undef INFKV_LABELLED
};

/// The group of the cost table a recorded step belongs to.
inline std::string group_of(const std::string& step) {
  if (step == "time_order") return "time order";
  if (step == "score") return "window scoring";
  if (step == "keep_top" || step == "allocate" || step == "mark") return "selection";
  if (step == "compact") return "compaction";
  return "score finishing";
}

/// The layer of the reference eviction: n slots, 8 KV heads, 32 query heads, head_dim 128, a
/// window of 32 queries.
struct layer_data {
  std::int64_t n = 131072, hkv = 8, hq = 32, d = 128, w = 32;
  int position_bits = 31;  ///< the backend's promise (basic_backend::position_bits)
};

/// One eviction of the case by `spec` (SnapKV's by default), keys strided or paged, recorded; the
/// compaction of K and V after it unless `compact` is false.
inline std::vector<launch_record> record_eviction(const layer_data& c, std::int64_t kept, bool paged,
                                                  const infkv::policy_spec& spec = infkv::snapkv{}.spec(),
                                                  bool compact = true) {
  const std::int64_t row = c.hkv * c.d, n = c.n;
  const std::int32_t page = 16;
  const std::int64_t pages = (n + page - 1) / page;
  const std::size_t kv_bytes = std::size_t(pages * page * row) * 2;
  const infkv::layer_shape shape{.n_slots = n,
                                 .kv_heads = std::int32_t(c.hkv),
                                 .q_heads = std::int32_t(c.hq),
                                 .head_dim = std::int32_t(c.d),
                                 .n_queries = c.w};
  const infkv::budget b{.capacity = kept};
  // Plan first (its sizes), with a backend that records nowhere.
  labelled<infkv::cuda::basic_backend<recording_launcher>> be;
  const infkv::plan pl = infkv::make_plan(be, spec, b, shape);
  const std::size_t compact_ws = infkv::cuda::compact_scratch_bytes(pl.keep_per_unit, std::int32_t(c.hkv), c.d * 2);
  traffic_arena arena(2 * kv_bytes + std::size_t(c.w * c.hq * c.d) * 2 + std::size_t(n) * sizeof(infkv::token) * 9 +
                      pl.workspace_bytes + std::size_t(pl.kept_total + pl.offsets_size()) * 8 + compact_ws +
                      (std::size_t(64) << 20));
  // What the compaction gathers from (K, V, the per-head token lists) first: one precise range.
  auto* k = arena.take<std::uint16_t>(kv_bytes / 2);
  auto* v = arena.take<std::uint16_t>(kv_bytes / 2);
  auto* head_tokens = arena.take<infkv::token>(std::size_t(n * c.hkv));
  auto* q = arena.take<std::uint16_t>(std::size_t(c.w * c.hq * c.d));
  auto* tokens = arena.take<infkv::token>(std::size_t(n));
  auto* qpos = arena.take<std::int64_t>(std::size_t(c.w));
  auto* page_ids = arena.take<std::int32_t>(std::size_t(pages));
  auto* ws = arena.take<std::byte>(pl.workspace_bytes);
  auto* slots = arena.take<std::int64_t>(std::size_t(pl.kept_total));
  auto* offsets = arena.take<std::int64_t>(std::size_t(pl.offsets_size()));
  auto* cws = arena.take<std::byte>(compact_ws);
  auto* status = arena.take<infkv::cuda::status_word>(1);
  std::uint64_t x = 88172645463325252ull;
  const auto random_half = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return infkv::f32_to_f16(float(double(x >> 11) / double(1ull << 53) * 2.0 - 1.0));
  };
  for (std::size_t i = 0; i < kv_bytes / 2; ++i) k[i] = random_half(), v[i] = random_half();
  for (std::size_t i = 0; i < std::size_t(c.w * c.hq * c.d); ++i) q[i] = random_half();
  for (std::int64_t j = 0; j < n; ++j) {
    tokens[j] = {j, 0, infkv::modality::text};
    for (std::int64_t h = 0; h < c.hkv; ++h) head_tokens[h * n + j] = tokens[j];
  }
  for (std::int64_t i = 0; i < c.w; ++i) qpos[i] = n - c.w + i;
  for (std::int64_t p = 0; p < pages; ++p) page_ids[p] = std::int32_t(pages - 1 - p);
  *status = infkv::cuda::status_ok;
  be.be.status = status;
  be.be.position_bits = c.position_bits;

  recording rec;
  rec.arena = &arena;
  current_recording = &rec;
  const infkv::const_tensor_view queries{q,  infkv::dtype::f16, c.w, std::int32_t(c.hq), std::int32_t(c.d), c.hq * c.d,
                                         c.d};
  const infkv::keep_view out{slots, offsets, pl.units, n};
  const std::span<const infkv::token> toks(tokens, std::size_t(n));
  const std::span<const std::int64_t> qp(qpos, std::size_t(c.w));
  const float scale = 1.f / std::sqrt(float(c.d));
  const std::span<std::byte> wspan(ws, pl.workspace_bytes), cspan(cws, compact_ws);
  // The eviction, then the compaction, of K and V as `kr` and `vr` (strided views or paged rows).
  const auto evict = [&](const auto& kr, const auto& vr) {
    using R = infkv::read_only_t<std::decay_t<decltype(kr)>>;
    infkv::run(pl, be, infkv::layer_inputs<R>{kr, vr, queries, qp, toks, scale}, wspan, out);
    rec.step = "compact", rec.precise_begin = k, rec.precise_end = head_tokens + n * c.hkv;
    if (compact)
      infkv::cuda::compact_steps(be.be.launch, status, kr, vr, head_tokens, n * c.hkv, out, pl.keep_per_unit, cspan);
  };
  if (paged) {
    const auto rows = [&](std::uint16_t* data) {
      return infkv::paged_rows{
          {data, page * row, row, c.d}, page_ids, infkv::dtype::f16, n, std::int32_t(c.hkv), std::int32_t(c.d), page};
    };
    evict(rows(k), rows(v));
  } else {
    const auto kv = infkv::contiguous_nhd(k, v, infkv::dtype::f16, n, std::int32_t(c.hkv), std::int32_t(c.d));
    evict(kv.k, kv.v);
  }
  current_recording = nullptr;
  infkv::cuda::raise_if(infkv::cuda::decode(*status), "infkv_kernel_cost's eviction");
  return rec.launches;
}

}  // namespace infkv_bench
