// infkv CUDA backend: cuda::backend's primitives, compaction and re-rotation, each the steps of
// cuda/steps.hpp and cuda/cache_steps.hpp run by the device launcher (one kernel per step).
#include <infkv/cuda/backend.hpp>
#include <infkv/cuda/detail/archive_steps.hpp>
#include <infkv/cuda/detail/cache_steps.hpp>

#include "launcher.cuh"

namespace infkv::cuda {

namespace detail {

/// Raises when `p` is not memory the device can use (device or managed memory).
void require_device(const void* p, const char* name) {
  cudaPointerAttributes a{};
  check_cuda(cudaPointerGetAttributes(&a, p), "cudaPointerGetAttributes");
  INFKV_REQUIRE(a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged, name, p,
                a.type == cudaMemoryTypeHost ? "is pinned host memory" : "is host memory",
                ": infkv::cuda needs device (or managed) memory here");
}

/// Checks the status word: set, 8-byte aligned (its faults are recorded by 8-byte atomics), device memory.
void require_status(const void* status) {
  INFKV_REQUIRE(status != nullptr, "status", "null", "the kernels record faults in a device status word");
  INFKV_REQUIRE(reinterpret_cast<std::uintptr_t>(status) % 8 == 0, "status", status, "must be 8-byte aligned");
  require_device(status, "status");
}

/// Checks a workspace: `need` bytes at least, 64-byte aligned, device memory.
void require_workspace(std::span<std::byte> ws, std::size_t need, const char* what) {
  INFKV_REQUIRE(ws.size() >= need, "ws.size()", ws.size(), what, " needs ", need, " bytes");
  INFKV_REQUIRE(reinterpret_cast<std::uintptr_t>(ws.data()) % 64 == 0, "ws.data()", static_cast<void*>(ws.data()),
                "must be 64-byte aligned");
  if (!ws.empty()) require_device(ws.data(), "ws.data()");
}

inline basic_backend<device_launcher> impl(const backend& b) {
  basic_backend<device_launcher> r{device_launcher{b.stream}, b.status};
  r.position_bits = b.position_bits;
  return r;
}

}  // namespace detail

using detail::impl;

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::size_t backend::scratch_bytes(const score_spec& spec, const layer_shape& shape, const plan_options& opt) const {
  return impl(*this).scratch_bytes(spec, shape, opt);
}
void backend::time_order(std::span<const token> tokens, std::int64_t* order, std::span<std::byte> scratch) const {
  detail::require_status(status);  // every run starts here
  detail::require_workspace(scratch, 0, "the backend");
  impl(*this).time_order(tokens, order, scratch);
}
void backend::score(const score_spec& spec, const layer_inputs<const_tensor_view>& in, const std::int64_t* order,
                    score_view out, std::span<std::byte> scratch) const {
  impl(*this).score(spec, in, order, out, scratch);
}
void backend::score(const score_spec& spec, const layer_inputs<const_paged_rows>& in, const std::int64_t* order,
                    score_view out, std::span<std::byte> scratch) const {
  impl(*this).score(spec, in, order, out, scratch);
}
void backend::value_norm(score_view s, const const_tensor_view& values, std::span<std::byte> scratch) const {
  impl(*this).value_norm(s, values, scratch);
}
void backend::value_norm(score_view s, const const_paged_rows& values, std::span<std::byte> scratch) const {
  impl(*this).value_norm(s, values, scratch);
}
void backend::pool(score_view s, const std::int64_t* order, const score_spec& spec,
                   std::span<std::byte> scratch) const {
  impl(*this).pool(s, order, spec, scratch);
}
void backend::group_mean(score_view in, score_view out) const { impl(*this).group_mean(in, out); }
void backend::fill_tail(score_view s, const std::int64_t* order, std::int64_t tail,
                        std::span<std::byte> scratch) const {
  impl(*this).fill_tail(s, order, tail, scratch);
}
void backend::bias(score_view s, std::span<const token> tokens, const std::int64_t* order, const score_spec& spec,
                   std::span<std::byte> scratch) const {
  impl(*this).bias(s, tokens, order, spec, scratch);
}
void backend::reduce(score_view acc, score_view s, reduction r, bool first) const {
  impl(*this).reduce(acc, s, r, first);
}
void backend::finish_reduction(score_view acc, reduction r, std::int64_t rows) const {
  impl(*this).finish_reduction(acc, r, rows);
}
void backend::allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b, std::int64_t cap,
                       std::int64_t* caps, std::span<std::byte> scratch) const {
  impl(*this).allocate(a, s, order, b, cap, caps, scratch);
}
void backend::keep_top(score_view s, std::span<const token> tokens, const std::int64_t* order, const std::int64_t* caps,
                       std::int64_t cap, const budget& keep, keep_view out, std::span<std::byte> scratch) const {
  impl(*this).keep_top(s, tokens, order, caps, cap, keep, out, scratch);
}
void backend::mark(score_view s, const std::int64_t* slots, std::int64_t count) const {
  impl(*this).mark(s, slots, count);
}

