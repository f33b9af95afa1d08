// infkv CPU backend: attention recomputed from Q and K (so policies work with flash attention
// on): per-key probability mass from a window of queries, and attention outputs.
// Logits are a small GEMM per KV head (keys converted to f32 in tiles, transposed so the inner
// loop is a plain multiply-add over 64 keys that compilers vectorise); softmax in f32 with the
// row max and sum computed first.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <infkv/kv_view.hpp>
#include <infkv/policy.hpp>
#include <infkv/scores.hpp>
#include <infkv/tokens.hpp>

#include "executor.hpp"

namespace infkv::cpu {

namespace detail {

inline constexpr std::int64_t key_tile = 64;

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

/// Logits of `n_q` f32 queries (rows of q, stride d) against keys [begin, begin + len) of
/// `head`, into out[q * len + j]. Keys of other dtypes are converted tile by tile.
template <row_source R>
void logits(const float* q, std::int64_t n_q, const R& keys, std::int32_t head, std::int64_t begin,
            std::int64_t len, float scale, float* out, std::vector<float>& tile) {
  const std::int64_t d = keys.head_dim;
  tile.resize(std::size_t(d * key_tile + d));
  float* kt = tile.data();          // [d][key_tile], transposed
  float* row = kt + d * key_tile;   // one converted row
  for (std::int64_t t0 = 0; t0 < len; t0 += key_tile) {
    const std::int64_t tn = std::min(key_tile, len - t0);
    for (std::int64_t j = 0; j < tn; ++j) {
      to_f32(keys.type, keys.row(begin + t0 + j, head), row, d);
      for (std::int64_t e = 0; e < d; ++e) kt[e * key_tile + j] = row[e];
    }
    for (std::int64_t i = 0; i < n_q; ++i) {
      float acc[key_tile] = {};
      const float* qi = q + i * d;
      for (std::int64_t e = 0; e < d; ++e) {
        const float qe = qi[e];
        const float* ke = kt + e * key_tile;
        for (std::int64_t j = 0; j < key_tile; ++j) acc[j] += qe * ke[j];
      }
      float* o = out + i * len + t0;
      for (std::int64_t j = 0; j < tn; ++j) o[j] = acc[j] * scale;
    }
  }
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

/// Softmax of each row of `p` (n_rows x n) in place, keys masked by position: key j is visible to
/// query row r iff pos[j] <= qpos[r % n_q]. A row that sees no key becomes all zeros.
inline void masked_softmax(float* p, std::int64_t n_rows, std::int64_t n, std::span<const token> tokens,
                           std::span<const std::int64_t> qpos) {
  const auto n_q = std::int64_t(qpos.size());
  for (std::int64_t r = 0; r < n_rows; ++r) {
    float* x = p + r * n;
    const std::int64_t qp = qpos[std::size_t(r % n_q)];
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < n; ++j) {
      if (tokens[std::size_t(j)].pos > qp) x[j] = -std::numeric_limits<float>::infinity();
      mx = std::max(mx, x[j]);
    }
    if (mx == -std::numeric_limits<float>::infinity()) {
      std::fill(x, x + n, 0.f);
      continue;
    }
    float sum = 0.f;
    for (std::int64_t j = 0; j < n; ++j) sum += x[j] = std::exp(x[j] - mx);
    const float inv = 1.f / sum;
    for (std::int64_t j = 0; j < n; ++j) x[j] *= inv;
  }
}

inline float effective_scale(float scale, std::int32_t head_dim) {
  return scale > 0.f ? scale : 1.f / std::sqrt(float(head_dim));
}

}  // namespace detail

/// Attention mass each cached key receives from the window: per KV head h and slot j, the sum
/// over queries of softmax probability (visible keys only), averaged over the G query heads of
/// h. Result [Hkv][n_slots]. Cost O(Hq * n_q * n * d); parallel over KV heads.
template <row_source R>
score_matrix window_attention(const layer_inputs<R>& in, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv;
  const std::int64_t n = in.keys.n_slots, n_q = in.queries.n_slots;
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  score_matrix out(hkv, n);
  parallel_for(ex, hkv, [&](std::int64_t h) {
    const auto q = detail::group_queries(in.queries, std::int32_t(h), group);
    std::vector<float> p(static_cast<std::size_t>(group * n_q * n)), tile;
    detail::logits(q.data(), group * n_q, in.keys, std::int32_t(h), 0, n, scale, p.data(), tile);
    detail::masked_softmax(p.data(), group * n_q, n, in.tokens, in.query_pos);
    auto row = out.row(h);
    for (std::int64_t r = 0; r < group * n_q; ++r)
      for (std::int64_t j = 0; j < n; ++j) row[std::size_t(j)] += p[std::size_t(r * n + j)];
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
  const std::int64_t n = in.keys.n_slots, n_q = in.queries.n_slots;
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  std::vector<float> out(static_cast<std::size_t>(n_q * in.queries.n_heads * dv), 0.f);
  parallel_for(ex, hkv, [&](std::int64_t h) {
    const auto q = detail::group_queries(in.queries, std::int32_t(h), group);
    std::vector<float> p(static_cast<std::size_t>(group * n_q * n)), tile, v(static_cast<std::size_t>(dv));
    detail::logits(q.data(), group * n_q, in.keys, std::int32_t(h), 0, n, scale, p.data(), tile);
    detail::masked_softmax(p.data(), group * n_q, n, in.tokens, in.query_pos);
    for (std::int64_t j = 0; j < n; ++j) {
      to_f32(in.values.type, in.values.row(j, std::int32_t(h)), v.data(), dv);
      for (std::int32_t g = 0; g < group; ++g)
        for (std::int64_t i = 0; i < n_q; ++i) {
          const float w = p[std::size_t((g * n_q + i) * n + j)];
          if (w == 0.f) continue;
          float* o = out.data() + (i * in.queries.n_heads + h * group + g) * dv;
          for (std::int32_t e = 0; e < dv; ++e) o[e] += w * v[std::size_t(e)];
        }
    }
  });
  return out;
}

}  // namespace infkv::cpu
