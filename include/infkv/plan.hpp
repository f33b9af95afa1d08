// infkv: planning a pipeline run (pipeline.hpp runs it): the layer shape, the plan's options,
// the backend concept (the primitives every backend implements once) and `make_plan`, which
// checks the policy against the shape and sizes every output and the caller's workspace (CUB's
// two-phase convention: the backend adds its own scratch). Reads no data.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "allocation.hpp"
#include "budget.hpp"
#include "detail/carver.hpp"
#include "error.hpp"
#include "keep_set.hpp"
#include "policy.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

/// The shape of one layer as the pipeline sees it.
struct layer_shape {
  std::int64_t n_slots = 0;
  std::int32_t kv_heads = 1;
  std::int32_t q_heads = 0;  ///< query heads (0 when the source reads no queries)
  std::int32_t head_dim = 0;
  std::int64_t n_queries = 0;  ///< queries offered (the source reads the last spec.queries of them)
};

/// The shape of a layer's inputs.
/// The shape of a layer's inputs: slots from the tokens, KV heads from the keys (or from the
/// accumulated scores, or 1 when neither is given).
template <row_source R>
layer_shape shape_of(const layer_inputs<R>& in) {
  const std::int32_t heads = !in.keys.empty()          ? in.keys.n_heads
                             : in.accumulated.rows > 0 ? std::int32_t(in.accumulated.rows)
                                                       : 1;
  return {std::int64_t(in.tokens.size()), heads, in.queries.n_heads, in.keys.head_dim, in.queries.n_slots};
}

/// What a plan decides besides the policy and budget.
struct plan_options {
  granularity g = granularity::per_head;  ///< what one decision covers
  reduction r = reduction::mean;          ///< how rows (heads, layers) combine below per_head
  std::int32_t n_layers = 1;              ///< layers combined into one per-token decision
  std::optional<infkv::adakv> adakv{};    ///< AdaKV per-head capacities (per_head only)
};

/// A sized pipeline run: output sizes and workspace layout (bytes from the workspace's start).
struct plan {
  policy_spec spec;
  budget effective;  ///< the budget after the policy's protection (protect_sinks / protect_recent)
  plan_options opt;
  layer_shape shape;
  std::int64_t source_rows = 0;    ///< rows the (first) source writes
  std::int64_t finished_rows = 0;  ///< rows after pooling, group mean and bias (first score)
  std::int64_t units = 0;          ///< decision units of the keep set
  std::int64_t keep_per_unit = 0;  ///< slots each unit keeps (AdaKV: on average)
  std::int64_t kept_total = 0;     ///< slots the keep set holds in all
  std::int64_t first_share = 0;    ///< a union's slots kept by its first score (protected ones included)
  std::size_t order = 0, scores = 0, finished = 0, acc = 0, caps = 0, backend = 0;
  std::size_t workspace_bytes = 0;

  /// True when the run evicts anything (otherwise every slot is kept).
  bool evicts() const { return keep_per_unit < shape.n_slots; }
  /// The keep view's offsets array needs units + 1 entries, its slots array kept_total.
  std::int64_t offsets_size() const { return units + 1; }
};

/// A backend: the primitives the pipeline calls, each implemented once per backend. Spans and
/// views point to memory the backend can address (host memory for the CPU, device memory for a
/// GPU); `scratch` is the backend's part of the workspace (`scratch_bytes` sized it for one score
/// part), lent to each primitive in turn: nothing in it outlives the call. `mark(s, slots, count)`
/// sets row 0 of `s` to +infinity at the `count` slots of `slots` (a union's first picks).
template <class B, class R = const_tensor_view>
concept backend = requires(const B& b, const score_spec& score, const layer_shape& shape, const plan_options& opt,
                           const layer_inputs<R>& in, std::span<const token> tokens, std::int64_t* order,
                           const std::int64_t* corder, score_view s, std::span<std::byte> scratch, std::int64_t* caps,
                           keep_view out, reduction r, const adakv& a, const budget& bud) {
  { b.scratch_bytes(score, shape, opt) } -> std::convertible_to<std::size_t>;
  b.time_order(tokens, order, scratch);
  b.score(score, in, corder, s, scratch);
  b.value_norm(s, in.values, scratch);
  b.pool(s, corder, score, scratch);
  b.group_mean(s, s);
  b.fill_tail(s, corder, std::int64_t{0}, scratch);
  b.bias(s, tokens, corder, score, scratch);
  b.reduce(s, s, r, true);
  b.finish_reduction(s, r, std::int64_t{1});
  b.allocate(a, s, corder, bud, std::int64_t{0}, caps, scratch);
  b.keep_top(s, tokens, corder, caps, std::int64_t{0}, bud, out, scratch);
  b.mark(s, corder, std::int64_t{0});
};

