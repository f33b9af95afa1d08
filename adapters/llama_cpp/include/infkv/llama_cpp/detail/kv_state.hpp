// infkv llama.cpp adapter: reading and patching one sequence's state as llama_state_seq_get_data
// writes it, the only public route to the cache's K and V rows. What the session reads (verified
// against the llama.cpp that scripts/llama_cpp.sh builds, and checked field by field here: a
// buffer of any other shape is refused with a clear error, never guessed at):
//
//   u32 magic, i32 seq_id, then one cache's part, or two (llama.cpp's iSWA cache: the global
//   layers' cache, then the sliding layers'), each:
//   u32 n_stream (1), u32 cell_count,
//   per cell: i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]        (no cell extensions: not M-RoPE)
//   cell_count > 0: u32 v_trans, u32 n_layer,
//   per layer: i32 k_type, u64 k_row_bytes, k rows [cell_count]   (a row: [kv_head][head_dim])
//   v_trans = 0: per layer: i32 v_type, u64 v_row_bytes, v rows [cell_count]
//   v_trans = 1: per layer: i32 v_type, u32 v_elem_bytes, u32 n_embd_v, v [n_embd_v][cell_count]
//
// A part's layers are its cache's, in the model's order; the sliding layers' part holds only the
// cells within the window of the sequence's newest position. f32 or f16 rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <llama.h>

#include <infkv/dtype.hpp>
#include <infkv/error.hpp>

namespace infkv::llama_cpp::detail {

/// Where one cache's part of a sequence state (its cells and rows) lies in the buffer.
struct kv_state {
  struct layer {
    dtype k_type = dtype::f16, v_type = dtype::f16;
    std::size_t k_at = 0, v_at = 0;  ///< byte offsets of the layer's K rows and V data
    std::size_t k_row = 0;           ///< bytes of one cell's K row
  };
  std::size_t begin = 0, end = 0;  ///< the part's bytes: [begin, end) of the buffer
  std::int64_t cells = 0;
  std::vector<std::size_t> pos_at;  ///< byte offset of each cell's position (i32)
  bool v_trans = false;
  std::int64_t row_elems = 0;  ///< elements of one cell's K or V row (kv_heads * head_dim)
  std::vector<layer> layers;