void reset_status(status_word* status, cudaStream_t stream) {
  detail::require_status(status);
  detail::check_cuda(cudaMemsetAsync(status, 0xff, sizeof *status, stream), "cudaMemsetAsync (status)");
}

void check(const status_word* status, cudaStream_t stream, const char* what) {
  detail::require_status(status);
  status_word w = status_ok;
  detail::check_cuda(cudaMemcpyAsync(&w, status, sizeof w, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync (status)");
  detail::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  raise_if(decode(w), what);
}

namespace detail {
template <row_source R>
void compact(const R& k, const R& v, std::span<token> tokens, const_keep_view keep, std::int64_t kept,
             std::span<std::byte> ws, status_word* status, cudaStream_t stream) {
  validate(k, "k");
  if (!v.empty()) {
    validate(v, "v");
    INFKV_REQUIRE(v.n_slots == k.n_slots && v.n_heads == k.n_heads && v.type == k.type && v.head_dim == k.head_dim,
                  "v.n_slots", v.n_slots, "V must match K (", k.n_slots, " slots, ", k.n_heads,
                  " heads, its type and head_dim)");
  }
  const std::int64_t n = k.n_slots;
  INFKV_REQUIRE(keep.n_slots == n && (keep.n_units == 1 || keep.n_units == k.n_heads), "keep.n_units", keep.n_units,
                "must be 1 or k.n_heads (", k.n_heads, ") over k.n_slots = ", n,
                " slots; keep.n_slots = ", keep.n_slots);
  INFKV_REQUIRE(kept >= 0 && kept <= n, "kept", kept, "must be in [0, n_slots = ", n, "]");
  const bool per_head_tokens = std::int64_t(tokens.size()) == n * k.n_heads && k.n_heads > 1;
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n || per_head_tokens, "tokens.size()", tokens.size(),
                "must be n_slots (", n, ") or n_heads x n_slots (", n * k.n_heads, ")");
  INFKV_REQUIRE(keep.n_units == 1 || per_head_tokens, "keep.n_units", keep.n_units,
                "heads keeping different slots need one token list per head (n_heads x n_slots tokens)");
  require_status(status);
  require_workspace(ws, compact_scratch_bytes(kept, k.n_heads, k.head_dim * std::int64_t(size_of(k.type))),
                    "compaction");
  compact_steps(device_launcher{stream}, status, k, v, tokens.data(), std::int64_t(tokens.size()), keep, kept, ws);
}
}  // namespace detail

void compact(const tensor_view& k, const tensor_view& v, std::span<token> tokens, const_keep_view keep,
             std::int64_t kept, std::span<std::byte> ws, status_word* status, cudaStream_t stream) {
  detail::compact(k, v, tokens, keep, kept, ws, status, stream);
}
void compact(const paged_rows& k, const paged_rows& v, std::span<token> tokens, const_keep_view keep, std::int64_t kept,
             std::span<std::byte> ws, status_word* status, cudaStream_t stream) {
  detail::compact(k, v, tokens, keep, kept, ws, status, stream);
}

std::size_t h2o_scratch_bytes(const layer_shape& shape) {
  return cuda::h2o_scratch_bytes<detail::device_launcher>(shape);
}

namespace detail {
template <row_source R>
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<R>& in, std::span<std::byte> ws,
                 status_word* status, cudaStream_t stream) {
  require_status(status);
  require_workspace(ws, cuda::h2o_scratch_bytes<device_launcher>(shape_of(in)), "h2o_observe");
  h2o_observe_steps(device_launcher{stream}, status, st, cfg, in, ws);
}
}  // namespace detail

