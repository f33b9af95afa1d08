// infkv::cuda linked against a stub CUDA runtime (stub_runtime.cpp) that runs nothing and records
// every call: no function of the public CUDA API but `check` waits for the device, copies to
// host memory or allocates; every launch, copy and memset goes to the caller's stream (so a
// capture of that stream holds the whole step); no host code dereferences device memory (the
// stub's device memory cannot be read by the host: a dereference crashes this test); and the
// entry checks refuse misaligned workspaces and host memory by name. cuBLAS is stubbed the same
// way: its handle is created when planning (flagged there: it allocates), never in a run. Runs in
// CI, no GPU needed.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <infkv/cuda.hpp>
#include <infkv/infkv.hpp>

#include "cuda/stub_runtime.hpp"

using namespace infkv;

namespace {

template <class T>
T* dev(std::int64_t count) {
  return static_cast<T*>(stub::device_alloc(std::size_t(std::max<std::int64_t>(count, 1)) * sizeof(T)));
}

const auto stream = reinterpret_cast<cudaStream_t>(std::uintptr_t(0x5157));  // not the default stream

/// The calls since `clear`, checked: nothing forbidden, all on `stream`, at least one kernel
/// launch unless `launches_expected` is false.
void expect_queued_only(const char* what, bool launches_expected = true) {
  const auto calls = stub::calls();
  INFO(what);
  std::int64_t launches = 0;
  for (const stub::call& c : calls) {
    INFO(c.name, " ", c.detail);
    CHECK_FALSE(c.forbidden);
    CHECK(c.stream == stream);
    launches += c.name == "launch";
  }
  CHECK((launches > 0) == launches_expected);
  CHECK(!calls.empty());
  stub::clear();
}

/// A layer of device tensors: n slots, 2 KV heads, 4 query heads, head_dim 16, f16 (window
/// attention through the fused block-level steps) or f32 (through cuBLAS).
struct device_layer {
  std::int64_t n, nq = 8;
  const_tensor_view k, v, q;
  std::span<const std::int64_t> qpos;
  std::span<const token> tokens;
  explicit device_layer(std::int64_t slots, dtype t = dtype::f16) : n(slots) {
    const std::int64_t e = std::int64_t(size_of(t));
    k = nhd(dev<std::byte>(n * 2 * 16 * e), t, n, 2, 16);
    v = nhd(dev<std::byte>(n * 2 * 16 * e), t, n, 2, 16);
    q = nhd(dev<std::byte>(nq * 4 * 16 * e), t, nq, 4, 16);
    qpos = {dev<std::int64_t>(nq), std::size_t(nq)};
    tokens = {dev<token>(n), std::size_t(n)};
  }
  layer_inputs<> in() const {
    return {.keys = k, .values = v, .queries = q, .query_pos = qpos, .tokens = tokens, .rotary = rope{}};
  }
};

}  // namespace

TEST_CASE("cuda (stub runtime): the cuBLAS handle is created when planning, once, runs only use it") {
  auto* status = dev<cuda::status_word>(1);
  const cuda::backend be{stream, status};
  const device_layer ly(3000, dtype::f32);  // f16 keys take the fused steps, no GEMM
  const budget b{.capacity = 1024, .sinks = 4, .recent = 32};
  stub::clear();
  const plan p = make_plan(be, snapkv{.window = 8}, b, shape_of(ly.in()));
  const auto planning = stub::calls();
  CHECK(stub::handles_created() == 1);  // one device: one handle for the whole program
  CHECK(std::ranges::none_of(planning, [](const stub::call& c) { return c.name.starts_with("cublasGemm"); }));
  stub::clear();
  make_plan(be, tova{}, b, shape_of(ly.in()));
  cuda::h2o_scratch_bytes(shape_of(ly.in()));
  CHECK(stub::handles_created() == 1);
  CHECK(std::ranges::none_of(stub::calls(), [](const stub::call& c) { return c.name == "cublasCreate"; }));
  auto* ws = dev<std::byte>(std::int64_t(p.workspace_bytes));
  const keep_view out{dev<std::int64_t>(p.kept_total), dev<std::int64_t>(p.offsets_size()), p.units, ly.n};
  stub::clear();
  run(p, be, ly.in(), {ws, p.workspace_bytes}, out);
  const auto calls = stub::calls();
  // Two passes over the keys, one GEMM per tile each (3000 keys x 32 window rows: one tile).
  CHECK(std::ranges::count_if(calls, [](const stub::call& c) { return c.name == "cublasGemmStridedBatchedEx"; }) == 2);
  CHECK(std::ranges::count_if(calls, [](const stub::call& c) { return c.name == "cublasSetWorkspace"; }) == 2);
  expect_queued_only("snapkv through cuBLAS");
  // f16 keys: two fused launches of 128-thread blocks (2 KV heads x 3 blocks of 1,024 keys), no GEMM.
  const device_layer half(3000);
  const plan ph = make_plan(be, snapkv{.window = 8}, b, shape_of(half.in()));
  auto* wh = dev<std::byte>(std::int64_t(ph.workspace_bytes));
  stub::clear();
  run(ph, be, half.in(), {wh, ph.workspace_bytes}, out);
  const auto fused = stub::calls();
  CHECK(std::ranges::count_if(fused, [](const stub::call& c) { return c.name == "launch" && c.detail == "6 x 128"; }) ==
        2);
  CHECK(std::ranges::none_of(fused, [](const stub::call& c) { return c.name.starts_with("cublasGemm"); }));
  expect_queued_only("snapkv through the fused steps");
}

