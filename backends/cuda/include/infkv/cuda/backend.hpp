// infkv CUDA backend: the pipeline's primitives as kernels on a CUDA stream, plus compaction and
// RoPE re-rotation of device caches. Compiled once into the `infkv::cuda` library (nvcc), so
// this header is plain C++: g++ code includes it and links the library, nothing else needs nvcc.
//
//   status_word* status;  cudaMalloc(&status, sizeof *status);  cuda::reset_status(status, stream);
//   const infkv::cuda::backend be{stream, status};
//   const infkv::plan p = infkv::make_plan(be, policy, budget, shape);   // sizes, as on the CPU
//   cudaMalloc(workspace of p.workspace_bytes), keep slots / offsets buffers
//   infkv::run(p, be, layers, ws, out);          // queued on the stream, returns at once
//   infkv::cuda::compact(k, v, tokens, out, p.kept_total, compact_ws, status, stream);
//   ... later, when the engine chooses:  infkv::cuda::check(status, stream, "eviction");
//
// Nothing but `check` waits for the device or copies to host memory: every call only queues work
// on its stream, so it can be captured into a CUDA graph. Every pointer in the views, token
// lists, workspaces, keep views and the status word is device memory. Host functions raise
// `infkv::engine_error` when a CUDA call fails (naming it and CUDA's message) and
// `infkv::invalid_argument` for bad arguments found on the host (shapes, sizes, alignment,
// pointers that are not device memory); kernels never throw: what they find wrong (a NaN key or
// score, a negative position, a keep set that does not fit) is recorded in the status word, the
// smallest fault code wins, and every later step that changes a cache (compaction,
// re-rotation, H2O's state) then changes nothing, so a fault never leaves a cache half moved.
// `check` raises what was recorded, by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include <infkv/kv_view.hpp>
#include <infkv/pipeline.hpp>
#include <infkv/policies/h2o.hpp>
#include <infkv/rope.hpp>

#include "cache.hpp"
#include "status.hpp"

namespace infkv::cuda {

/// True when a CUDA device can be used (a driver and at least one device).
bool device_available();

/// Sets the status word to "nothing recorded" (queued on `stream`).
void reset_status(status_word* status, cudaStream_t stream);

/// The one synchronising call: waits for `stream`, reads the status word and raises what the
/// kernels recorded (`what` names the caller's step in the message). The word is left as it is.
void check(const status_word* status, cudaStream_t stream, const char* what);

/// The CUDA backend of the pipeline: every primitive queues kernels on `stream` and records
/// faults in `status` (device memory, 8-byte aligned; reset by the caller).
struct backend {
  cudaStream_t stream = nullptr;
  status_word* status = nullptr;
  /// Bits of the largest token position (a promise: a position at or above 2^position_bits is
  /// recorded as bad_position): the time order's radix sort runs a pass per 8 of them (31 by
  /// default, every position of llama.cpp's 32-bit llama_pos and of any context an engine serves:
  /// 4 passes; 63, every position infkv takes (max_position): 8; 24: 3).
  int position_bits = 31;

  std::size_t scratch_bytes(const score_spec& spec, const layer_shape& shape, const plan_options& opt = {}) const;
  void time_order(std::span<const token> tokens, std::int64_t* order, std::span<std::byte> scratch) const;
  void score(const score_spec& spec, const layer_inputs<const_tensor_view>& in, const std::int64_t* order,
             score_view out, std::span<std::byte> scratch) const;
  void score(const score_spec& spec, const layer_inputs<const_paged_rows>& in, const std::int64_t* order,
             score_view out, std::span<std::byte> scratch) const;
  void value_norm(score_view s, const const_tensor_view& values, std::span<std::byte> scratch) const;
  void value_norm(score_view s, const const_paged_rows& values, std::span<std::byte> scratch) const;
  void pool(score_view s, const std::int64_t* order, const score_spec& spec, std::span<std::byte> scratch) const;
  void group_mean(score_view in, score_view out) const;
  void fill_tail(score_view s, const std::int64_t* order, std::int64_t tail, std::span<std::byte> scratch) const;
  void bias(score_view s, std::span<const token> tokens, const std::int64_t* order, const score_spec& spec,
            std::span<std::byte> scratch) const;
  void reduce(score_view acc, score_view s, reduction r, bool first) const;
  void finish_reduction(score_view acc, reduction r, std::int64_t rows) const;
  void allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b, std::int64_t cap,
                std::int64_t* caps, std::span<std::byte> scratch) const;
  void keep_top(score_view s, std::span<const token> tokens, const std::int64_t* order, const std::int64_t* caps,
                std::int64_t cap, const budget& keep, keep_view out, std::span<std::byte> scratch) const;
  void mark(score_view s, const std::int64_t* slots, std::int64_t count) const;
};

static_assert(infkv::backend<backend>);
static_assert(infkv::backend<backend, const_paged_rows>);

/// Compacts a device cache in place: unit u of `keep` (one unit for all heads, or one per head),
/// `kept` slots each, moves to slots [0, kept) of K, V (V may be empty) and `tokens` (n_slots
/// entries, or heads x n_slots packed to heads x kept). K and V are strided views, or one
/// sequence's paged rows: the sequence then holds its kept slots in the first
/// ceil(kept / page_size) pages of its list and the last pages_freed(n_slots, kept, page_size)
/// are the engine's to free (its page table is never touched). `ws`: compact_scratch_bytes(kept,
/// heads, row bytes) of device memory (at most 16 MiB whatever the cache's size). Queued on
/// `stream`; a keep set that does not fit records bad_keep and moves nothing.
void compact(const tensor_view& k, const tensor_view& v, std::span<token> tokens, const_keep_view keep,
             std::int64_t kept, std::span<std::byte> ws, status_word* status, cudaStream_t stream);
void compact(const paged_rows& k, const paged_rows& v, std::span<token> tokens, const_keep_view keep, std::int64_t kept,
             std::span<std::byte> ws, status_word* status, cudaStream_t stream);

/// H2O on the device: one decode step's attention (every query of `in`) accumulated into the
/// state (cpu::observe's semantics); `ws`: h2o_scratch_bytes(shape_of(in)) of device memory.
/// The pipeline then reads `st.scores()` as layer_inputs::accumulated. NaN keys or queries are
/// recorded (and the state is left as it was).
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_tensor_view>& in,
                 std::span<std::byte> ws, status_word* status, cudaStream_t stream);
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_paged_rows>& in,
                 std::span<std::byte> ws, status_word* status, cudaStream_t stream);
/// Scratch h2o_observe needs for a layer of `shape` (on a device: the radix sort's size is asked).
std::size_t h2o_scratch_bytes(const layer_shape& shape);
/// Keeps the slots of `keep` (`kept` per unit: one unit, or one per head) in the state, compacted
/// as the cache is; `ws`: compact_scratch_bytes(kept, st.heads, 4).
void h2o_evict(h2o_state_view& st, const_keep_view keep, std::int64_t kept, std::span<std::byte> ws,
               status_word* status, cudaStream_t stream);

/// Rotates every head of slot j of device keys by delta[j] positions (device array of n_slots);
/// does nothing once the status word holds a fault.
void rerotate(const tensor_view& keys, const std::int64_t* delta, const rope& r, const status_word* status,
              cudaStream_t stream);
void rerotate(const paged_rows& keys, const std::int64_t* delta, const rope& r, const status_word* status,
              cudaStream_t stream);

}  // namespace infkv::cuda
