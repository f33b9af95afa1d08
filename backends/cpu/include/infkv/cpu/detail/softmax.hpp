// infkv CPU backend internals: the softmax of recomputed attention, a key tile at a time. Keys
// are converted to f32 a tile at a time and transposed, a register-blocked micro-kernel (4 query
// rows x 24 keys) computes the logits of all query rows, and the softmax runs in two passes over
// the tiles (row max and normaliser, then the probabilities), keeping memory bounded for any cache
// length. Also the input checks every attention-reading source shares.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include <infkv/detail/carver.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/policy.hpp>
#include <infkv/tokens.hpp>

#include "kernels.hpp"

namespace infkv::cpu::detail {

/// Per worker, tiles of probabilities up to this size are kept between the two softmax passes;
/// tiles beyond it are recomputed, so memory stays bounded for any number of slots.
inline constexpr std::int64_t prob_cache_bytes = std::int64_t(16) << 20;

/// The pieces of one worker's softmax scratch over `rows` query rows, head_dim d and n keys:
/// queries, transposed key tile, 8 converted rows, kept tiles, one more tile, per-tile maxima
/// and sums, and two throwaway rows.
struct softmax_layout {
  std::int64_t rows, padded, n_tiles, tile_floats, cached, d;
  softmax_layout(std::int64_t rows_, std::int64_t d_, std::int64_t n)
      : rows(rows_),
        padded((rows_ + kernel_rows - 1) / kernel_rows * kernel_rows),
        n_tiles((n + key_tile - 1) / key_tile),
        tile_floats(padded * key_tile),
        cached(std::min(n_tiles, prob_cache_bytes / (tile_floats * std::int64_t(sizeof(float))))),
        d(d_) {}

  struct pieces {
    float *q, *kt, *rows8, *cache, *spare, *tmax, *tsum, *unused;
  };
  pieces carve(infkv::detail::carver& c) const {
    return {c.take<float>(padded * d),           c.take<float>(d * key_tile), c.take<float>(8 * d),
            c.take<float>(cached * tile_floats), c.take<float>(tile_floats),  c.take<float>(n_tiles * rows),
            c.take<float>(n_tiles * rows),       c.take<float>(2 * rows)};
  }
  std::size_t bytes() const {
    return infkv::detail::bytes_of([&](infkv::detail::carver& c) { carve(c); });
  }
};

/// Bytes of scratch each worker of window_attention_into needs for G x n_q query rows of
/// head_dim d against n keys (a multiple of 64).
inline std::size_t window_scratch_bytes(std::int64_t group, std::int64_t n_q, std::int64_t d, std::int64_t n) {
  return softmax_layout(group * n_q, d, n).bytes();
}
template <row_source R>
std::size_t window_scratch_bytes(const layer_inputs<R>& in) {
  return window_scratch_bytes(in.queries.n_heads / in.keys.n_heads, in.queries.n_slots, in.keys.head_dim,
                              in.keys.n_slots);
}

/// Throws naming the first non-finite element of `t`'s rows [first, first + count) of `head`.
template <row_source R>
[[noreturn]] void fail_not_finite(const R& t, const char* name, std::int64_t first, std::int64_t count,
                                  std::int32_t head) {
  std::vector<float> x(static_cast<std::size_t>(t.head_dim));
  for (std::int64_t j = first; j < first + count; ++j) {
    to_f32(t.type, t.row(j, head), x.data(), t.head_dim);
    for (std::int32_t e = 0; e < t.head_dim; ++e)
      if (!std::isfinite(x[std::size_t(e)]))
        infkv::fail("infkv: ", name, "[slot ", j, ", head ", head, "][", e, "] = ", x[std::size_t(e)], ": ", name,
                    " must be finite (a NaN or Inf would silently distort every score of the layer)");
  }
  infkv::fail("infkv: ", name, ": a non-finite element in slots [", first, ", ", first + count, ") of head ", head);
}

/// Throws naming the first non-finite element of query i of `head` in `q`, a window cut from a
/// longer query view after its first `first` queries (named as the caller counts them).
[[noreturn]] inline void fail_query_not_finite(const const_tensor_view& q, std::int64_t first, std::int64_t i,
                                               std::int32_t head) {
  const_tensor_view all = q;
  all.data = q.row(-first, 0);
  all.n_slots += first;
  fail_not_finite(all, "queries", first + i, 1, head);
}

/// Checks the queries/keys/tokens of `in` against each other.
template <row_source R>
void check_attention_inputs(const layer_inputs<R>& in) {
  check_query_inputs(in);
  validate_tokens(in.tokens, in.keys.n_slots);
}

/// Keys [t0, t0 + tn) of `head` (tn <= key_tile) as f32, transposed: kt[e * key_tile + j].
/// `rows` holds 8 * head_dim floats of scratch.
template <row_source R>
void load_key_tile(const R& keys, std::int32_t head, std::int64_t t0, std::int64_t tn, float* kt, float* rows) {
  const std::int64_t d = keys.head_dim;
  std::int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= tn; j += 8) {  // eight keys at a time, 8 x 8 blocks transposed in registers
    const float* src[8];
    for (int i = 0; i < 8; ++i) {  // f32 rows are read in place, others converted first
      const void* p = keys.row(t0 + j + i, head);
      if (keys.type != dtype::f32) to_f32(keys.type, p, rows + i * d, d);
      src[i] = keys.type == dtype::f32 ? static_cast<const float*>(p) : rows + i * d;
    }
    std::int64_t e = 0;
    for (; e + 8 <= d; e += 8) transpose8(src, e, kt + e * key_tile + j, key_tile);
    for (; e < d; ++e)
      for (int i = 0; i < 8; ++i) kt[e * key_tile + j + i] = src[i][e];
  }
#endif
  for (; j < tn; ++j) {
    to_f32(keys.type, keys.row(t0 + j, head), rows, d);
    for (std::int64_t e = 0; e < d; ++e) kt[e * key_tile + j] = rows[e];
  }
  bool finite = true;  // one NaN or Inf key would zero or poison the whole tile's softmax
  for (std::int64_t e = 0; e < d; ++e) finite &= all_finite(kt + e * key_tile, tn);
  if (!finite) [[unlikely]]
    fail_not_finite(keys, "keys", t0, tn, head);
}

