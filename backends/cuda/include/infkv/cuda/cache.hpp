// infkv CUDA backend: what an engine names around the cache steps: H2O's state on a device and
// the scratch a compaction needs. Plain C++: no CUDA header.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <infkv/scores.hpp>
#include <infkv/tokens.hpp>

namespace infkv::cuda {

/// H2O's state on a device: accumulated mass, lifetime (queries that could see the slot) and the
/// score the pipeline reads (`layer_inputs::accumulated = scores`), each [heads][n_slots] with row
/// stride `ld` (>= n_slots: room to append). Memory of the caller.
struct h2o_state_view {
  float* acc = nullptr;
  float* life = nullptr;
  float* score = nullptr;
  std::int32_t heads = 0;
  std::int64_t n_slots = 0;
  std::int64_t ld = 0;
  score_view scores() const { return {score, heads, n_slots, ld}; }
};

/// The most scratch a compaction stages K and V rows in, whatever the cache's size (unless one
/// slot's K and V rows alone are larger): the kept rows move in chunks of at most this many bytes
/// (one chunk for 8,192 kept slots of 8 heads of 128 f16 elements), and the token lists in chunks
/// of at most a sixteenth of it.
inline constexpr std::int64_t compact_scratch_limit = std::int64_t(32) << 20;

namespace detail {

/// How a compaction is cut: slots of K and V (every head) per chunk, token entries per chunk.
/// The scratch holds one chunk of each: K and V rows first, then (16-byte aligned) token entries.
struct compact_chunks {
  std::int64_t slots, tokens;
  static compact_chunks of(std::int64_t kept, std::int32_t heads, std::int64_t row_bytes, std::int64_t limit) {
    const std::int64_t per_slot = 2 * std::int64_t(heads) * std::max<std::int64_t>(row_bytes, 1),
                       most = std::max<std::int64_t>(kept, 1);
    return {std::clamp<std::int64_t>(limit / per_slot, 1, most),
            std::clamp<std::int64_t>(limit / 16 / std::int64_t(sizeof(token)), 1, most * heads)};
  }
  /// Where the token entries start.
  std::size_t token_offset(std::int32_t heads, std::int64_t row_bytes) const {
    return (std::size_t(2 * slots * heads * row_bytes) + 15) / 16 * 16;
  }
  std::size_t bytes(std::int32_t heads, std::int64_t row_bytes) const {
    return token_offset(heads, row_bytes) + std::size_t(tokens) * sizeof(token);
  }
};

}  // namespace detail

/// Scratch a compaction of `kept` slots of `heads` heads of `row_bytes` (K and V) needs: at most
/// `limit` and a sixteenth (or one slot's K and V rows) whatever the cache's size. (A smaller
/// limit than the library's cuts the move into more chunks: the tests use one.)
inline std::size_t compact_scratch_bytes(std::int64_t kept, std::int32_t heads, std::int64_t row_bytes,
                                         std::int64_t limit = compact_scratch_limit) {
  return detail::compact_chunks::of(kept, heads, row_bytes, limit).bytes(heads, row_bytes);
}

}  // namespace infkv::cuda
