// infkv CUDA backend: the pipeline's primitives as kernels on a CUDA stream, plus compaction and
// RoPE re-rotation of device caches. Compiled once into the `infkv::cuda` library (nvcc), so
// this header is plain C++: g++ code includes it and links the library, nothing else needs nvcc.
//
//   const infkv::cuda::backend be{stream};
//   const infkv::plan p = infkv::make_plan(be, policy, budget, shape);   // sizes, as on the CPU
//   cudaMalloc(workspace of p.workspace_bytes), keep slots / offsets buffers
//   infkv::cuda::run(p, be, layers, ws, out);   // queued on the stream; waits, raises a fault
//
// Every pointer in the views, token lists, workspace and keep view is device memory. Host
// functions raise `infkv::engine_error` when a CUDA call fails (naming it and CUDA's message)
// and `infkv::invalid_argument` for bad arguments; kernels never throw: what they find wrong (a
// NaN key or score, a negative position, a keep set or page table that does not fit) is recorded
// in the workspace's status word, and `check` (called by `run`, `compact`) raises it by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "detail/cache_steps.hpp"

namespace infkv::cuda {

/// True when a CUDA device can be used (a driver and at least one device).
bool device_available();

/// The CUDA backend of the pipeline: every primitive queues kernels on `stream`.
struct backend {
  cudaStream_t stream = nullptr;

  std::size_t scratch_bytes(const policy_spec& spec, const layer_shape& shape, const plan_options& opt = {}) const;
  void time_order(std::span<const token> tokens, std::int64_t* order, std::span<std::byte> scratch) const;
  void score(const policy_spec& spec, const layer_inputs<const_tensor_view>& in, const std::int64_t* order,
             score_view out, std::span<std::byte> scratch) const;
  void score(const policy_spec& spec, const layer_inputs<const_paged_rows>& in, const std::int64_t* order,
             score_view out, std::span<std::byte> scratch) const;
  void value_norm(score_view s, const const_tensor_view& values, std::span<std::byte> scratch) const;
  void value_norm(score_view s, const const_paged_rows& values, std::span<std::byte> scratch) const;
  void pool(score_view s, const std::int64_t* order, const policy_spec& spec, std::span<std::byte> scratch) const;
  void group_mean(score_view in, score_view out) const;
  void fill_tail(score_view s, const std::int64_t* order, std::int64_t tail, std::span<std::byte> scratch) const;
  void bias(score_view s, std::span<const token> tokens, const std::int64_t* order, const policy_spec& spec,
            std::span<std::byte> scratch) const;
  void reduce(score_view acc, score_view s, reduction r, bool first) const;
  void finish_reduction(score_view acc, reduction r, std::int64_t rows) const;
  void allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b, std::int64_t cap,
                std::int64_t* caps, std::span<std::byte> scratch) const;
  void select(score_view s, std::span<const token> tokens, const std::int64_t* order, const std::int64_t* caps,
              std::int64_t cap, const budget& keep, keep_view out, std::span<std::byte> scratch) const;
};

static_assert(infkv::backend<backend>);
static_assert(infkv::backend<backend, const_paged_rows>);

/// Waits for `stream` and raises what the kernels recorded in the status word at the start of
/// `status` (the backend's scratch of a plan's workspace, or a compaction's workspace).
void check(const void* status, cudaStream_t stream, const char* what);

/// infkv::run on the device, then waits and raises any fault the kernels recorded.
template <row_source R>
void run(const plan& p, const backend& be, std::span<const layer_inputs<R>> layers, std::span<std::byte> ws,
         keep_view out) {
  infkv::run(p, be, layers, ws, out);
  check(ws.data() + p.backend, be.stream, "cuda::run");
}
/// As above for layers the caller may still change.
template <row_source R>
void run(const plan& p, const backend& be, std::span<layer_inputs<R>> layers, std::span<std::byte> ws, keep_view out) {
  run(p, be, std::span<const layer_inputs<R>>(layers), ws, out);
}
/// As above for one layer.
template <row_source R>
void run(const plan& p, const backend& be, const layer_inputs<R>& layer, std::span<std::byte> ws, keep_view out) {
  run(p, be, std::span<const layer_inputs<R>>(&layer, 1), ws, out);
}

/// Compacts a strided device cache in place: unit u of `keep` (one unit for all heads, or one per
/// head), `kept` slots each, moves to slots [0, kept) of K, V (either may be empty) and `tokens`
/// (n_slots entries, or heads x n_slots packed to heads x kept). `ws`: compact_scratch_bytes(kept,
/// heads, row bytes) of device memory. Waits; a keep set that does not fit raises and moves
/// nothing.
void compact(tensor_view k, tensor_view v, std::span<token> tokens, const_keep_view keep, std::int64_t kept,
             std::span<std::byte> ws, cudaStream_t stream);

/// Compacts sequence `seq` (holding `n_slots` slots) of a paged device cache: kept rows move to
/// the front of its pages, the table (indptr, indices, last_page_len: device arrays) drops the
/// pages no longer needed and their ids go to `freed` (device, pages_freed(n_slots, kept, page
/// size) entries). Returns that count. Waits; a table or keep set that does not fit raises and
/// changes nothing.
std::int64_t compact(const paged_view& p, std::int32_t seq, std::int64_t n_slots, std::span<token> tokens,
                     const_keep_view keep, std::int64_t kept, std::int32_t* freed, std::span<std::byte> ws,
                     cudaStream_t stream);

/// H2O on the device: one decode step's attention (every query of `in`) accumulated into the
/// state (cpu::observe's semantics); `ws`: h2o_scratch_bytes(shape_of(in)) of device memory.
/// The pipeline then reads `st.scores()` as layer_inputs::accumulated. Waits; NaN keys or
/// queries raise by name.
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_tensor_view>& in,
                 std::span<std::byte> ws, cudaStream_t stream);
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_paged_rows>& in,
                 std::span<std::byte> ws, cudaStream_t stream);
/// Scratch h2o_observe needs for a layer of `shape` (on a device: the radix sort's size is asked).
std::size_t h2o_scratch_bytes(const layer_shape& shape);
/// Keeps the slots of `keep` (`kept` per unit: one unit, or one per head) in the state, compacted
/// as the cache is; `ws`: compact_scratch_bytes(kept, st.heads, 4). Waits.
void h2o_evict(h2o_state_view& st, const_keep_view keep, std::int64_t kept, std::span<std::byte> ws,
               cudaStream_t stream);

/// Rotates every head of slot j of device keys by delta[j] positions (device array of n_slots).
void rerotate(const tensor_view& keys, const std::int64_t* delta, const rope& r, cudaStream_t stream);
void rerotate(const paged_rows& keys, const std::int64_t* delta, const rope& r, cudaStream_t stream);

}  // namespace infkv::cuda
