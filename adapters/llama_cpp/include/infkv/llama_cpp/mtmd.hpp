// infkv llama.cpp adapter: the pieces of llama.cpp's multimodal library (mtmd) that feeding its
// chunks to `prefill` needs: owning handles, and the positions of an image chunk's rows on an
// M-RoPE model in llama_batch.pos's layout. Needs mtmd.h and mtmd-helper.h (llama.cpp's tools/mtmd,
// installed next to llama.cpp by scripts/llama_cpp.sh; CMake target infkv_mtmd); not included by
// infkv/llama_cpp.hpp.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <mtmd-helper.h>
#include <mtmd.h>

#include <infkv/error.hpp>

namespace infkv::llama_cpp::mtmd {

struct context_deleter {
  void operator()(mtmd_context* c) const { mtmd_free(c); }
};
struct chunks_deleter {
  void operator()(mtmd_input_chunks* c) const { mtmd_input_chunks_free(c); }
};
struct bitmap_deleter {
  void operator()(mtmd_bitmap* b) const { mtmd_bitmap_free(b); }
};
struct video_deleter {
  void operator()(mtmd_helper_video* v) const { mtmd_helper_video_free(v); }
};
/// Owning handle of an mtmd_context.
using context_ptr = std::unique_ptr<mtmd_context, context_deleter>;
/// Owning handle of mtmd_input_chunks.
using chunks_ptr = std::unique_ptr<mtmd_input_chunks, chunks_deleter>;
/// Owning handle of an mtmd_bitmap.
using bitmap_ptr = std::unique_ptr<mtmd_bitmap, bitmap_deleter>;
/// Owning handle of an mtmd_helper_video.
using video_ptr = std::unique_ptr<mtmd_helper_video, video_deleter>;

/// The positions of image chunk `c`'s rows on an M-RoPE model when the chunk starts at stream
/// position `n_past`: mtmd's decoder positions (one t for every row, x and y on the image's grid),
/// section-major as llama_batch.pos and `chunk::positions` want them (every row's t, then y, then
/// x, then z), 4 * mtmd_input_chunk_get_n_tokens(c) entries. Pass them with
/// `n_pos = mtmd_input_chunk_get_n_pos(c)`, the stream positions the image takes.
inline std::vector<llama_pos> image_positions(const mtmd_input_chunk* c, llama_pos n_past) {
  INFKV_REQUIRE(c != nullptr && mtmd_input_chunk_get_type(c) == MTMD_INPUT_CHUNK_TYPE_IMAGE, "chunk",
                c == nullptr ? "null" : "not an image", "needs an image chunk");
  INFKV_REQUIRE(n_past >= 0, "n_past", n_past, "must be >= 0");
  const auto n = std::size_t(mtmd_input_chunk_get_n_tokens(c));
  std::vector<mtmd_decoder_pos> dp(n);
  mtmd_helper_image_get_decoder_pos(mtmd_input_chunk_get_tokens_image(c), n_past, dp.data());
  std::vector<llama_pos> p(4 * n);
  for (std::size_t r = 0; r < n; ++r) {
    p[r] = llama_pos(dp[r].t), p[n + r] = llama_pos(dp[r].y);
    p[2 * n + r] = llama_pos(dp[r].x), p[3 * n + r] = llama_pos(dp[r].z);
  }
  return p;
}

}  // namespace infkv::llama_cpp::mtmd
