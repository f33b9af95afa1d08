// infkv CPU backend: scores of every policy for one layer, and selection at the policy's
// granularity. One overload of `score` per scorer; `select` composes score, the policy's finish
// (pooling, bias), the reduction to the chosen granularity and the top-k selector.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include <infkv/infkv.hpp>

#include "attention.hpp"
#include "executor.hpp"

namespace infkv::cpu {

namespace detail {

/// The last `count` queries of `in` (all of them when fewer are given).
template <row_source R>
layer_inputs<R> last_queries(layer_inputs<R> in, std::int64_t count) {
  const std::int64_t n_q = in.queries.n_slots, drop = std::max<std::int64_t>(0, n_q - count);
  if (drop == 0) return in;
  in.queries.data = in.queries.row(drop, 0);
  in.queries.n_slots = n_q - drop;
  in.query_pos = in.query_pos.subspan(std::size_t(drop));
  return in;
}

}  // namespace detail

/// -cos(k_j, anchor) per KV head, anchor = mean of the unit-length keys. [Hkv][n_slots].
/// Cost O(Hkv * n * d); two passes over the keys, O(d) scratch per head.
template <row_source R>
score_matrix keydiff_scores(const R& keys, const executor& ex = {}) {
  validate(keys, "keys");
  const std::int64_t n = keys.n_slots, d = keys.head_dim;
  score_matrix out(keys.n_heads, n);
  parallel_for(ex, keys.n_heads, [&](std::int64_t h) {
    std::vector<float> k(static_cast<std::size_t>(d)), anchor(static_cast<std::size_t>(d), 0.f);
    auto row = out.row(h);  // 1 / |k_j| between the passes
    for (std::int64_t j = 0; j < n; ++j) {
      to_f32(keys.type, keys.row(j, std::int32_t(h)), k.data(), d);
      const float norm = detail::dot_of(k.data(), k.data(), d);
      const float inv = norm > 0.f ? 1.f / std::sqrt(norm) : 0.f;
      row[std::size_t(j)] = inv;
      for (std::int64_t e = 0; e < d; ++e) anchor[std::size_t(e)] = detail::fmadd(k[std::size_t(e)], inv, anchor[std::size_t(e)]);
    }
    const float an = detail::dot_of(anchor.data(), anchor.data(), d);
    const float inv_an = an > 0.f ? 1.f / std::sqrt(an) : 0.f;
    for (std::int64_t j = 0; j < n; ++j) {  // keys converted again: memory stays O(d) for any n
      to_f32(keys.type, keys.row(j, std::int32_t(h)), k.data(), d);
      row[std::size_t(j)] = -detail::dot_of(k.data(), anchor.data(), d) * row[std::size_t(j)] * inv_an;
    }
  });
  return out;
}

template <row_source R>
score_matrix score(const streaming_llm&, const layer_inputs<R>& in, const executor& = {}) {
  return recency_scores(in.tokens);
}

template <row_source R>
score_matrix score(const keydiff&, const layer_inputs<R>& in, const executor& ex = {}) {
  validate_tokens(in.tokens, in.keys.n_slots);
  return keydiff_scores(in.keys, ex);
}

/// SnapKV: attention of the last `window` queries of `in`.
template <row_source R>
score_matrix score(const snapkv& p, const layer_inputs<R>& in, const executor& ex = {}) {
  p.validate();
  return window_attention(detail::last_queries(in, p.window), ex);
}

/// Inf-MLLM-style: attention of the retrieval window (the last `window` queries of `in`).
template <row_source R>
score_matrix score(const inf_mllm& p, const layer_inputs<R>& in, const executor& ex = {}) {
  p.validate();
  return window_attention(detail::last_queries(in, p.window), ex);
}

/// TOVA: attention of the last query, averaged over all heads of the layer: one row.
template <row_source R>
score_matrix score(const tova&, const layer_inputs<R>& in, const executor& ex = {}) {
  return reduce_rows(window_attention(detail::last_queries(in, 1), ex), reduction::mean);
}

/// H2O: the state's accumulated scores (feed it with `observe` at every step).
template <row_source R>
score_matrix score(const h2o_state& s, const layer_inputs<R>& in, const executor& = {}) {
  validate_tokens(in.tokens, s.n_slots());
  return s.scores();
}

/// H2O hook: accumulates the attention the queries of `in` (one decode step or a prefill chunk)
/// give to the cached keys. The state must already mirror the cache (append first).
template <row_source R>
void observe(h2o_state& s, const layer_inputs<R>& in, const executor& ex = {}) {
  s.accumulate(window_attention(in, ex), visible_counts(in.query_pos, in.tokens));
}

/// Scores of one layer after the policy's finish (pooling, bias): [units][n_slots].
template <policy P, row_source R>
score_matrix layer_scores(const P& p, const layer_inputs<R>& in, const executor& ex = {}) {
  p.validate();
  auto s = score(p, in, ex);
  p.finish(s, in.tokens);
  return s;
}

/// Keep set of one layer at granularity `g`: per KV head (one unit per scored row: one per KV
/// head, or a single unit for policies that score the layer as a whole), or per layer / per
/// token (one unit, head rows combined by `r`).
template <policy P, row_source R>
keep_set select(const P& p, const budget& b, const layer_inputs<R>& in, granularity g = P::natural_granularity,
                reduction r = reduction::mean, const executor& ex = {}) {
  auto s = layer_scores(p, in, ex);
  if (g != granularity::per_head && s.rows > 1) s = reduce_rows(s, r);
  return select_top(s, in.tokens, p.protect(b));
}

/// Per-token keep set from several layers' scores (each [units][n_slots] over the same slots),
/// every row of every layer combined by `r`.
inline keep_set select_tokens(std::span<const score_matrix> layers, std::span<const token> tokens, const budget& b,
                              reduction r = reduction::mean) {
  infkv::detail::require(!layers.empty(), "layers.size()", 0, "needs at least one layer's scores");
  score_reducer red(r);
  for (const auto& s : layers) red.add(s);
  return select_top(red.result(), tokens, b);
}

}  // namespace infkv::cpu
