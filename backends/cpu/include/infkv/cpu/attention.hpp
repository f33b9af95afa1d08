// infkv CPU backend: attention recomputed from Q and K (so policies work with flash attention
// on): per-key probability mass from a window of queries, and attention outputs.
// Logits are a small GEMM per KV head: keys converted to f32 a tile at a time and transposed,
// then a register-blocked micro-kernel (4 query rows x 24 keys, plain loops that compilers
// vectorise) over all query rows. window_attention's softmax runs in two passes over the tiles
// (row max and normaliser, then normalised sums), keeping memory bounded for any cache length.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <infkv/kv_view.hpp>
#include <infkv/policy.hpp>
#include <infkv/scores.hpp>
#include <infkv/tokens.hpp>

#include "executor.hpp"
#include "kernels.hpp"

namespace infkv::cpu {

namespace detail {

/// Per worker, tiles of probabilities up to this size are kept between the two softmax passes;
/// tiles beyond it are recomputed, so memory stays bounded for any number of slots.
inline constexpr std::int64_t prob_cache_bytes = std::int64_t(16) << 20;

/// Splits `buf` into 64-byte-aligned blocks of the given float counts (uninitialised), so vector
/// loads in the GEMM never straddle cache lines; returns their addresses.
template <std::size_t N>
std::array<float*, N> carve(std::unique_ptr<float[]>& buf, const std::array<std::int64_t, N>& sizes) {
  const auto round = [](std::int64_t n) { return std::size_t((n + 15) / 16 * 16); };
  std::size_t total = 16;
  for (auto n : sizes) total += round(n);
  buf.reset(new float[total]);
  void* start = buf.get();
  std::size_t space = total * sizeof(float);
  auto* p = static_cast<float*>(std::align(64, (total - 16) * sizeof(float), start, space));
  std::array<float*, N> out{};
  for (std::size_t i = 0; i < N; ++i) {
    out[i] = p;
    p += round(sizes[i]);
  }
  return out;
}

/// Checks the queries/keys/tokens of `in` against each other.
template <row_source R>
void check_attention_inputs(const layer_inputs<R>& in) {
  validate(in.keys, "keys");
  validate(in.queries, "queries");
  validate_tokens(in.tokens, in.keys.n_slots);
  infkv::detail::require(in.queries.head_dim == in.keys.head_dim, "queries.head_dim", in.queries.head_dim,
                         "must equal keys.head_dim (", in.keys.head_dim, ")");
  infkv::detail::require(in.queries.n_heads % in.keys.n_heads == 0, "queries.n_heads", in.queries.n_heads,
                         "must be a multiple of keys.n_heads (", in.keys.n_heads, ")");
  infkv::detail::require(std::int64_t(in.query_pos.size()) == in.queries.n_slots, "query_pos.size()",
                         in.query_pos.size(), "must equal the number of queries (", in.queries.n_slots, ")");
  infkv::detail::require(in.queries.n_slots >= 1, "queries.n_slots", in.queries.n_slots, "needs at least one query");
  infkv::detail::require(std::isfinite(in.scale) && in.scale >= 0.f, "scale", in.scale, "must be finite and >= 0");
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
}

/// Logits out[r * key_tile + j] (r < rows, j < tn rounded up to kernel_keys) of f32 query rows
/// q[rows][d] (rows a multiple of kernel_rows) against a transposed key tile.
inline void tile_logits(const float* q, std::int64_t rows, std::int64_t d, const float* kt, std::int64_t tn,
                        float scale, float* out) {
  for (std::int64_t c0 = 0; c0 < tn; c0 += kernel_keys)  // one key strip stays in L1 over all rows
    for (std::int64_t r0 = 0; r0 < rows; r0 += kernel_rows)
      dot_block(q + r0 * d, d, kt + c0, scale, out + r0 * key_tile + c0, key_tile);
}

/// Queries of KV head `h`'s group as f32 [G * n_q][d], query-major within each head.
inline std::vector<float> group_queries(const tensor_view& q, std::int32_t kv_head, std::int32_t group) {
  const std::int64_t d = q.head_dim, n_q = q.n_slots;
  std::vector<float> out(static_cast<std::size_t>(group * n_q * d));
  for (std::int32_t g = 0; g < group; ++g)
    for (std::int64_t i = 0; i < n_q; ++i)
      to_f32(q.type, q.row(i, kv_head * group + g), out.data() + (g * n_q + i) * d, d);
  return out;
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
      for (std::int64_t j = 0; j < tn; ++j) x[j] = exp_nonpos(x[j] - mx);
      s[r] = sum_of(x, nullptr, tn);
    }
  }
};

