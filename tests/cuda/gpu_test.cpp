// GPU parity tests of infkv::cuda (label `gpu`): every primitive on the device against the CPU
// backend on fresh random inputs of several shapes, element types and views, outputs poisoned
// before each run: finished scores within float tolerance, keep sets identical given equal
// scores, compaction byte-identical, re-rotation within rounding, faults raised by name. Plain
// C++ linking the compiled library, as a user's program would. Without a device the program
// exits 77 (ctest: skipped); REQUIRE_GPU=1 makes that a failure. INFKV_GPU_SMALL=1 runs the small
// shapes only (for compute-sanitizer).
#define DOCTEST_CONFIG_IMPLEMENT
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>
#include <infkv/cuda.hpp>
#include <infkv/cuda/detail/common.hpp>  // element loads, to read device rows back

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

namespace {

void ok(cudaError_t e) { REQUIRE_MESSAGE(e == cudaSuccess, cudaGetErrorString(e)); }

/// Device memory of `n` T, poisoned (all bits set: NaN floats, -1 integers) when made.
template <class T>
struct dvec {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dvec(std::size_t count) : n(count) {
    ok(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(T)));
    poison();
  }
  explicit dvec(const std::vector<T>& host) : dvec(host.size()) { up(host); }
  ~dvec() { cudaFree(p); }
  dvec(const dvec&) = delete;
  dvec& operator=(const dvec&) = delete;
  void poison() const { ok(cudaMemset(p, 0xff, std::max<std::size_t>(n, 1) * sizeof(T))); }
  void up(const std::vector<T>& host) const {
    ok(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> down() const {
    std::vector<T> h(n);
    ok(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  std::span<T> span() const { return {p, n}; }
};

/// A stored tensor (reference_helpers' layouts) copied to the device, with its views.
struct device_tensor {
  dvec<std::uint8_t> bytes;
  std::unique_ptr<dvec<std::int32_t>> indptr, indices, last;
  tensor_view tensor{};
  paged_view paged{};
  paged_rows rows{};  ///< sequence 1 of a paged tensor
  explicit device_tensor(const stored& s) : bytes(s.bytes) {
    if (s.kind != layout::paged) {
      tensor = s.tensor;
      tensor.data = bytes.p;
      return;
    }
    indptr = std::make_unique<dvec<std::int32_t>>(s.indptr);
    indices = std::make_unique<dvec<std::int32_t>>(s.indices);
    last = std::make_unique<dvec<std::int32_t>>(s.last);
    paged = s.paged;
    paged.k.data = bytes.p, paged.v.data = nullptr;
    paged.indptr = indptr->p, paged.indices = indices->p, paged.last_page_len = last->p;
    const auto host_rows = key_rows(s.paged, 1);
    rows = host_rows;
    rows.store.data = bytes.p;
    rows.pages = indices->p + s.indptr[1];
  }
};

bool small() { return std::getenv("INFKV_GPU_SMALL") != nullptr; }

/// A device status word with nothing recorded.
struct device_status {
  dvec<cuda::status_word> word{1};  // poisoned: all ones, "nothing recorded"
  cuda::status_word* p() const { return word.p; }
  void reset(cudaStream_t stream = nullptr) const { cuda::reset_status(word.p, stream); }
};

/// A plan's device workspace and keep view.
struct device_run {
  dvec<std::byte> ws;
  dvec<std::int64_t> offsets, slots;
  keep_view out;
  explicit device_run(const plan& p)
      : ws(p.workspace_bytes),
        offsets(std::size_t(p.offsets_size())),
        slots(std::size_t(std::max<std::int64_t>(p.kept_total, 1))),
        out{slots.p, offsets.p, p.units, p.shape.n_slots} {}
  keep_set keep() const {
    const auto o = offsets.down(), s = slots.down();
    return keep_set::from_view({s.data(), o.data(), out.n_units, out.n_slots});
  }
};

/// Device copies of a layer's tokens, query positions and (H2O) accumulated scores.
struct device_meta {
  dvec<token> tokens;
  dvec<std::int64_t> qpos;
  dvec<float> acc;
  score_view acc_view{};
  device_meta(const std::vector<token>& t, const std::vector<std::int64_t>& q, const_score_view host_acc)
      : tokens(t), qpos(q), acc(std::size_t(host_acc.rows * host_acc.cols)) {
    if (host_acc.data) {
      std::vector<float> h(host_acc.data, host_acc.data + host_acc.rows * host_acc.cols);
      acc.up(h);
      acc_view = {acc.p, host_acc.rows, host_acc.cols, host_acc.cols};
    }
  }
};

}  // namespace

/// The finished scores of `spec` on the GPU for host keys `hk` (their device copy `dk`), the
/// device queries `dq` and token metadata `meta`, copied back (the status checked).
template <class HostRows>
score_matrix gpu_scores(const cuda::backend& be, const device_status& status, const policy_spec& spec, const HostRows&,
                        const device_tensor& dk, const device_tensor& dq, const device_meta& meta) {
  using R = read_only_t<HostRows>;
  layer_inputs<R> din{{}, {}, dq.tensor, meta.qpos.span(), meta.tokens.span(), 0.f, meta.acc_view};
  if constexpr (std::same_as<R, const_paged_rows>)
    din.keys = dk.rows;
  else
    din.keys = dk.tensor;
  const plan dp = make_plan(be, spec, budget{.ratio = 1.0}, shape_of(din));
  dvec<std::byte> ws(dp.workspace_bytes);
  const score_view got = run_scores(dp, be, din, ws.span());
  cuda::check(status.p(), nullptr, "run_scores");
  score_matrix g(got.rows, got.cols);
  ok(cudaMemcpy(g.data.data(), got.data, g.data.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return g;
}

TEST_CASE("gpu: finished scores of every policy equal the CPU backend's within float tolerance") {
  const cpu::backend cpu_be{};
  const device_status status;
  const cuda::backend gpu_be{nullptr, status.p()};
  struct shape {
    std::int64_t n;
    std::int32_t hkv, group, d;
    std::int64_t nq;
  };
  std::vector<shape> shapes{{37, 2, 2, 8, 6}, {700, 2, 3, 17, 5}};
  if (!small()) shapes.insert(shapes.end(), {{5000, 4, 4, 64, 32}, {20000, 8, 4, 128, 32}});
  int seed = 0;
  for (const shape sh : shapes)
    for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16})
      for (const layout lay : {layout::nhd, layout::hnd, layout::paged}) {
        const problem p = make_problem(900 + std::uint64_t(seed++), sh.n, sh.hkv, sh.group, sh.d, sh.nq, t);
        const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay), queries = store_queries(p);
        const device_tensor dk(keys), dq(queries);
        const layer ly(p);
        for_each_policy(ly.in(), [&](const std::string& name, const auto& pol, const auto& with) {
          const std::string what = name + " n=" + std::to_string(p.n) + " " + to_string(t) + " " + to_string(lay);
          keys.visit([&](const auto& hk) {
            using R = read_only_t<std::decay_t<decltype(hk)>>;
            const auto host_in = with(layer_inputs<R>{hk, {}, queries.tensor, p.qpos, p.tokens, 0.f});
            const plan hp = make_plan(cpu_be, pol.spec(), budget{.ratio = 1.0}, shape_of(host_in));
            cpu::workspace hws(hp.workspace_bytes);
            const score_view want = run_scores(hp, cpu_be, host_in, hws.span());
            const device_meta meta(p.tokens, p.qpos, host_in.accumulated);
            const score_matrix g = gpu_scores(gpu_be, status, pol.spec(), hk, dk, dq, meta);
            score_matrix w(want.rows, want.cols);
            std::copy(want.data, want.data + want.rows * want.cols, w.data.begin());
            ref_matrix wr(std::size_t(w.rows));
            for (std::int64_t r = 0; r < w.rows; ++r) wr[std::size_t(r)].assign(w.row(r).begin(), w.row(r).end());
            // Tolerances, not bit equality: the library is built with nvcc's default --fmad=true (a
            // fused multiply-add rounds once where the CPU rounds twice) and sums in another order;
            // f32 dot products of <= 256 terms and softmax sums over the keys stay within 2e-4
            // relative. Keep sets are compared exactly where scores are equal by construction
            // (accumulated scores, below), compaction byte for byte.
            check_close(g, wr, 2e-4, 2e-6, what);
          });
        });
      }
}

// Skipped under INFKV_GPU_SMALL (the sanitizers' runs: the shapes above cover the kernels' logic).
TEST_CASE("gpu: SnapKV's scores at 131,072 slots (128 fused blocks per KV head) equal the CPU's, strided and paged" *
          doctest::skip(small())) {
  const cpu::backend cpu_be{};
  const device_status status;
  const cuda::backend gpu_be{nullptr, status.p()};
  const problem p = make_problem(4242, 131072, 8, 4, 128, 32, dtype::f16);
  const policy_spec spec = snapkv{.window = 32}.spec();
  const stored queries = store_queries(p);
  // The CPU's scores once (they do not depend on the layout), from the strided keys.
  ref_matrix want;
  {
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
    keys.visit([&](const auto& hk) {
      using R = read_only_t<std::decay_t<decltype(hk)>>;
      const layer_inputs<R> in{hk, {}, queries.tensor, p.qpos, p.tokens, 0.f};
      const plan hp = make_plan(cpu_be, spec, budget{.ratio = 1.0}, shape_of(in));
      cpu::workspace hws(hp.workspace_bytes);
      const score_view s = run_scores(hp, cpu_be, in, hws.span());
      for (std::int64_t r = 0; r < s.rows; ++r) want.emplace_back(s.row(r), s.row(r) + s.cols);
    });
  }
  const device_tensor dq(queries);
  const device_meta meta(p.tokens, p.qpos, {});
  for (const layout lay : {layout::nhd, layout::paged}) {
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay);
    const device_tensor dk(keys);
    keys.visit([&](const auto& hk) {
      check_close(gpu_scores(gpu_be, status, spec, hk, dk, dq, meta), want, 2e-4, 2e-6,
                  std::string("snapkv 131072 ") + to_string(lay));
    });
  }
}

TEST_CASE(
    "gpu: given equal scores the keep sets are the CPU's (ties, signed zeros, AdaKV, pooling, bias, layers, unions)") {
  const cpu::backend cpu_be{};
  cudaStream_t stream = nullptr;  // a stream of its own: nothing may run on the default one
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const device_status status;
  const cuda::backend gpu_be{stream, status.p()};
  std::mt19937_64 gen(5);
  for (int round = 0; round < (small() ? 6 : 40); ++round) {
    CAPTURE(round);
    const std::int64_t n = 1 + std::int64_t(gen() % (round % 4 == 3 && !small() ? 130000 : 900));
    const auto heads = std::int32_t(1 + gen() % 8);
    const auto tokens = random_tokens(gen, n);
    const std::vector<score_matrix> acc{tied_scores(gen, heads, n), tied_scores(gen, heads, n)};
    policy_spec spec{.name = "fixed", .score = {.source = score_source::accumulated}};
    if (round % 3 == 1) spec.score.pool = pooling::max, spec.score.kernel = 3;
    if (round % 3 == 2)
      spec.score.pool = pooling::avg, spec.score.kernel = 5, spec.score.pool_tail = spec.protect_recent = 3;
    if (round % 4 == 1) spec.score.bias = {.beta = 0.5, .unit = round % 8 == 1 ? age_unit::positions : age_unit::ranks};
    const budget b{.capacity = std::int64_t(gen() % std::uint64_t(n + 2)) + 4,
                   .sinks = std::int64_t(gen() % 3),
                   .recent = std::int64_t(gen() % 4)};
    const device_meta m0(tokens, {}, acc[0].view()), m1(tokens, {}, acc[1].view());
    std::vector<layer_inputs<>> host(2), dev(2);
    for (int l = 0; l < 2; ++l)
      host[std::size_t(l)].tokens = tokens, host[std::size_t(l)].accumulated = acc[std::size_t(l)].view();
    dev[0].tokens = m0.tokens.span(), dev[0].accumulated = m0.acc_view;
    dev[1].tokens = m0.tokens.span(), dev[1].accumulated = m1.acc_view;  // one token list for both layers
    std::vector<plan_options> options;
    for (const granularity g : {granularity::per_head, granularity::per_layer, granularity::per_token})
      options.push_back({.g = g, .r = reduction(gen() % 3)});
    options.push_back({.g = granularity::per_token, .r = reduction::sum, .n_layers = 2});
    if (heads > 1 && b.capacity < n) options.push_back({.g = granularity::per_head, .adakv = adakv{.alpha = 0.3}});
    for (const plan_options& o : options) {
      CAPTURE(to_string(o.g));
      CAPTURE(o.n_layers);
      const plan hp = make_plan(cpu_be, spec, b, shape_of(host[0]), o);
      cpu::workspace hws(hp.workspace_bytes);
      std::vector<std::int64_t> ho(std::size_t(hp.offsets_size())), hs(std::size_t(hp.kept_total));
      run(hp, cpu_be, std::span<const layer_inputs<>>(host.data(), std::size_t(o.n_layers)), hws.span(),
          {hs.data(), ho.data(), hp.units, n});
      const plan dp = make_plan(gpu_be, spec, b, shape_of(dev[0]), o);
      device_run d(dp);
      run(dp, gpu_be, std::span<const layer_inputs<>>(dev.data(), std::size_t(o.n_layers)), d.ws.span(), d.out);
      cuda::check(status.p(), stream, "run");
      CHECK(d.keep() == keep_set::from_view({hs.data(), ho.data(), hp.units, n}));
    }
    const policy_spec u = union_of_finishes(spec, double(round % 5) / 4.0);
    for (const granularity g : {granularity::per_layer, granularity::per_token}) {
      CAPTURE(to_string(g));
      const plan hp = make_plan(cpu_be, u, b, shape_of(host[0]), {.g = g});
      cpu::workspace hws(hp.workspace_bytes);
      std::vector<std::int64_t> ho(std::size_t(hp.offsets_size())), hs(std::size_t(hp.kept_total));
      run(hp, cpu_be, host[0], hws.span(), {hs.data(), ho.data(), hp.units, n});
      const plan dp = make_plan(gpu_be, u, b, shape_of(dev[0]), {.g = g});
      device_run d(dp);
      run(dp, gpu_be, dev[0], d.ws.span(), d.out);
      cuda::check(status.p(), stream, "run (union)");
      CHECK(d.keep() == keep_set::from_view({hs.data(), ho.data(), hp.units, n}));
    }
  }
  ok(cudaStreamDestroy(stream));
}

TEST_CASE("gpu: compaction (contiguous and paged) moves exactly the CPU's bytes, re-rotation within rounding") {
  std::mt19937_64 gen(13);
  const device_status status;
  for (int round = 0; round < 12; ++round) {
    CAPTURE(round);
    const dtype t = dtype(round % 3);
    const layout lay = round % 2 ? layout::hnd : layout::nhd;
    const std::int64_t n = 10 + std::int64_t(gen() % (small() ? 100 : 20000));
    const std::int32_t heads = 1 + std::int32_t(gen() % 4), d = round % 4 == 0 ? 5 : 64;
    const problem p = make_problem(700 + std::uint64_t(round), n, heads, 1, d, 1, t);
    stored k = store(p.k, n, heads, d, t, lay), v = store(p.k_exact, n, heads, d, t, lay);
    const device_tensor dk(k), dv(v);
    const std::int64_t m = 1 + std::int64_t(gen() % std::uint64_t(n));
    const auto all = random_slots(gen, n, m);
    keep_set keep(n);
    keep.add_unit(all);
    std::vector<token> tokens = p.tokens;
    const dvec<token> dtok(tokens);
    const dvec<std::int64_t> dslots(all), doffsets(std::vector<std::int64_t>{0, m});
    kv_view kv{k.tensor, v.tensor};
    cpu::compact(kv, tokens, keep);
    dvec<std::byte> ws(cuda::compact_scratch_bytes(m, heads, d * std::int64_t(size_of(t))));
    cuda::compact(dk.tensor, dv.tensor, dtok.span(), {dslots.p, doffsets.p, 1, n}, m, ws.span(), status.p(), nullptr);
    cuda::check(status.p(), nullptr, "compact");
    CHECK(dk.bytes.down() == k.bytes);
    CHECK(dv.bytes.down() == v.bytes);
    const auto back = dtok.down();
    for (std::int64_t i = 0; i < m; ++i) CHECK(back[std::size_t(i)].pos == tokens[std::size_t(i)].pos);
    // Re-rotation of the compacted keys by the compact-mode deltas.
    tokens.resize(std::size_t(m));
    const auto delta = compact_positions(tokens);
    tensor_view hk = k.tensor, dkv = dk.tensor;
    hk.n_slots = dkv.n_slots = m;
    const rope r{.theta = 10000.0, .style = round % 2 ? rope_style::neox : rope_style::normal};
    cpu::rerotate(hk, delta, r);
    const dvec<std::int64_t> ddelta(delta);
    cuda::rerotate(dkv, ddelta.p, r, status.p(), nullptr);
    cuda::check(status.p(), nullptr, "rerotate");
    stored got;
    got.bytes = dk.bytes.down();
    const double tol = t == dtype::f32 ? 2e-5 : t == dtype::f16 ? 2e-3 : 1.6e-2;
    std::int64_t bad = 0;
    for (std::int64_t j = 0; j < m; ++j)
      for (std::int32_t h = 0; h < heads; ++h)
        for (std::int32_t e = 0; e < d; ++e) {
          const auto off = static_cast<const std::uint8_t*>(hk.row(j, h)) - k.bytes.data();
          const float x = cuda::detail::load(t, hk.row(j, h), e), y = cuda::detail::load(t, got.bytes.data() + off, e);
          bad += std::abs(x - y) <= tol * (1 + std::abs(x)) ? 0 : 1;
        }
    CHECK(bad == 0);
  }
  for (int round = 0; round < 6; ++round) {  // paged: sequence 1 behind a decoy sequence
    const dtype t = dtype(round % 3);
    const std::int64_t n = 4 + std::int64_t(gen() % 300);
    const problem p = make_problem(800 + std::uint64_t(round), n, 2, 1, 6, 1, t);
    stored a = store(p.k, n, 2, 6, t, layout::paged);
    const device_tensor dc(a);
    a.paged.v.data = nullptr;
    const std::int64_t m = std::int64_t(gen() % std::uint64_t(n + 1));
    const auto all = random_slots(gen, n, m);
    keep_set keep(n);
    keep.add_unit(all);
    std::vector<token> t1 = p.tokens;
    const dvec<token> dtok(p.tokens);
    const dvec<std::int64_t> dslots(all), doffsets(std::vector<std::int64_t>{0, m});
    const std::vector<std::int32_t> table = a.indices;
    CHECK(cpu::compact(key_rows(a.paged, 1), paged_rows{}, t1, keep) == m);
    CHECK(a.indices == table);
    dvec<std::byte> ws(cuda::compact_scratch_bytes(m, 2, 6 * std::int64_t(size_of(t))));
    cuda::compact(dc.rows, paged_rows{}, dtok.span(), {dslots.p, doffsets.p, 1, n}, m, ws.span(), status.p(), nullptr);
    cuda::check(status.p(), nullptr, "compact (paged)");
    CHECK(dc.bytes.down() == a.bytes);
    CHECK(dc.indices->down() == table);  // the engine's table is the engine's: untouched
    // Re-rotation through the paged rows, as through a strided view.
    std::vector<std::int64_t> delta(static_cast<std::size_t>(m));
    for (std::int64_t j = 0; j < m; ++j) delta[std::size_t(j)] = (j % 5) * 300 - 600;
    const dvec<std::int64_t> ddelta(delta);
    paged_rows hrows = key_rows(a.paged, 1), drows = dc.rows;
    drows.n_slots = m;
    const rope r{.theta = 10000.0, .dims = 6};
    cpu::rerotate(hrows, delta, r);
    cuda::rerotate(drows, ddelta.p, r, status.p(), nullptr);
    cuda::check(status.p(), nullptr, "rerotate (paged)");
    const auto got = dc.bytes.down();
    const double tol = t == dtype::f32 ? 2e-5 : t == dtype::f16 ? 2e-3 : 1.6e-2;
    std::int64_t bad = 0;
    for (std::int64_t j = 0; j < m; ++j)
      for (std::int32_t h = 0; h < 2; ++h)
        for (std::int32_t e = 0; e < 6; ++e) {
          const auto off = static_cast<const std::uint8_t*>(hrows.row(j, h)) - a.bytes.data();
          const float x = cuda::detail::load(t, hrows.row(j, h), e), y = cuda::detail::load(t, got.data() + off, e);
          bad += std::abs(x - y) <= tol * (1 + std::abs(x)) ? 0 : 1;
        }
    CHECK(bad == 0);
  }
}

TEST_CASE("gpu: H2O's accumulation step and eviction follow cpu::h2o_state") {
  const device_status status;
  for (const h2o cfg : {h2o{}, h2o{.normalize_lifetime = true, .forgetting = 0.8}}) {
    const std::int64_t n = small() ? 300 : 30000;
    cpu::h2o_state want(cfg, 4);
    want.append(n);
    dvec<float> acc(std::size_t(4 * n)), life(acc.n), score(acc.n);
    ok(cudaMemset(acc.p, 0, acc.n * 4)), ok(cudaMemset(life.p, 0, life.n * 4));
    cuda::h2o_state_view st{acc.p, life.p, score.p, 4, n, n};
    for (int step = 0; step < 3; ++step) {
      const problem p = make_problem(50 + std::uint64_t(step), n, 4, 2, 64, 1 + step, dtype::bf16);
      const layer ly(p);
      cpu::observe(want, ly.in());
      const stored keys = store(p.k, n, 4, 64, p.type, layout::nhd), queries = store_queries(p);
      const device_tensor dk(keys), dq(queries);
      const device_meta meta(p.tokens, p.qpos, {});
      const layer_inputs<> in{dk.tensor, {}, dq.tensor, meta.qpos.span(), meta.tokens.span(), 0.f};
      dvec<std::byte> ws(cuda::h2o_scratch_bytes(shape_of(in)));
      cuda::h2o_observe(st, cfg, in, ws.span(), status.p(), nullptr);
      cuda::check(status.p(), nullptr, "h2o_observe");
      score_matrix g(4, n);
      g.data = score.down();
      check_close(
          g,
          [&] {
            ref_matrix r(4);
            for (std::int64_t h = 0; h < 4; ++h)
              r[std::size_t(h)].assign(want.scores().row(h).begin(), want.scores().row(h).end());
            return r;
          }(),
          1e-4, 1e-6, "h2o step");
    }
    std::vector<std::int64_t> kept;
    for (std::int64_t j = 0; j < n; j += 3) kept.push_back(j);
    keep_set keep(n);
    keep.add_unit(kept);
    want.evict(keep);
    const dvec<std::int64_t> dslots(kept), doffsets(std::vector<std::int64_t>{0, std::int64_t(kept.size())});
    dvec<std::byte> ws(cuda::compact_scratch_bytes(std::int64_t(kept.size()), 4, 4));
    cuda::h2o_evict(st, {dslots.p, doffsets.p, 1, n}, std::int64_t(kept.size()), ws.span(), status.p(), nullptr);
    cuda::check(status.p(), nullptr, "h2o_evict");
    CHECK(st.n_slots == std::int64_t(kept.size()));
    const auto all = score.down();
    std::int64_t bad = 0;
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t j = 0; j < st.n_slots; ++j) {
        const double w = want.scores()(h, j), g = all[std::size_t(h * n + j)];
        bad += std::abs(g - w) <= 1e-4 * std::abs(w) + 1e-7 ? 0 : 1;
      }
    CHECK(bad == 0);
  }
}