  /// Cell c's position in `buf`, the buffer parsed.
  std::int64_t pos(std::span<const std::uint8_t> buf, std::int64_t c) const {
    std::int32_t p;
    std::memcpy(&p, buf.data() + pos_at[std::size_t(c)], sizeof p);
    return p;
  }
  /// Cell c's K row of layer l (row_elems elements of layers[l].k_type).
  std::size_t k_row(std::int32_t l, std::int64_t c) const {
    return layers[std::size_t(l)].k_at + std::size_t(c) * layers[std::size_t(l)].k_row;
  }
  /// Element j of cell c's V row of layer l.
  std::size_t v_elem(std::int32_t l, std::int64_t c, std::int64_t j) const {
    const auto& L = layers[std::size_t(l)];
    const std::size_t el = size_of(L.v_type);
    return v_trans ? L.v_at + (std::size_t(j) * std::size_t(cells) + std::size_t(c)) * el
                   : L.v_at + (std::size_t(c) * std::size_t(row_elems) + std::size_t(j)) * el;
  }
};

namespace kv_state_detail {
template <class T>
T read(std::span<const std::uint8_t> b, std::size_t& at, const char* what) {
  INFKV_REQUIRE(at + sizeof(T) <= b.size(), "llama_state_seq data", b.size(), "ends before its ", what, " (at byte ",
                at, "): not the state layout this infkv reads");
  T v;
  std::memcpy(&v, b.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}
inline dtype type_of(std::int32_t t, const char* what) {
  if (t == GGML_TYPE_F32) return dtype::f32;
  if (t == GGML_TYPE_F16) return dtype::f16;
  infkv::raise<invalid_argument>("infkv: the cache's ", what, " type = ", ggml_type_name(ggml_type(t)),
                                 ": the archive reads and restores f32 or f16 caches only (type_k / type_v)");
}
}  // namespace kv_state_detail

/// Parses one cache's part of a state from byte `at` on (layers of `row_elems`-element rows, at
/// most `max_layers` of them); throws naming the field that differs from the layout above.
inline kv_state parse_kv_part(std::span<const std::uint8_t> b, std::size_t& at, std::int32_t max_layers,
                              std::int64_t row_elems) {
  using kv_state_detail::read;
  kv_state s;
  s.begin = at;
  s.row_elems = row_elems;
  const auto streams = read<std::uint32_t>(b, at, "stream count");
  INFKV_REQUIRE(streams == 1, "llama_state_seq data: n_stream", streams,
                "must be 1 (one unified cache; create the context with kv_unified)");
  s.cells = read<std::uint32_t>(b, at, "cell count");
  for (std::int64_t c = 0; c < s.cells; ++c) {
    s.pos_at.push_back(at);
    read<std::int32_t>(b, at, "cell position");
    const auto n = read<std::uint32_t>(b, at, "cell sequence count");
    INFKV_REQUIRE(n >= 1 && n <= 256, "llama_state_seq data: cell " + std::to_string(c) + " n_seq_id", n,
                  "must be in [1, 256]: not the state layout this infkv reads (cell extensions of M-RoPE models?)");
    at += std::size_t(n) * sizeof(std::int32_t);
  }
  if (s.cells == 0) {
    s.end = at;
    return s;
  }
  s.v_trans = read<std::uint32_t>(b, at, "v_trans") != 0;
  const auto layers = read<std::uint32_t>(b, at, "layer count");
  INFKV_REQUIRE(layers >= 1 && std::int64_t(layers) <= max_layers, "llama_state_seq data: n_layer", layers,
                "must be in [1, ", max_layers, "]: the model has that many layers left for this cache");
  s.layers.resize(layers);
  for (auto& L : s.layers) {
    L.k_type = kv_state_detail::type_of(read<std::int32_t>(b, at, "K type"), "K");
    L.k_row = read<std::uint64_t>(b, at, "K row size");
    INFKV_REQUIRE(L.k_row == std::size_t(row_elems) * size_of(L.k_type), "llama_state_seq data: K row bytes", L.k_row,
                  "must be ", row_elems, " elements of ", to_string(L.k_type));
    L.k_at = at;
    at += std::size_t(s.cells) * L.k_row;
  }
  for (auto& L : s.layers) {
    L.v_type = kv_state_detail::type_of(read<std::int32_t>(b, at, "V type"), "V");
    if (!s.v_trans) {
      const auto row = read<std::uint64_t>(b, at, "V row size");
      INFKV_REQUIRE(row == std::size_t(row_elems) * size_of(L.v_type), "llama_state_seq data: V row bytes", row,
                    "must be ", row_elems, " elements of ", to_string(L.v_type));
    } else {
      const auto el = read<std::uint32_t>(b, at, "V element size");
      const auto embd = read<std::uint32_t>(b, at, "V width");
      INFKV_REQUIRE(el == size_of(L.v_type) && std::int64_t(embd) == row_elems, "llama_state_seq data: V width", embd,
                    "must be ", row_elems, " elements of ", size_of(L.v_type), " bytes (element size ", el, ")");
    }
    L.v_at = at;
    at += std::size_t(s.cells) * std::size_t(row_elems) * size_of(L.v_type);
  }
  INFKV_REQUIRE(at <= b.size(), "llama_state_seq data", b.size(), "bytes; its layers' rows end at ", at,
                ": not the state layout this infkv reads");
  s.end = at;
  return s;
}

/// Parses a state buffer of a model of `n_layers` layers of `row_elems`-element rows: one part
/// (one cache), or two (`two_caches`: llama.cpp's iSWA cache, the global layers' part first).
/// Throws naming the field that differs from the layout above.
inline std::vector<kv_state> parse_kv_states(std::span<const std::uint8_t> b, std::int32_t n_layers,
                                             std::int64_t row_elems, bool two_caches) {
  using kv_state_detail::read;
  std::size_t at = 0;
  read<std::uint32_t>(b, at, "magic");
  read<std::int32_t>(b, at, "sequence id");
  std::vector<kv_state> parts;
  parts.push_back(parse_kv_part(b, at, n_layers - (two_caches ? 1 : 0), row_elems));
  if (two_caches) {
    const std::int32_t first = std::int32_t(parts[0].layers.size());
    parts.push_back(parse_kv_part(b, at, n_layers - std::max(first, 1), row_elems));
    const std::int32_t second = std::int32_t(parts[1].layers.size());
    INFKV_REQUIRE(parts[0].cells == 0 || parts[1].cells == 0 || first + second == n_layers,
                  "llama_state_seq data: n_layer", first, "and ", second, " in its two caches; the model has ",
                  n_layers, " layers");
  } else {
    INFKV_REQUIRE(parts[0].cells == 0 || std::int64_t(parts[0].layers.size()) == n_layers,
                  "llama_state_seq data: n_layer", parts[0].layers.size(), "the model has ", n_layers, " layers");
  }
  INFKV_REQUIRE(at == b.size(), "llama_state_seq data", b.size(), "bytes; the layout read ends at ", at,
                two_caches ? ": not the two caches' state layout this infkv reads"
                           : ": not the state layout this infkv reads (a model with sliding-window layers?)");
  return parts;
}

/// Parses the state of a model with one cache (parse_kv_states).
inline kv_state parse_kv_state(std::span<const std::uint8_t> b, std::int32_t n_layers, std::int64_t row_elems) {
  return std::move(parse_kv_states(b, n_layers, row_elems, false)[0]);
}

}  // namespace infkv::llama_cpp::detail
