// infkv example: the decode loop of a CPU engine whose KV cache lives within a fixed budget. One
// layer's contiguous f16 cache [slot][head][dim] is appended a block of tokens at a time; after
// each block that overflows the budget, an Inf-MLLM-style policy scores the cache from the
// block's last queries, the cache is compacted in place, the positions are closed up and the kept
// keys re-rotated (RoPE is relative), so the stream can run past the model's trained context.
// The "model" is random vectors; everything infkv sees is what a real engine hands it.
//
//   infkv-example-cpu-decode [tokens]      (default 4096; exits 1 if the cache ever overflows)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <vector>

#include <infkv/cpu.hpp>

int main(int argc, char** argv) {
  const std::int64_t n_tokens = argc > 1 ? std::atoll(argv[1]) : 4096;
  constexpr std::int32_t kv_heads = 2, q_heads = 8, head_dim = 64;
  constexpr std::int64_t block = 64, row = std::int64_t(kv_heads) * head_dim;
  const infkv::rope rope{.theta = 10000.0};  // the model's RoPE

  // example-begin engine-setup
  const auto policy = infkv::inf_mllm{.window = 16, .bias = {.beta = 0.5}};
  const infkv::budget budget{.capacity = 512, .sinks = 4, .recent = 32};
  // What the engine must copy out of its forward pass for this policy: the cached keys and the
  // last 16 queries with their positions (no values, no per-step attention, no RoPE).
  const infkv::capture_needs needs = infkv::capture_needs_of(policy);
  infkv::cpu::thread_pool threads(2);  // the engine's threads, lent to infkv for the whole stream
  const infkv::cpu::backend be{.ex = {.threads = 2, .pool = &threads}};
  // example-end

  const std::int64_t cells = budget.capacity + block;  // the cache never holds more
  std::vector<std::uint16_t> k(std::size_t(cells * row)), v(std::size_t(cells * row));
  std::vector<float> q(std::size_t(block * q_heads * head_dim));  // this block's queries
  std::vector<std::int64_t> q_pos(block);
  std::vector<infkv::token> tokens;  // position (and segment, modality) of every cached slot
  std::optional<infkv::cpu::workspace> ws;
  std::vector<std::int64_t> slots, offsets;
  std::mt19937 rng(1);
  std::normal_distribution<float> gauss;
  std::vector<float> x(static_cast<std::size_t>(row));
  std::int64_t next_pos = 0, evictions = 0;

  for (std::int64_t t0 = 0; t0 < n_tokens; t0 += block) {
    // Decode one block: the model appends K and V rows (f16) and gives the block's queries.
    const std::int64_t nb = std::min(block, n_tokens - t0), n0 = std::int64_t(tokens.size());
    for (std::int64_t i = 0; i < nb; ++i) {
      for (auto* out : {k.data(), v.data()}) {
        for (auto& e : x) e = gauss(rng);
        infkv::from_f32(infkv::dtype::f16, x.data(), out + (n0 + i) * row, row);
      }
      for (std::int64_t e = 0; e < q_heads * head_dim; ++e) q[std::size_t(i * q_heads * head_dim + e)] = gauss(rng);
      q_pos[std::size_t(i)] = next_pos;
      tokens.push_back({.pos = next_pos++});
    }
    if (std::int64_t(tokens.size()) <= budget.capacity) continue;

    // example-begin engine-evict
    // Over budget: score the cache from the block's last needs.queries queries, keep the best.
    const auto n = std::int64_t(tokens.size()), m = std::min(needs.queries, nb);
    const infkv::layer_inputs<> in{
        .keys = infkv::nhd(k.data(), infkv::dtype::f16, n, kv_heads, head_dim),
        .queries = infkv::nhd(q.data() + (nb - m) * q_heads * head_dim, infkv::dtype::f32, m, q_heads, head_dim),
        .query_pos = {q_pos.data() + (nb - m), std::size_t(m)},
        .tokens = tokens};
    const infkv::plan plan = infkv::make_plan(be, policy, budget, infkv::shape_of(in),
                                              {.g = infkv::granularity::per_token});  // shapes only: cheap
    if (!ws || ws->span().size() < plan.workspace_bytes) ws.emplace(plan.workspace_bytes);
    slots.resize(std::size_t(plan.kept_total)), offsets.resize(std::size_t(plan.offsets_size()));
    const infkv::keep_view keep{slots.data(), offsets.data(), plan.units, n};
    infkv::run(plan, be, in, ws->span(), keep);

    // Compact K, V and tokens in place, then close the position gaps and turn each kept key by
    // its position change, as if it had been computed at its new position.
    auto kv = infkv::contiguous_nhd(k.data(), v.data(), infkv::dtype::f16, n, kv_heads, head_dim);
    tokens.resize(std::size_t(infkv::cpu::compact(kv, tokens, infkv::keep_set::from_view(keep))));
    const std::vector<std::int64_t> delta = infkv::compact_positions(tokens);
    infkv::cpu::rerotate(kv.k, delta, rope, be.ex);
    next_pos = std::int64_t(tokens.size());  // the next token continues right after the cache
    // example-end
    ++evictions;

    bool dense = true;  // positions are 0..n-1 again
    for (const auto& t : tokens) dense = dense && t.pos >= 0 && t.pos < std::int64_t(tokens.size());
    if (std::int64_t(tokens.size()) > budget.capacity || !dense) {
      std::fprintf(stderr, "infkv-example-cpu-decode: after token %lld the cache holds %zu slots (budget %lld)%s\n",
                   static_cast<long long>(t0 + nb), tokens.size(), static_cast<long long>(budget.capacity),
                   dense ? "" : " with positions outside 0..n-1");
      return 1;
    }
    if (evictions % 16 == 1)
      std::printf("token %6lld: evicted %lld of %lld slots, cache %zu / %lld (peak %lld)\n",
                  static_cast<long long>(t0 + nb), static_cast<long long>(n - std::int64_t(tokens.size())),
                  static_cast<long long>(n), tokens.size(), static_cast<long long>(budget.capacity),
                  static_cast<long long>(cells));
  }
  std::printf("%lld tokens streamed through %lld cache slots: %lld evictions, %zu slots held, positions 0..%zu\n",
              static_cast<long long>(n_tokens), static_cast<long long>(cells), static_cast<long long>(evictions),
              tokens.size(), tokens.empty() ? 0 : tokens.size() - 1);
  return 0;
}