TEST_CASE("cuda (stub runtime): infkv::run of every score source only queues work on the caller's stream") {
  auto* status = dev<cuda::status_word>(1);
  const cuda::backend be{stream, status};
  const device_layer ly(3000);
  layer_inputs<> in = ly.in();
  in.accumulated = {dev<float>(2 * ly.n), 2, ly.n, ly.n};
  cuda::reset_status(status, stream);
  expect_queued_only("reset_status", false);
  const std::vector<std::pair<const char*, policy_spec>> specs{
      {"streaming_llm", streaming_llm{}.spec()},
      {"tova", tova{}.spec()},
      {"keydiff max", keydiff{.pool = pooling::max, .kernel = 5}.spec()},
      {"snapkv avg", snapkv{.window = 8, .kernel = 7, .pool = pooling::avg}.spec()},
      {"inf_mllm segment bias",
       inf_mllm{.window = 8, .bias = {.beta = 1.0, .shape = decay::exponential, .unit = age_unit::segments}}.spec()},
      {"expected_attention", expected_attention{.window = 8}.spec()},
      {"expected_attention mean only", expected_attention{.window = 8, .covariance = false}.spec()},
      {"h2o (accumulated)", policy_spec{.name = "h2o", .score = {.source = score_source::accumulated}}},
      {"union inf_mllm + keydiff", union_of<inf_mllm, keydiff>{{.window = 8}, {}, 0.25}.spec()}};
  const budget b{.capacity = 1024, .sinks = 4, .recent = 32};
  for (const auto& [name, spec] : specs)
    for (const plan_options opt : {plan_options{.g = granularity::per_head}, plan_options{.g = granularity::per_token},
                                   plan_options{.g = granularity::per_head, .adakv = adakv{.alpha = 0.2}}}) {
      if (opt.adakv && spec.score.one_row()) continue;
      if (spec.second && opt.g == granularity::per_head) continue;  // a union is one decision per layer or token
      INFO(name, " ", to_string(opt.g), opt.adakv ? " adakv" : "");
      const plan p = make_plan(be, spec, b, shape_of(in), opt);
      auto* ws = dev<std::byte>(std::int64_t(p.workspace_bytes));
      const keep_view out{dev<std::int64_t>(p.kept_total), dev<std::int64_t>(p.offsets_size()), p.units, ly.n};
      stub::clear();
      run(p, be, in, {ws, p.workspace_bytes}, out);
      expect_queued_only(name);
    }
}