TEST_CASE("gpu: one CUDA graph of h2o_observe, run, compact, h2o_evict and rerotate, replayed 100 times") {
  // Everything of an H2O eviction step captured on a non-default stream (global capture mode: any
  // call that waits, or touches the legacy stream, fails the capture), the inputs restored from
  // pristine copies at the start of the graph so that every replay computes the same step.
  const std::int64_t n = small() ? 300 : 3000, kept = n / 3;
  const std::int32_t heads = 2;
  const problem p = make_problem(77, n, heads, 2, 64, 4, dtype::f16);
  const layer ly(p);
  const stored ks = store(p.k, n, heads, 64, p.type, layout::nhd),
               vs = store(p.k_exact, n, heads, 64, p.type, layout::nhd);
  const device_tensor dk(ks), dv(vs), dk0(ks), dv0(vs), dq(store_queries(p));
  const device_meta meta(p.tokens, p.qpos, {}), meta0(p.tokens, p.qpos, {});
  dvec<float> state(std::size_t(3 * heads * n)), state0(state.n);
  ok(cudaMemset(state0.p, 0, state0.n * sizeof(float)));
  const cuda::h2o_state_view st{state.p, state.p + heads * n, state.p + 2 * heads * n, heads, n, n};
  const layer_inputs<> in{dk.tensor, dv.tensor, dq.tensor, meta.qpos.span(), meta.tokens.span(), 0.f, st.scores()};
  std::vector<std::int64_t> delta(static_cast<std::size_t>(kept));
  for (std::int64_t j = 0; j < kept; ++j) delta[std::size_t(j)] = -(j % 7) * 50;
  const dvec<std::int64_t> ddelta(delta);
  const rope r{.theta = 10000.0};

  cudaStream_t stream = nullptr;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const device_status status;
  const cuda::backend be{stream, status.p()};
  const policy_spec spec{.name = "h2o", .score = {.source = score_source::accumulated}};
  const budget b{.capacity = kept, .sinks = 4, .recent = 16};
  const plan pl = make_plan(be, spec, b, shape_of(in), {.g = granularity::per_token});
  REQUIRE(pl.kept_total == kept);
  device_run d(pl);
  dvec<std::byte> hws(cuda::h2o_scratch_bytes(shape_of(in))), cws(cuda::compact_scratch_bytes(kept, heads, 128)),
      ews(cuda::compact_scratch_bytes(kept, heads, 4));
  cudaGraph_t graph = nullptr;
  ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const auto copy = [&](void* to, const void* from, std::size_t bytes) {
    ok(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  copy(dk.bytes.p, dk0.bytes.p, dk.bytes.n), copy(dv.bytes.p, dv0.bytes.p, dv.bytes.n);
  copy(meta.tokens.p, meta0.tokens.p, meta.tokens.n * sizeof(token));
  copy(state.p, state0.p, state.n * sizeof(float));
  status.reset(stream);
  cuda::h2o_observe(st, h2o{}, in, hws.span(), status.p(), stream);
  run(pl, be, in, d.ws.span(), d.out);
  cuda::compact(dk.tensor, dv.tensor, meta.tokens.span(), d.out, kept, cws.span(), status.p(), stream);
  cuda::h2o_state_view after = st;
  cuda::h2o_evict(after, d.out, kept, ews.span(), status.p(), stream);
  tensor_view compacted = dk.tensor;
  compacted.n_slots = kept;
  cuda::rerotate(compacted, ddelta.p, r, status.p(), stream);
  ok(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  ok(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 100; ++replay) ok(cudaGraphLaunch(exec, stream));
  cuda::check(status.p(), stream, "graph");

  // The same step on the CPU backend.
  cpu::h2o_state want(h2o{}, heads);
  want.append(n);
  cpu::observe(want, ly.in());
  layer_inputs<> host = ly.in();
  host.accumulated = want.scores().view();
  const plan hp = make_plan(cpu::backend{}, spec, b, shape_of(host), {.g = granularity::per_token});
  cpu::workspace hws_cpu(hp.workspace_bytes);
  std::vector<std::int64_t> ho(std::size_t(hp.offsets_size())), hs(std::size_t(hp.kept_total));
  run(hp, cpu::backend{}, host, hws_cpu.span(), {hs.data(), ho.data(), hp.units, n});
  const keep_set keep = keep_set::from_view({hs.data(), ho.data(), hp.units, n});
  CHECK(d.keep() == keep);
  // ... compaction, H2O's eviction and the re-rotation.
  stored hk = store(p.k, n, heads, 64, p.type, layout::nhd), hv = store(p.k_exact, n, heads, 64, p.type, layout::nhd);
  std::vector<token> tokens = p.tokens;
  kv_view kv{hk.tensor, hv.tensor};
  cpu::compact(kv, tokens, keep);
  want.evict(keep);
  cpu::rerotate(kv.k, delta, r);
  CHECK(dv.bytes.down() == hv.bytes);
  const auto back = meta.tokens.down();
  for (std::int64_t i = 0; i < kept; ++i) CHECK(back[std::size_t(i)].pos == tokens[std::size_t(i)].pos);
  const auto got = dk.bytes.down();
  std::int64_t bad = 0;
  for (std::int64_t j = 0; j < kept; ++j)
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t e = 0; e < 64; ++e) {
        const auto off = static_cast<const std::uint8_t*>(kv.k.row(j, h)) - hk.bytes.data();
        const float x = cuda::detail::load(p.type, kv.k.row(j, h), e),
                    y = cuda::detail::load(p.type, got.data() + off, e);
        bad += std::abs(x - y) <= 2e-3 * (1 + std::abs(x)) ? 0 : 1;
      }
  CHECK(bad == 0);
  const auto scores = state.down();
  bad = 0;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < kept; ++j) {
      const double w = want.scores()(h, j), g = scores[std::size_t(2 * heads * n + h * n + j)];
      bad += std::abs(g - w) <= 1e-4 * std::abs(w) + 1e-7 ? 0 : 1;
    }
  CHECK(bad == 0);
  ok(cudaGraphExecDestroy(exec)), ok(cudaGraphDestroy(graph)), ok(cudaStreamDestroy(stream));
}

TEST_CASE("gpu: window policies and Expected Attention captured in a CUDA graph keep what a direct run keeps") {
  // f16 keys of 2 KV heads x 4 query heads, head_dim 128, a window of 32: 128 query rows per KV
  // head, the fused window attention with 88 KiB of shared memory (its opt-in inside the capture);
  // Expected Attention through cuBLAS. Each plan runs once before the capture (warm-up), then the
  // captured graph is replayed and its keep set compared with the direct run's.
  const std::int64_t n = small() ? 600 : 5000;
  const problem p = make_problem(91, n, 2, 4, 128, 32, dtype::f16);
  const stored ks = store(p.k, n, 2, 128, p.type, layout::nhd), qs = store_queries(p);
  const device_tensor dk(ks), dq(qs);
  const device_meta meta(p.tokens, p.qpos, {});
  const layer_inputs<> in{dk.tensor, {}, dq.tensor, meta.qpos.span(), meta.tokens.span(), 0.f};
  cudaStream_t stream = nullptr;
  ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const device_status status;
  const cuda::backend be{stream, status.p()};
  const budget b{.capacity = n / 4, .sinks = 4, .recent = 32};
  for (const auto& [name, spec] : std::vector<std::pair<std::string, policy_spec>>{
           {"snapkv", snapkv{.window = 32}.spec()},
           {"inf_mllm", inf_mllm{.window = 32}.spec()},
           {"tova", tova{}.spec()},
           {"keydiff", keydiff{}.spec()},
           {"expected_attention", expected_attention{.window = 32}.spec()}}) {
    INFO(name);
    const plan pl = make_plan(be, spec, b, shape_of(in));
    device_run direct(pl), captured(pl);
    status.reset(stream);
    run(pl, be, in, direct.ws.span(), direct.out);  // the warm-up, and the reference
    cuda::check(status.p(), stream, "direct run");
    cudaGraph_t graph = nullptr;
    ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    run(pl, be, in, captured.ws.span(), captured.out);
    ok(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    ok(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 10; ++replay) ok(cudaGraphLaunch(exec, stream));
    cuda::check(status.p(), stream, "graph");
    CHECK(captured.keep() == direct.keep());
    ok(cudaGraphExecDestroy(exec)), ok(cudaGraphDestroy(graph));
  }
  ok(cudaStreamDestroy(stream));
}

TEST_CASE("gpu: faults found on the device raise by name and leave the cache as it was") {
  const device_status status;
  const cuda::backend be{nullptr, status.p()};
  problem p = make_problem(3, 300, 2, 2, 16, 4);
  p.k[std::size_t((123 * 2 + 1) * 16 + 7)] = std::numeric_limits<float>::quiet_NaN();
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd), queries = store_queries(p);
  const device_tensor dk(keys), dq(queries);
  const device_meta meta(p.tokens, p.qpos, {});
  const layer_inputs<> in{dk.tensor, {}, dq.tensor, meta.qpos.span(), meta.tokens.span(), 0.f};
  const plan pl = make_plan(be, snapkv{.window = 4}, budget{.capacity = 64}, shape_of(in));
  device_run d(pl);
  run(pl, be, in, d.ws.span(), d.out);
  CHECK_THROWS_WITH_AS(cuda::check(status.p(), nullptr, "run"),
                       doctest::Contains("keys[slot 123, head 1][7] is not finite"), invalid_argument);
  // After that fault a compaction of the run's keep set moves nothing.
  const dvec<token> dtok(p.tokens);
  dvec<std::byte> ws(cuda::compact_scratch_bytes(64, 2, 64));
  cuda::compact(dk.tensor, {}, dtok.span(), d.out, 64, ws.span(), status.p(), nullptr);
  CHECK_THROWS(cuda::check(status.p(), nullptr, "compact"));
  CHECK(dk.bytes.down() == keys.bytes);
  // A keep set out of order: nothing moves.
  status.reset();
  const dvec<std::int64_t> slots(std::vector<std::int64_t>{5, 4}), offsets(std::vector<std::int64_t>{0, 2});
  cuda::compact(dk.tensor, {}, dtok.span(), {slots.p, offsets.p, 1, p.n}, 2, ws.span(), status.p(), nullptr);
  CHECK_THROWS_WITH_AS(cuda::check(status.p(), nullptr, "compact"), doctest::Contains("nothing was moved"),
                       invalid_argument);
  CHECK(dk.bytes.down() == keys.bytes);
  // A misaligned workspace is refused before anything is queued.
  CHECK_THROWS_WITH_AS(cuda::compact(dk.tensor, {}, dtok.span(), {slots.p, offsets.p, 1, p.n}, 2, ws.span().subspan(8),
                                     status.p(), nullptr),
                       doctest::Contains("ws.data()"), invalid_argument);
}

TEST_CASE("gpu: the README's CUDA example runs") {
  const std::int64_t n_slots = 8192;
  const std::int32_t n_kv_heads = 8, n_q_heads = 32, head_dim = 128;
  const problem p = make_problem(1, n_slots, n_kv_heads, n_q_heads / n_kv_heads, head_dim, 32, dtype::f16, false);
  const stored ks = store(p.k, n_slots, n_kv_heads, head_dim, dtype::f16, layout::nhd), qs = store_queries(p);
  const device_tensor dk(ks), dq(qs);
  const device_meta meta(p.tokens, p.qpos, {});
  void* k_dev = dk.tensor.data;
  void* q_dev = dq.tensor.data;
  token* tokens_dev = meta.tokens.p;
  std::int64_t* q_pos_dev = meta.qpos.p;
  cudaStream_t stream = nullptr;
  // example-begin cuda
  void* status;  // one word: what the kernels find wrong lands here
  cudaMalloc(&status, sizeof(infkv::cuda::status_word));
  const infkv::cuda::backend be{stream, static_cast<infkv::cuda::status_word*>(status)};
  infkv::cuda::reset_status(be.status, stream);
  infkv::layer_inputs<> in{.keys = infkv::nhd(k_dev, infkv::dtype::f16, n_slots, n_kv_heads, head_dim),
                           .queries = infkv::nhd(q_dev, infkv::dtype::f16, 32, n_q_heads, head_dim),
                           .query_pos = {q_pos_dev, 32},
                           .tokens = {tokens_dev, std::size_t(n_slots)}};  // all device memory
  auto policy = infkv::snapkv{.window = 32, .kernel = 7};
  const infkv::plan plan = infkv::make_plan(be, policy, {.capacity = 2048, .sinks = 4}, infkv::shape_of(in));

  void *ws, *slots, *offsets;  // sized by the plan, no allocation later
  cudaMalloc(&ws, plan.workspace_bytes);
  cudaMalloc(&slots, plan.kept_total * sizeof(std::int64_t));
  cudaMalloc(&offsets, plan.offsets_size() * sizeof(std::int64_t));
  infkv::keep_view keep{static_cast<std::int64_t*>(slots), static_cast<std::int64_t*>(offsets), plan.units, n_slots};
  infkv::run(plan, be, in, {static_cast<std::byte*>(ws), plan.workspace_bytes}, keep);  // queued, no wait
  // keep: per KV head, 2048 sorted slots (device); infkv::cuda::compact moves K, V and tokens;
  // infkv::cuda::check(be.status, stream, "eviction") waits and raises what the kernels found
  // example-end
  infkv::cuda::check(be.status, stream, "eviction");
  CHECK(plan.units == n_kv_heads);
  std::vector<std::int64_t> o(std::size_t(plan.offsets_size()));
  ok(cudaMemcpy(o.data(), offsets, o.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
  CHECK(o.back() == 2048 * n_kv_heads);
  cudaFree(ws), cudaFree(slots), cudaFree(offsets), cudaFree(status);
}

int main(int argc, char** argv) {
  if (!infkv::cuda::device_available()) {
    const bool required = std::getenv("REQUIRE_GPU") && std::string(std::getenv("REQUIRE_GPU")) == "1";
    std::cerr << "infkv_gpu_tests: no CUDA device" << (required ? " (REQUIRE_GPU=1: failing)\n" : ": skipped\n");
    return required ? 1 : 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
