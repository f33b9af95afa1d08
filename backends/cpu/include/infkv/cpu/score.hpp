// infkv CPU backend: convenience calls over the pipeline (pipeline.hpp) that own their
// workspace and results: a layer's finished scores, a layer's keep set, KeyDiff scores.
// Callers that must not allocate use make_plan / run with cpu::backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <infkv/infkv.hpp>

#include "attention.hpp"
#include "backend.hpp"
#include "executor.hpp"
#include "h2o.hpp"

namespace infkv::cpu {

/// -cos(k_j, anchor) per KV head, anchor = mean of the unit-length keys. [Hkv][n_slots].
template <row_source R>
score_matrix keydiff_scores(const R& keys, const executor& ex = {}) {
  validate(keys, "keys");
  score_matrix out(keys.n_heads, keys.n_slots);
  const workspace work(std::size_t(workers(ex, keys.n_heads)) * keydiff_scratch_bytes(keys.head_dim, keys.n_heads));
  keydiff_into(keys, out.view(), work.span().data(), ex);
  return out;
}

/// Scores of one layer after the policy's finish (pooling, group mean, bias): [units][n_slots]
/// (a union's first score). H2O reads `in.accumulated` (its state's scores: h2o_state::scores()).
template <policy P, row_source R>
score_matrix layer_scores(const P& p, const layer_inputs<R>& in, const executor& ex = {}) {
  const backend be{ex};
  const plan pl = make_plan(be, p, budget{.ratio = 1.0}, shape_of(in));
  workspace ws(pl.workspace_bytes);
  const score_view s = run_scores(pl, be, in, ws.span());
  score_matrix out(s.rows, s.cols);
  for (std::int64_t r = 0; r < s.rows; ++r) std::copy(s.row(r), s.row(r) + s.cols, out.row(r).begin());
  return out;
}

/// Keep set of one layer at granularity `g`: per KV head (one unit per scored row: one per KV
/// head, or a single unit for policies that score the layer as a whole), or per layer / per
/// token (one unit, head rows combined by `r`). `g` defaults to the policy's natural granularity.
/// H2O reads `in.accumulated` (its state's scores: h2o_state::scores()).
template <policy P, row_source R>
keep_set select(const P& p, const budget& b, const layer_inputs<R>& in, std::optional<granularity> g = {},
                reduction r = reduction::mean, const executor& ex = {}) {
  const backend be{ex};
  const plan pl = make_plan(be, p, b, shape_of(in), {.g = g.value_or(p.spec().natural), .r = r});
  workspace ws(pl.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size())), slots(std::size_t(pl.kept_total));
  const keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
  run(pl, be, std::span<const layer_inputs<R>>(&in, 1), ws.span(), out);
  return keep_set::from_view(out);
}

}  // namespace infkv::cpu
