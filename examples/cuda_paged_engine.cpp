// infkv-example-cuda-paged: the shape of a serving engine's decode loop with a paged device KV cache
// (FlashInfer / vLLM page table: [pages][page_size][heads][head_dim] per tensor, CSR indptr /
// indices / last-page lengths) bounded by infkv::cuda: every `block` tokens the cache is scored
// (Inf-MLLM-style window attention + bias, one decision per token), compacted in its pages, and
// the engine returns the pages the sequence no longer needs to its free list. Every infkv call
// only queues work on the stream; the engine waits once per eviction, in cuda::check. Keys, values and queries are
// random: the point is the calls and the memory, not the model. Usage: infkv-example-cuda-paged [tokens] (4096).
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/core.h>
#include <infkv/cuda.hpp>

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw infkv::engine_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}
template <class T>
T* device(std::size_t n) {
  void* p = nullptr;
  ok(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}
template <class T>
void upload(T* dst, const std::vector<T>& src) {
  ok(cudaMemcpy(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
}
template <class T>
void download(std::vector<T>& dst, const T* src) {
  ok(cudaMemcpy(dst.data(), src, dst.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
}

}  // namespace

int main(int argc, char** argv) try {
  const std::int64_t total = argc > 1 ? std::stoll(argv[1]) : 4096;
  if (!infkv::cuda::device_available()) {
    fmt::print(stderr, "infkv-example-cuda-paged: no CUDA device: nothing to run\n");
    return 77;
  }
  const std::int32_t heads = 8, q_heads = 32, dim = 128, page = 16, pool = 256, window = 32;
  const std::int64_t budget = 1024, block = 128, row = std::int64_t(heads) * dim;  // f16 elements per slot
  auto* k = device<std::uint16_t>(std::size_t(pool) * page * row);
  auto* v = device<std::uint16_t>(std::size_t(pool) * page * row);
  auto* q = device<std::uint16_t>(std::size_t(window) * q_heads * dim);
  std::vector<std::int32_t> indptr{0, 0}, indices, last{0}, free_pages;
  for (std::int32_t p = pool - 1; p >= 0; --p) free_pages.push_back(p);
  auto* d_indices = device<std::int32_t>(pool);
  auto* d_tokens = device<infkv::token>(std::size_t(budget + block));
  auto* d_qpos = device<std::int64_t>(window);
  auto* status = device<infkv::cuda::status_word>(1);
  std::vector<infkv::token> tokens;
  std::mt19937 gen(1);
  std::vector<std::uint16_t> kv_row(static_cast<std::size_t>(row)),
      qs(static_cast<std::size_t>(window * q_heads * dim));
  const infkv::inf_mllm policy{.window = window, .bias = {.beta = 0.5}};
  const infkv::cuda::backend be{nullptr, status};  // default stream
  infkv::cuda::reset_status(status, be.stream);
  for (std::int64_t pos = 0; pos < total; ++pos) {
    // The engine appends the new token's K and V (random here) to the sequence's last page.
    if (last[0] == 0 || last[0] == page) {
      if (free_pages.empty()) throw infkv::engine_error("out of pages");
      indices.push_back(free_pages.back()), free_pages.pop_back(), last[0] = 0, indptr[1] += 1;
    }
    for (auto& x : kv_row) x = std::uint16_t(0x3000 + gen() % 0x0c00);  // f16 in [0.125, 1)
    const std::size_t at = (std::size_t(indices.back()) * page + std::size_t(last[0])) * std::size_t(row);
    ok(cudaMemcpy(k + at, kv_row.data(), kv_row.size() * 2, cudaMemcpyHostToDevice), "append K");
    ok(cudaMemcpy(v + at, kv_row.data(), kv_row.size() * 2, cudaMemcpyHostToDevice), "append V");
    last[0] += 1;
    tokens.push_back({pos, 0, infkv::modality::text});
    const auto n = std::int64_t(tokens.size());
    if (n < budget + block) continue;
    // Evict: score the cache from the last `window` queries (random here), keep `budget` slots.
    for (auto& x : qs) x = std::uint16_t(0x3000 + gen() % 0x0c00);
    std::vector<std::int64_t> qpos(window);
    for (std::int32_t i = 0; i < window; ++i) qpos[std::size_t(i)] = pos - window + 1 + i;
    upload(q, qs), upload(d_qpos, qpos), upload(d_tokens, tokens);
    upload(d_indices, indices);
    const infkv::page_storage ks{k, std::int64_t(page) * row, row, dim}, vs{v, std::int64_t(page) * row, row, dim};
    const infkv::paged_rows keys{ks, d_indices, infkv::dtype::f16, n, heads, dim, page};
    const infkv::layer_inputs<infkv::const_paged_rows> in{
        .keys = keys,
        .queries = infkv::nhd(q, infkv::dtype::f16, window, q_heads, dim),
        .query_pos = {d_qpos, std::size_t(window)},
        .tokens = {d_tokens, std::size_t(n)}};
    const infkv::plan plan = infkv::make_plan(be, policy, {.capacity = budget, .sinks = 4}, infkv::shape_of(in),
                                              {.g = infkv::granularity::per_token});
    auto* ws = device<std::byte>(plan.workspace_bytes);
    auto* slots = device<std::int64_t>(std::size_t(plan.kept_total));
    auto* offsets = device<std::int64_t>(2);
    const infkv::keep_view keep{slots, offsets, 1, n};
    infkv::run(plan, be, in, {ws, plan.workspace_bytes}, keep);
    const std::size_t cbytes = infkv::cuda::compact_scratch_bytes(plan.kept_total, heads, std::int64_t(dim) * 2);
    auto* cws = device<std::byte>(cbytes);
    infkv::paged_rows values = keys;
    values.store = vs;
    infkv::cuda::compact(keys, values, {d_tokens, std::size_t(n)}, keep, plan.kept_total, {cws, cbytes}, status,
                         be.stream);
    infkv::cuda::check(status, be.stream, "eviction");  // the one wait: raises what the kernels found
    // The engine updates its own table: the kept slots fill the sequence's first pages, the last
    // pages_freed of its list go back to the free list.
    const std::int64_t kept = plan.kept_total, freed = infkv::pages_freed(n, kept, page);
    free_pages.insert(free_pages.end(), indices.end() - freed, indices.end());
    indices.resize(indices.size() - std::size_t(freed));
    indptr[1] = std::int32_t(indices.size());
    last[0] = kept == 0 ? 0 : std::int32_t(kept - std::int64_t(indices.size() - 1) * page);
    tokens.resize(std::size_t(kept)), download(tokens, d_tokens);
    fmt::print("pos {:>7}: {} -> {} slots, {} pages freed, {} in use, {} free; oldest kept position {}\n", pos, n,
               tokens.size(), freed, indices.size(), free_pages.size(), tokens.front().pos);
    cudaFree(ws), cudaFree(slots), cudaFree(offsets), cudaFree(cws);
  }
  fmt::print("streamed {} tokens through {} slots ({} pages of {})\n", total, tokens.size(), indices.size(), page);
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "infkv-example-cuda-paged: {}\n", e.what());
  return 1;
}