/// Logits out[r * key_tile + j] (r < rows, j < tn rounded up to kernel_keys) of f32 query rows
/// q[rows][d] (rows a multiple of kernel_rows) against a transposed key tile.
inline void tile_logits(const float* q, std::int64_t rows, std::int64_t d, const float* kt, std::int64_t tn,
                        float scale, float* out) {
  for (std::int64_t c0 = 0; c0 < tn; c0 += kernel_keys)  // one key strip stays in L1 over all rows
    for (std::int64_t r0 = 0; r0 < rows; r0 += kernel_rows)
      dot_block(q + r0 * d, d, kt + c0, scale, out + r0 * key_tile + c0, key_tile);
}

/// Queries of KV head `h`'s group as f32 [G * n_q][d] into `out`, query-major within each head;
/// a NaN or Inf raises naming the query (counted from `first`, the queries dropped before the
/// view) and head.
inline void group_queries(const const_tensor_view& q, std::int32_t kv_head, std::int32_t group, std::int64_t first,
                          float* out) {
  const std::int64_t d = q.head_dim, n_q = q.n_slots;
  for (std::int32_t g = 0; g < group; ++g)
    for (std::int64_t i = 0; i < n_q; ++i) {
      float* row = out + (g * n_q + i) * d;
      to_f32(q.type, q.row(i, kv_head * group + g), row, d);
      if (!all_finite(row, d)) [[unlikely]]
        fail_query_not_finite(q, first, i, kv_head * group + g);
    }
}

inline float effective_scale(float scale, std::int32_t head_dim) {
  return scale > 0.f ? scale : 1.f / std::sqrt(float(head_dim));
}

/// Softmax pieces of one key tile for every query row of one KV head: masked logits turned into
/// e[r][j] = exp(l[r][j] - m[r]) with m[r] the row's largest visible logit in the tile (-inf and
/// e = 0 when it sees none) and s[r] = sum_j e[r][j]. Deterministic, so a tile recomputed in the
/// second pass equals the first.
template <row_source R>
struct tile_softmax {
  const layer_inputs<R>& in;
  std::int32_t head;
  std::int64_t rows, padded;  // group * n_q query rows; rounded up to kernel_rows
  float scale;
  float* q;      // [padded][d]
  float* kt;     // [d][key_tile]
  float* rows8;  // [8][d] scratch

