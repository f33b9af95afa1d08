// infkv CPU backend: attention recomputed from Q and K (so policies work with flash attention
// on): per-key probability mass from a window of queries, the largest probability any query gives
// each key (context reconstruction, KVzip), and attention outputs. The softmax is
// computed a key tile at a time with bounded memory (detail/softmax.hpp).
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

#include "detail/kernels.hpp"
#include "detail/softmax.hpp"
#include "executor.hpp"
#include "workspace.hpp"

namespace infkv::cpu {

/// Attention mass each cached key receives from the window, into `out`: per KV head h (or per
/// query head, with `per_query_head`) and slot j, the sum over queries of the softmax probability
/// (visible keys only); per KV head, averaged over the G query heads of h. `scratch` holds
/// workers(ex, Hkv) x detail::window_scratch_bytes(in) bytes, 64-byte aligned. Allocates nothing with one
/// thread. NaN or Inf in the keys or queries raise, naming slot and head (queries counted from
/// `first_query`, for a window cut from a longer query view). Cost O(Hq n_q n d); parallel over
/// KV heads; results do not depend on the thread count.
template <row_source R>
void window_attention_into(const layer_inputs<R>& in, score_view out, bool per_query_head, std::byte* scratch,
                           const executor& ex = {}, std::int64_t first_query = 0) {
  detail::check_attention_inputs(in);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv;
  INFKV_REQUIRE(out.rows == (per_query_head ? in.queries.n_heads : hkv) && out.cols == in.keys.n_slots, "out.rows",
                out.rows, "must be ", per_query_head ? in.queries.n_heads : hkv, " x ", in.keys.n_slots,
                "; out.cols = ", out.cols);
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  const std::size_t per_worker = detail::window_scratch_bytes(in);
  const std::int64_t n_q = in.queries.n_slots;
  parallel_for_workers(ex, hkv, [&](std::int64_t w, std::int64_t h) {
    const std::int64_t first = per_query_head ? h * group : h, count = per_query_head ? group : 1;
    for (std::int64_t r = 0; r < count; ++r) std::fill(out.row(first + r), out.row(first + r) + out.cols, 0.f);
    detail::softmax_tiles(in, std::int32_t(h), group, scale, first_query, scratch + std::size_t(w) * per_worker,
                          [&](std::int64_t t0, std::int64_t tn, const float* e, const float* c) {
                            for (std::int64_t r = 0; r < group * n_q; ++r) {
                              const float cr = c[r];  // a local, so the loop below vectorises
                              if (cr == 0.f) continue;
                              float* col = out.row(per_query_head ? first + r / n_q : first) + t0;
                              const float* x = e + r * detail::key_tile;
                              detail::axpy(cr, x, col, tn);
                            }
                          });
    if (!per_query_head) detail::divide(out.row(first), out.cols, float(group));
  });
}

/// Attention mass each cached key receives from the window, averaged over the G query heads of
/// each KV head: [Hkv][n_slots] (see window_attention_into).
template <row_source R>
score_matrix window_attention(const layer_inputs<R>& in, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  score_matrix out(in.keys.n_heads, in.keys.n_slots);
  const workspace work(std::size_t(workers(ex, in.keys.n_heads)) * detail::window_scratch_bytes(in));
  window_attention_into(in, out.view(), false, work.span().data(), ex);
  return out;
}

/// Context-reconstruction scores (KVzip: Kim et al., arXiv 2505.23416; kvpress's KVzipPress): per
/// KV head h and key j, the largest softmax probability any query of h's group gives key j (visible
/// keys only: tokens[j].pos <= query_pos[i]), max-accumulated into `out` (out(h, j) = max(out(h, j),
/// that probability)). The keys are all the queries attend to: for KVzip the attention sinks, the
/// chunk of the context the queries reconstruct and the reconstruction's own keys; chunks of a
/// longer context accumulate into one row of the caller's. `scratch` holds workers(ex, Hkv) x
/// detail::window_scratch_bytes(in) bytes, 64-byte aligned. Cost O(Hq n_q n d); parallel over KV
/// heads; results do not depend on the thread count.
template <row_source R>
void reconstruction_into(const layer_inputs<R>& in, score_view out, std::byte* scratch, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv;
  INFKV_REQUIRE(out.rows == hkv && out.cols == in.keys.n_slots, "out.rows", out.rows, "must be ", hkv, " x ",
                in.keys.n_slots, "; out.cols = ", out.cols);
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  const std::size_t per_worker = detail::window_scratch_bytes(in);
  parallel_for_workers(ex, hkv, [&](std::int64_t w, std::int64_t h) {
    float* row = out.row(h);
    detail::softmax_tiles(in, std::int32_t(h), group, scale, 0, scratch + std::size_t(w) * per_worker,
                          [&](std::int64_t t0, std::int64_t tn, const float* e, const float* c) {
                            for (std::int64_t r = 0; r < group * in.queries.n_slots; ++r) {
                              const float cr = c[r];
                              if (cr == 0.f) continue;
                              const float* x = e + r * detail::key_tile;
                              for (std::int64_t j = 0; j < tn; ++j) row[t0 + j] = std::max(row[t0 + j], cr * x[j]);
                            }
                          });
  });
}

/// Context-reconstruction scores of one pass (see reconstruction_into): [Hkv][n_slots], zero where
/// no query sees a key.
template <row_source R>
score_matrix reconstruction(const layer_inputs<R>& in, const executor& ex = {}) {
  detail::check_attention_inputs(in);
  score_matrix out(in.keys.n_heads, in.keys.n_slots);
  const workspace work(std::size_t(workers(ex, in.keys.n_heads)) * detail::window_scratch_bytes(in));
  reconstruction_into(in, out.view(), work.span().data(), ex);
  return out;
}

/// Per slot, how many of the queries can see it (tokens[j].pos <= query_pos[i]).
inline std::vector<std::int64_t> visible_counts(std::span<const std::int64_t> query_pos,
                                                std::span<const token> tokens) {
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
  INFKV_REQUIRE(in.values.n_slots == in.keys.n_slots && in.values.n_heads == in.keys.n_heads, "values.n_slots",
                in.values.n_slots, "values must match keys (", in.keys.n_slots, " slots, ", in.keys.n_heads,
                " heads); values.n_heads = ", in.values.n_heads);
  const std::int32_t hkv = in.keys.n_heads, group = in.queries.n_heads / hkv, dv = in.values.head_dim;
  const std::int64_t n_q = in.queries.n_slots;
  const float scale = detail::effective_scale(in.scale, in.keys.head_dim);
  std::vector<float> out(static_cast<std::size_t>(n_q * in.queries.n_heads * dv), 0.f);
  const std::size_t per_worker = detail::window_scratch_bytes(in);
  const workspace work(std::size_t(workers(ex, hkv)) * per_worker);
  parallel_for_workers(ex, hkv, [&](std::int64_t w, std::int64_t h) {
    std::vector<float> v(static_cast<std::size_t>(detail::key_tile * dv));  // the tile's values, f32
    detail::softmax_tiles(in, std::int32_t(h), group, scale, 0, work.span().data() + std::size_t(w) * per_worker,
                          [&](std::int64_t t0, std::int64_t tn, const float* e, const float* c) {
                            for (std::int64_t j = 0; j < tn; ++j)
                              to_f32(in.values.type, in.values.row(t0 + j, std::int32_t(h)), v.data() + j * dv, dv);
                            for (std::int64_t r = 0; r < group * n_q; ++r) {
                              const float cr = c[r];
                              if (cr == 0.f) continue;
                              float* o = out.data() + ((r % n_q) * in.queries.n_heads + h * group + r / n_q) * dv;
                              for (std::int64_t j = 0; j < tn; ++j) {
                                const float w = cr * e[r * detail::key_tile + j];
                                if (w == 0.f) continue;
                                detail::axpy(w, v.data() + j * dv, o, dv);
                              }
                            }
                          });
  });
  return out;
}

}  // namespace infkv::cpu