/// The softmax of KV head `h`'s query rows (r = g * n_q + i) over all keys, a key tile at a
/// time: calls use(t0, tn, e, c) for each tile, where the probability of key t0 + j for row r is
/// c[r] * e[r * key_tile + j] (rows that see no key have c[r] = 0). Two passes over the tiles: the
/// first finds each row's max and normaliser, the second hands out the tiles, kept from the first
/// pass up to prob_cache_bytes and recomputed beyond, so memory stays bounded for any length.
template <row_source R, class F>
void softmax_tiles(const layer_inputs<R>& in, std::int32_t h, std::int32_t group, float scale, F&& use) {
  const std::int64_t d = in.keys.head_dim, n = in.keys.n_slots, rows = group * in.queries.n_slots;
  const std::int64_t padded = (rows + kernel_rows - 1) / kernel_rows * kernel_rows;
  const std::int64_t n_tiles = (n + key_tile - 1) / key_tile, tile_floats = padded * key_tile;
  const std::int64_t cached = std::min(n_tiles, prob_cache_bytes / (tile_floats * std::int64_t(sizeof(float))));
  std::unique_ptr<float[]> work;
  const auto buf = carve<5>(work, {padded * d, d * key_tile, 8 * d, cached * tile_floats, tile_floats});
  const auto qg = group_queries(in.queries, h, group);
  std::fill(std::copy(qg.begin(), qg.end(), buf[0]), buf[0] + padded * d, 0.f);  // padding rows: 0
  std::fill(buf[1], buf[1] + d * key_tile, 0.f);  // key columns past a short last tile stay 0
  const tile_softmax<R> tile{in, h, rows, padded, scale, buf[0], buf[1], buf[2]};
  float *const cache = buf[3], *const scratch = buf[4];
  std::vector<float> tmax(static_cast<std::size_t>(n_tiles * rows)), tsum(tmax.size());
  for (std::int64_t t = 0; t < n_tiles; ++t)
    tile(t * key_tile, std::min(key_tile, n - t * key_tile), t < cached ? cache + t * tile_floats : scratch,
         tmax.data() + t * rows, tsum.data() + t * rows);
  // Row max and normaliser over all tiles; tmax becomes each tile's row coefficients.
  for (std::int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (std::int64_t t = 0; t < n_tiles; ++t) mx = std::max(mx, tmax[std::size_t(t * rows + r)]);
    for (std::int64_t t = 0; t < n_tiles; ++t) {
      const auto i = std::size_t(t * rows + r);
      if (tsum[i] > 0.f) sum += tsum[i] * std::exp(tmax[i] - mx);
    }
    for (std::int64_t t = 0; t < n_tiles; ++t) {
      const auto i = std::size_t(t * rows + r);
      tmax[i] = tsum[i] > 0.f ? std::exp(tmax[i] - mx) / sum : 0.f;
    }
  }
  std::vector<float> unused(static_cast<std::size_t>(2 * rows));
  for (std::int64_t t = 0; t < n_tiles; ++t) {
    const std::int64_t t0 = t * key_tile, tn = std::min(key_tile, n - t0);
    float* e = t < cached ? cache + t * tile_floats : scratch;
    if (t >= cached) tile(t0, tn, e, unused.data(), unused.data() + rows);
    use(t0, tn, static_cast<const float*>(e), static_cast<const float*>(tmax.data() + t * rows));
  }
}

}  // namespace detail

