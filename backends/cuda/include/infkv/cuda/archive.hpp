// infkv CUDA backend: the archive's steps on a device (the format is the core's,
// infkv/archive.hpp; the host steps are cpu/archive.hpp). Quantizing a page's rows into the
// archive's page layout, dequantizing a page, and bounding pages' logits for a set of queries,
// each queued on a stream as kernels that write exactly the CPU's bytes and values (the steps,
// cuda/detail/archive_steps.hpp, are tested on the host against cpu::archive_evicted,
// cpu::dequantize and cpu::page_bounds). Plain C++: no CUDA header beyond the runtime API's.
#pragma once

#include <cstdint>

#include <infkv/archive.hpp>

#include "backend.hpp"

namespace infkv::cuda {

/// One page's rows as the steps read them: `rows` (layer, head) rows of `n_tokens` tokens, row
/// r's keys (and values) of token t at keys[r] (values[r]) + t * row_stride elements, each
/// head_dim elements of `type` (the pointer arrays and the rows in device memory).
struct page_rows {
  const void* const* keys = nullptr;    ///< per row: its first token's key row
  const void* const* values = nullptr;  ///< per row: its first token's value row
  dtype type = dtype::f32;
  std::int64_t row_stride = 0;  ///< elements from a token's row to the next token's
  std::int32_t n_tokens = 0;
};

/// Quantizes `in` into `page` (layout.bytes bytes of device memory). An element not finite or
/// beyond f16's range records fault::not_archivable (the page is then unspecified).
void quantize_page(const page_layout& layout, const page_rows& in, std::uint8_t* page, status_word* status,
                   cudaStream_t stream);
/// Dequantizes the n_tokens tokens of every row of `page`: keys[(r * n_tokens + t) * head_dim +
/// c], values alike, f32 device arrays.
void dequantize_page(const page_layout& layout, const std::uint8_t* page, std::int32_t n_tokens, float* keys,
                     float* values, cudaStream_t stream);
/// Per page p of `n_pages` (device arrays: pages[p] its bytes, first_layer[p] its first layer,
/// head[p] its KV head for per_head pages), the upper bound on its logits for `queries` (a device
/// array of one view per archive layer) into out[p], as cpu::page_bounds; `scratch`: n_pages *
/// layers_per_page floats of device memory.
void page_bounds(const archive_shape& shape, const page_layout& layout, const std::uint8_t* const* pages,
                 const std::int32_t* first_layer, const std::int32_t* head, std::int64_t n_pages,
                 const const_tensor_view* queries, float scale, float* scratch, float* out, cudaStream_t stream);

}  // namespace infkv::cuda