void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_tensor_view>& in,
                 std::span<std::byte> ws, status_word* status, cudaStream_t stream) {
  detail::h2o_observe(st, cfg, in, ws, status, stream);
}
void h2o_observe(const h2o_state_view& st, const h2o& cfg, const layer_inputs<const_paged_rows>& in,
                 std::span<std::byte> ws, status_word* status, cudaStream_t stream) {
  detail::h2o_observe(st, cfg, in, ws, status, stream);
}

void h2o_evict(h2o_state_view& st, const_keep_view keep, std::int64_t kept, std::span<std::byte> ws,
               status_word* status, cudaStream_t stream) {
  INFKV_REQUIRE(keep.n_slots == st.n_slots && (keep.n_units == 1 || keep.n_units == st.heads), "keep.n_units",
                keep.n_units, "must be 1 or the state's heads (", st.heads, ") over its ", st.n_slots, " slots");
  INFKV_REQUIRE(kept >= 0 && kept <= st.n_slots, "kept", kept, "must be in [0, n_slots = ", st.n_slots, "]");
  detail::require_status(status);
  detail::require_workspace(ws, compact_scratch_bytes(kept, st.heads, 4), "h2o_evict");
  h2o_state_view next = st;
  h2o_evict_steps(detail::device_launcher{stream}, status, next, keep, kept, ws);
  st = next;
}

void rerotate(const tensor_view& keys, const std::int64_t* delta, const rope& r, const status_word* status,
              cudaStream_t stream) {
  detail::require_status(status);
  rerotate_steps(detail::device_launcher{stream}, status, keys, delta, r);
}
void rerotate(const paged_rows& keys, const std::int64_t* delta, const rope& r, const status_word* status,
              cudaStream_t stream) {
  detail::require_status(status);
  rerotate_steps(detail::device_launcher{stream}, status, keys, delta, r);
}

void quantize_page(const page_layout& layout, const page_rows& in, std::uint8_t* page, status_word* status,
                   cudaStream_t stream) {
  detail::require_status(status);
  detail::require_device(page, "page");
  quantize_page_steps(detail::device_launcher{stream}, status, layout, in, page);
}
void dequantize_page(const page_layout& layout, const std::uint8_t* page, std::int32_t n_tokens, float* keys,
                     float* values, cudaStream_t stream) {
  detail::require_device(page, "page");
  detail::require_device(keys, "keys");
  detail::require_device(values, "values");
  dequantize_page_steps(detail::device_launcher{stream}, layout, page, n_tokens, keys, values);
}
void page_bounds(const archive_shape& shape, const page_layout& layout, const std::uint8_t* const* pages,
                 const std::int32_t* first_layer, const std::int32_t* head, std::int64_t n_pages,
                 const const_tensor_view* queries, float scale, float* scratch, float* out, cudaStream_t stream) {
  INFKV_REQUIRE(n_pages >= 0, "n_pages", n_pages, "must be >= 0");
  if (n_pages == 0) return;
  for (const auto& [p, name] : {std::pair<const void*, const char*>{pages, "pages"},
                                {first_layer, "first_layer"},
                                {queries, "queries"},
                                {scratch, "scratch"},
                                {out, "out"}})
    detail::require_device(p, name);
  page_bounds_steps(detail::device_launcher{stream}, shape, layout, pages, first_layer, head, n_pages, queries, scale,
                    scratch, out);
}

}  // namespace infkv::cuda