TEST_CASE("cuda (stub runtime): compaction, re-rotation and H2O's steps only queue work, check is the one wait") {
  auto* status = dev<cuda::status_word>(1);
  const std::int64_t n = 5000, kept = 3000;
  const tensor_view k = nhd(dev<std::uint16_t>(n * 8 * 128), dtype::f16, n, 8, 128),
                    v = hnd(dev<std::uint16_t>(n * 8 * 128), dtype::f16, n, 8, 128, n);
  const std::span<token> tokens{dev<token>(n * 8), std::size_t(n * 8)};
  const const_keep_view keep{dev<std::int64_t>(kept * 8), dev<std::int64_t>(9), 8, n};
  const std::size_t bytes = cuda::compact_scratch_bytes(kept, 8, 256);
  CHECK(bytes <= std::size_t(cuda::compact_scratch_limit));  // bounded although K and V hold 160 MB
  const std::span<std::byte> ws{dev<std::byte>(std::int64_t(bytes)), bytes};
  stub::clear();
  cuda::compact(k, v, tokens, keep, kept, ws, status, stream);
  expect_queued_only("compact (strided, per head)");

  std::int32_t* pages = dev<std::int32_t>(n / 16);
  const paged_rows pk{{k.data, 16 * 8 * 128, 8 * 128, 128}, pages, dtype::f16, n, 8, 128, 16};
  paged_rows pv = pk;
  pv.store.data = v.data;
  const const_keep_view one{dev<std::int64_t>(kept), dev<std::int64_t>(2), 1, n};
  cuda::compact(pk, pv, tokens.first(std::size_t(n)), one, kept, ws, status, stream);
  expect_queued_only("compact (paged)");

  cuda::rerotate(k, dev<std::int64_t>(n), rope{}, status, stream);
  cuda::rerotate(pk, dev<std::int64_t>(n), rope{.dims = 64, .style = rope_style::neox}, status, stream);
  expect_queued_only("rerotate");

  const device_layer ly(2000);
  const cuda::h2o_state_view st{dev<float>(2 * 2048), dev<float>(2 * 2048), dev<float>(2 * 2048), 2, ly.n, 2048};
  const std::size_t hb = cuda::h2o_scratch_bytes(shape_of(ly.in()));  // planning: may create the cuBLAS handle
  stub::clear();
  cuda::h2o_observe(st, h2o{}, ly.in(), {dev<std::byte>(std::int64_t(hb)), hb}, status, stream);
  expect_queued_only("h2o_observe");
  cuda::h2o_state_view next = st;
  const std::size_t eb = cuda::compact_scratch_bytes(500, 2, 4);
  cuda::h2o_evict(next, {dev<std::int64_t>(500), dev<std::int64_t>(2), 1, ly.n}, 500,
                  {dev<std::byte>(std::int64_t(eb)), eb}, status, stream);
  CHECK(next.n_slots == 500);
  expect_queued_only("h2o_evict");

  // The recorder sees a wait when there is one: check() waits, by design.
  cuda::check(status, stream, "the step");
  const auto calls = stub::calls();
  CHECK(std::ranges::count_if(calls, [](const stub::call& c) { return c.forbidden; }) == 2);
  CHECK(std::ranges::any_of(calls, [](const stub::call& c) { return c.name == "cudaStreamSynchronize"; }));
  stub::clear();
}

TEST_CASE("cuda (stub runtime): entry checks name misaligned workspaces and host memory") {
  auto* status = dev<cuda::status_word>(1);
  const tensor_view k = nhd(dev<float>(100 * 2 * 8), dtype::f32, 100, 2, 8);
  const std::span<token> tokens{dev<token>(100), 100};
  const const_keep_view keep{dev<std::int64_t>(50), dev<std::int64_t>(2), 1, 100};
  const std::size_t bytes = cuda::compact_scratch_bytes(50, 2, 32);
  auto* ws = dev<std::byte>(std::int64_t(bytes) + 64);
  CHECK_THROWS_WITH_AS(cuda::compact(k, {}, tokens, keep, 50, {ws + 8, bytes}, status, stream),
                       doctest::Contains("ws.data()"), invalid_argument);
  std::vector<std::byte> host_ws(bytes + 64);
  auto* aligned = host_ws.data() + (64 - reinterpret_cast<std::uintptr_t>(host_ws.data()) % 64) % 64;
  CHECK_THROWS_WITH_AS(cuda::compact(k, {}, tokens, keep, 50, {aligned, bytes}, status, stream),
                       doctest::Contains("is host memory"), invalid_argument);
  cuda::status_word host_status = cuda::status_ok;
  CHECK_THROWS_WITH_AS(cuda::compact(k, {}, tokens, keep, 50, {ws, bytes}, &host_status, stream),
                       doctest::Contains("status"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      cuda::rerotate(k, dev<std::int64_t>(100), rope{}, reinterpret_cast<cuda::status_word*>(ws + 4), stream),
      doctest::Contains("8-byte aligned"), invalid_argument);
  CHECK_THROWS_WITH_AS(cuda::compact(k, {}, tokens, keep, 50, {ws, bytes - 1}, status, stream),
                       doctest::Contains("ws.size()"), invalid_argument);
  const cuda::backend no_status{stream, nullptr};
  const device_layer ly(300);
  const plan p = make_plan(no_status, snapkv{.window = 4}, budget{.capacity = 100}, shape_of(ly.in()));
  auto* pws = dev<std::byte>(std::int64_t(p.workspace_bytes));
  const keep_view out{dev<std::int64_t>(p.kept_total), dev<std::int64_t>(p.offsets_size()), p.units, ly.n};
  CHECK_THROWS_WITH_AS(run(p, no_status, ly.in(), {pws, p.workspace_bytes}, out), doctest::Contains("status"),
                       invalid_argument);
  stub::clear();
}
