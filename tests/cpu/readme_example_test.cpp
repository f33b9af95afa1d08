// The README's code, compiled and run: each region between `example-begin NAME` and
// `example-end` must appear verbatim (dedented) in README.md after `<!-- example: NAME -->`
// (scripts/check_readme_examples.py, ctest readme_examples). Buffers hold random data.
#include <cstdint>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

TEST_CASE("the README usage example runs and keeps the budget") {
  const std::int64_t n_slots = 3000;
  const std::int32_t n_kv_heads = 2, n_q_heads = 4, head_dim = 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> kf(std::size_t(n_slots * n_kv_heads * head_dim)), vf(kf.size()), q(std::size_t(32 * n_q_heads * head_dim));
  for (auto& x : kf) x = normal(rng);
  for (auto& x : vf) x = normal(rng);
  for (auto& x : q) x = normal(rng);
  std::vector<std::uint16_t> k16(kf.size()), v16(vf.size());
  infkv::from_f32(infkv::dtype::f16, kf.data(), k16.data(), std::int64_t(kf.size()));
  infkv::from_f32(infkv::dtype::f16, vf.data(), v16.data(), std::int64_t(vf.size()));
  void* k_ptr = k16.data();
  void* v_ptr = v16.data();
  void* q_ptr = q.data();
  std::vector<std::int64_t> q_pos(32);
  for (std::int64_t i = 0; i < 32; ++i) q_pos[std::size_t(i)] = n_slots - 32 + i;

  // example-begin cpu-select
  auto kv     = infkv::contiguous_nhd(k_ptr, v_ptr, infkv::dtype::f16, n_slots, n_kv_heads, head_dim);
  auto tokens = infkv::text_tokens(n_slots);
  auto qview  = infkv::nhd(q_ptr, infkv::dtype::f32, 32, n_q_heads, head_dim);

  infkv::layer_inputs<> in{.keys = kv.k, .queries = qview, .query_pos = q_pos, .tokens = tokens};
  auto policy = infkv::inf_mllm{.window = 32, .bias = {.beta = 0.5, .shape = infkv::decay::linear}};
  infkv::budget b{.capacity = 1024, .sinks = 4, .recent = 256};

  infkv::keep_set keep = infkv::cpu::select(policy, b, in, infkv::granularity::per_token);
  const auto evicted = keep.evicted_runs(tokens);
  tokens.resize(infkv::cpu::compact(kv, tokens, keep));   // in place: K, V and tokens
  // example-end

  CHECK(keep.n_units() == 1);
  CHECK(keep.size(0) == 1024);
  CHECK(kv.k.n_slots == 1024);
  CHECK(tokens[0].pos == 0);
  CHECK(tokens.size() == 1024);
  CHECK(tokens[1023].pos == n_slots - 1);
  std::int64_t removed = 0;
  for (const auto& r : evicted) removed += r.end - r.begin;
  CHECK(removed == n_slots - 1024);
}

TEST_CASE("the README pipeline example plans once and runs without allocating") {
  const std::int64_t n_slots = 2000;
  const std::int32_t n_kv_heads = 2, n_q_heads = 4, head_dim = 32;
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<float> k(std::size_t(n_slots * n_kv_heads * head_dim)), q(std::size_t(32 * n_q_heads * head_dim));
  for (auto& x : k) x = normal(rng);
  for (auto& x : q) x = normal(rng);
  std::vector<std::int64_t> q_pos(32);
  for (std::int64_t i = 0; i < 32; ++i) q_pos[std::size_t(i)] = n_slots - 32 + i;
  const auto tokens = infkv::text_tokens(n_slots);
  const infkv::layer_inputs<> in{.keys = infkv::nhd(k.data(), infkv::dtype::f32, n_slots, n_kv_heads, head_dim),
                                 .queries = infkv::nhd(q.data(), infkv::dtype::f32, 32, n_q_heads, head_dim),
                                 .query_pos = q_pos,
                                 .tokens = tokens};

  // example-begin pipeline
  const infkv::cpu::backend be{.ex = {.threads = 1}};
  const infkv::plan plan = infkv::make_plan(be, infkv::snapkv{.window = 32}, {.capacity = 512, .sinks = 4},
                                            infkv::shape_of(in), {.g = infkv::granularity::per_head});
  infkv::cpu::workspace ws(plan.workspace_bytes);                 // or any 64-byte-aligned buffer
  std::vector<std::int64_t> offsets(plan.offsets_size()), slots(plan.kept_total);
  const infkv::keep_view keep{slots.data(), offsets.data(), plan.units, plan.shape.n_slots};
  infkv::run(plan, be, std::span(&in, 1), ws.span(), keep);      // allocates nothing
  // example-end

  CHECK(keep.n_units == 2);
  CHECK(keep.size(0) == 512);
  CHECK(keep.size(1) == 512);
  CHECK(infkv::keep_set::from_view(keep) ==
        infkv::cpu::select(infkv::snapkv{.window = 32}, {.capacity = 512, .sinks = 4}, in, infkv::granularity::per_head));
}