namespace detail {

/// The rows a score's source writes and the rows its finish leaves, for layers of `shape`.
inline std::pair<std::int64_t, std::int64_t> part_rows(const score_spec& s, const layer_shape& shape) {
  const std::int64_t finished = s.one_row() ? 1 : shape.kv_heads;
  return {s.pools_per_query_head() ? shape.q_heads : finished, finished};
}

/// The backend's scratch for the largest of `spec`'s score parts.
template <class B>
std::size_t scratch_need(const B& be, const policy_spec& spec, const layer_shape& shape, const plan_options& opt) {
  std::size_t need = 0;
  for (std::int32_t i = 0; i < spec.parts(); ++i)
    need = std::max(need, std::size_t(be.scratch_bytes(spec.part(i), shape, opt)));
  return need;
}

/// Checks one score part of `spec` against the shape; returns part_rows.
inline std::pair<std::int64_t, std::int64_t> check_part(const policy_spec& spec, std::int32_t i,
                                                        const layer_shape& shape) {
  const score_spec& s = spec.part(i);
  const std::string name = std::string(spec.name) + (i == 0 ? "" : ".second");
  s.validate(name);
  if (s.reads_queries()) {
    INFKV_REQUIRE(shape.n_queries >= 1, "queries.n_slots", shape.n_queries, name, " needs at least one query");
    INFKV_REQUIRE(shape.q_heads >= 1 && shape.q_heads % shape.kv_heads == 0, "queries.n_heads", shape.q_heads,
                  "must be a positive multiple of keys.n_heads (", shape.kv_heads, ")");
  }
  return part_rows(s, shape);
}

}  // namespace detail

/// Plans a run of policy spec `spec` with budget `b` over layers of shape `shape` on backend `be`.
/// Checks every parameter against the shape (no data is read).
template <class B>
plan make_plan(const B& be, const policy_spec& spec, const budget& b, const layer_shape& shape, plan_options opt = {}) {
  plan p;
  p.spec = spec, p.opt = opt, p.shape = shape;
  p.effective = spec.protect(b);
  p.effective.validate();
  INFKV_REQUIRE(shape.n_slots >= 0, "shape.n_slots", shape.n_slots, "must be >= 0");
  INFKV_REQUIRE(shape.kv_heads >= 1, "shape.kv_heads", shape.kv_heads, "must be >= 1");
  INFKV_REQUIRE(opt.n_layers >= 1, "plan_options.n_layers", opt.n_layers, "must be >= 1");
  INFKV_REQUIRE(opt.n_layers == 1 || opt.g == granularity::per_token, "plan_options.n_layers", opt.n_layers,
                "several layers combine only into a per_token decision; granularity = ", to_string(opt.g));
  const bool per_head = opt.g == granularity::per_head;
  if (spec.second) {
    INFKV_REQUIRE(std::isfinite(spec.share) && spec.share >= 0.0 && spec.share <= 1.0,
                  std::string(spec.name) + ".share", spec.share, "must be in [0, 1]");
    INFKV_REQUIRE(!per_head, "plan_options.g", to_string(opt.g), spec.name,
                  " unites two selections of one decision per layer or token: plan per_layer or per_token");
    INFKV_REQUIRE(!opt.adakv, "plan_options.adakv.alpha", opt.adakv ? opt.adakv->alpha : 0.0, spec.name,
                  " has no per-head budgets to allocate");
  }
  std::int64_t scores_rows = 0, finished_rows = 0;
  for (std::int32_t i = 0; i < spec.parts(); ++i) {
    const auto [source, finished] = detail::check_part(spec, i, shape);
    if (i == 0) p.source_rows = source, p.finished_rows = finished;
    scores_rows = std::max(scores_rows, source);
    if (spec.part(i).pools_per_query_head()) finished_rows = std::max(finished_rows, finished);
  }
  const std::int64_t n = shape.n_slots;
  p.units = per_head ? p.finished_rows : 1;
  p.keep_per_unit = p.effective.keep_count(n);
  p.kept_total = p.units * p.keep_per_unit;
  if (spec.second) {  // the protected slots, then round(share * room) of the others by the first score
    const std::int64_t guarded = std::min(n, p.effective.sinks + p.effective.recent), room = p.keep_per_unit - guarded;
    p.first_share = guarded + std::min<std::int64_t>(room, std::llround(spec.share * double(room)));
  }
  if (opt.adakv) {
    opt.adakv->validate();
    INFKV_REQUIRE(per_head && p.units > 1, "plan_options.adakv.alpha", opt.adakv->alpha,
                  "AdaKV shares a layer's budget between heads: it needs per_head granularity and a per-head score "
                  "(",
                  spec.name, " at ", to_string(opt.g), " has ", p.units, " unit)");
  }
  detail::carver c;
  const auto f = sizeof(float), i64 = sizeof(std::int64_t);
  p.order = c.offset(std::size_t(n) * i64);
  p.scores = c.offset(std::size_t(scores_rows * n) * f);
  p.finished = finished_rows > 0 ? c.offset(std::size_t(finished_rows * n) * f) : p.scores;
  p.acc = c.offset(per_head ? 0 : std::size_t(n) * f);
  p.caps = c.offset(opt.adakv ? std::size_t(p.units) * i64 : 0);
  p.backend = c.offset(detail::scratch_need(be, spec, shape, opt));
  p.workspace_bytes = c.size();
  return p;
}

/// As above for a policy value.
template <class B, policy P>
plan make_plan(const B& be, const P& policy, const budget& b, const layer_shape& shape, plan_options opt = {}) {
  policy.validate();
  return make_plan(be, policy.spec(), b, shape, opt);
}

}  // namespace infkv