/// Attention mass each cached key receives from the window: per KV head h and slot j, the sum
/// over queries of softmax probability (visible keys only), averaged over the G query heads of
/// h. Result [Hkv][n_slots]. Cost O(Hq * n_q * n * d); parallel over KV heads.
template <row_source R>
score_matrix window_attention(const layer_inputs<R>& in, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv;
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  score_matrix out(hkv, in.keys.n_slots);
  parallel_for(ex, hkv, [&](std::int64_t h) {
    const auto row = out.row(h);
    const std::int64_t rows = group * in.queries.n_slots;
    detail::softmax_tiles(in, std::int32_t(h), group, scale, [&](std::int64_t t0, std::int64_t tn, const float* e,
                                                                 const float* c) {
      float* col = row.data() + t0;
      for (std::int64_t r = 0; r < rows; ++r) {
        const float cr = c[r];  // a local, so the loop below vectorises
        if (cr == 0.f) continue;
        const float* x = e + r * detail::key_tile;
        for (std::int64_t j = 0; j < tn; ++j) col[j] = detail::fmadd(cr, x[j], col[j]);
      }
    });
    for (auto& v : row) v /= float(group);
  });
  return out;
}

/// Per slot, how many of the queries can see it (tokens[j].pos <= query_pos[i]).
inline std::vector<std::int64_t> visible_counts(std::span<const std::int64_t> query_pos, std::span<const token> tokens) {
  std::vector<std::int64_t> seen(tokens.size(), 0);
  for (std::size_t j = 0; j < tokens.size(); ++j)
    for (auto qp : query_pos) seen[j] += tokens[j].pos <= qp ? 1 : 0;
  return seen;
}

/// Attention outputs [n_q][Hq][d] (f32) of the queries over the cached keys and values.
template <row_source R>
std::vector<float> attention_output(const layer_inputs<R>& in, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  validate(in.values, "values");
  infkv::detail::require(in.values.n_slots == in.keys.n_slots && in.values.n_heads == in.keys.n_heads,
                         "values.n_slots", in.values.n_slots, "values must match keys (", in.keys.n_slots, " slots, ",
                         in.keys.n_heads, " heads); values.n_heads = ", in.values.n_heads);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv, dv = in.values.head_dim;
  const std::int64_t n_q = in.queries.n_slots;
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  std::vector<float> out(static_cast<std::size_t>(n_q * in.queries.n_heads * dv), 0.f);
  parallel_for(ex, hkv, [&](std::int64_t h) {
    std::vector<float> v(static_cast<std::size_t>(detail::key_tile * dv));  // the tile's values, f32
    detail::softmax_tiles(in, std::int32_t(h), group, scale, [&](std::int64_t t0, std::int64_t tn, const float* e,
                                                                 const float* c) {
      for (std::int64_t j = 0; j < tn; ++j)
        to_f32(in.values.type, in.values.row(t0 + j, std::int32_t(h)), v.data() + j * dv, dv);
      for (std::int64_t r = 0; r < group * n_q; ++r) {
        const float cr = c[r];
        if (cr == 0.f) continue;
        float* o = out.data() + ((r % n_q) * in.queries.n_heads + h * group + r / n_q) * dv;
        for (std::int64_t j = 0; j < tn; ++j) {
          const float w = cr * e[r * detail::key_tile + j];
          if (w == 0.f) continue;
          for (std::int32_t k = 0; k < dv; ++k) o[k] = detail::fmadd(w, v[std::size_t(j * dv + k)], o[k]);
        }
      }
    });
  });
  return out;
}

}  // namespace infkv::cpu