  void operator()(std::int64_t t0, std::int64_t tn, float* e, float* m, float* s) const {
    const std::int64_t n_q = in.queries.n_slots;
    load_key_tile(in.keys, head, t0, tn, kt, rows8);
    tile_logits(q, padded, in.keys.head_dim, kt, tn, scale, e);
    std::int64_t newest = std::numeric_limits<std::int64_t>::min();
    for (std::int64_t j = 0; j < tn; ++j) newest = std::max(newest, in.tokens[std::size_t(t0 + j)].pos);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* x = e + r * key_tile;
      const std::int64_t qp = in.query_pos[std::size_t(r % n_q)];
      if (newest > qp)  // some keys of the tile are in this query's future
        for (std::int64_t j = 0; j < tn; ++j)
          if (in.tokens[std::size_t(t0 + j)].pos > qp) x[j] = -std::numeric_limits<float>::infinity();
      const float mx = m[r] = max_of(x, tn);
      if (mx == -std::numeric_limits<float>::infinity()) {
        std::fill(x, x + tn, 0.f);
        s[r] = 0.f;
        continue;
      }
      exp_shifted(x, tn, mx);
      s[r] = sum_of(x, nullptr, tn);
    }
  }
};

/// The softmax of KV head `h`'s query rows (r = g * n_q + i) over all keys, a key tile at a
/// time: calls use(t0, tn, e, c) for each tile, where the probability of key t0 + j for row r is
/// c[r] * e[r * key_tile + j] (rows that see no key have c[r] = 0). Two passes over the tiles: the
/// first finds each row's max and normaliser, the second hands out the tiles, kept from the first
/// pass up to prob_cache_bytes and recomputed beyond, so memory stays bounded for any length.
/// `work` is 64-byte aligned and holds softmax_layout(group * n_q, d, n).bytes() bytes.
template <row_source R, class F>
void softmax_tiles(const layer_inputs<R>& in, std::int32_t h, std::int32_t group, float scale, std::int64_t first_query,
                   std::byte* work, F&& use) {
  const std::int64_t d = in.keys.head_dim, n = in.keys.n_slots, rows = group * in.queries.n_slots;
  const softmax_layout lay(rows, d, n);
  const std::int64_t padded = lay.padded, n_tiles = lay.n_tiles, tile_floats = lay.tile_floats, cached = lay.cached;
  infkv::detail::carver c{work};
  const auto w = lay.carve(c);
  float *const qbuf = w.q, *const kt = w.kt, *const rows8 = w.rows8, *const cache = w.cache, *const scratch = w.spare;
  float *const tmax = w.tmax, *const tsum = w.tsum, *const unused = w.unused;
  group_queries(in.queries, h, group, first_query, qbuf);
  std::fill(qbuf + rows * d, qbuf + padded * d, 0.f);  // padding rows: 0
  std::fill(kt, kt + d * key_tile, 0.f);               // key columns past a short last tile stay 0
  const tile_softmax<R> tile{in, h, rows, padded, scale, qbuf, kt, rows8};
  for (std::int64_t t = 0; t < n_tiles; ++t)
    tile(t * key_tile, std::min(key_tile, n - t * key_tile), t < cached ? cache + t * tile_floats : scratch,
         tmax + t * rows, tsum + t * rows);
  // Row max and normaliser over all tiles; tmax becomes each tile's row coefficients.
  for (std::int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (std::int64_t t = 0; t < n_tiles; ++t) mx = std::max(mx, tmax[t * rows + r]);
    for (std::int64_t t = 0; t < n_tiles; ++t) {
      const std::int64_t i = t * rows + r;
      if (tsum[i] > 0.f) sum += tsum[i] * std::exp(tmax[i] - mx);
    }
    for (std::int64_t t = 0; t < n_tiles; ++t) {
      const std::int64_t i = t * rows + r;
      tmax[i] = tsum[i] > 0.f ? std::exp(tmax[i] - mx) / sum : 0.f;
    }
  }
  for (std::int64_t t = 0; t < n_tiles; ++t) {
    const std::int64_t t0 = t * key_tile, tn = std::min(key_tile, n - t0);
    float* e = t < cached ? cache + t * tile_floats : scratch;
    if (t >= cached) tile(t0, tn, e, unused, unused + rows);
    use(t0, tn, static_cast<const float*>(e), static_cast<const float*>(tmax + t * rows));
  }
}

}  // namespace infkv::cpu::detail
