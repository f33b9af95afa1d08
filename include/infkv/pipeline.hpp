// infkv: the one policy pipeline every backend and engine adapter runs:
//
//   tokens -> time order
//   per layer: score (the spec's source) -> times |v| (value_norm) -> pool along time,
//              observation window left out (per query head for max, then the GQA group mean) ->
//              window gets the row's mean -> attention bias -> fold into the reduction (per layer / token)
//   keep_top: per unit, protected sinks + recent, then the best scores (`keep_before` order)
//   union (a spec with a second score): select `share` of the room by the first score's decision,
//           mark those slots first in the second's, select the whole budget by the second
//
// CUB's two-phase convention: `make_plan` sizes every output and the caller's workspace (the
// backend adds its own scratch), `run` uses only that workspace and the backend's executor (a
// thread count on the CPU, a stream on a GPU) and allocates nothing. Output sizes are known at
// plan time, so a device run needs no device-to-host copy before the caller can size its buffers.
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

namespace detail {

template <class T>
T* at(std::span<std::byte> ws, std::size_t offset) {
  return reinterpret_cast<T*>(ws.data() + offset);
}

template <row_source R>
void check_layer(const plan& p, const layer_inputs<R>& in, std::int32_t l) {
  const layer_shape s = shape_of(in);
  const auto at = [&](const char* what) { return "layers[" + std::to_string(l) + "]." + what; };
  INFKV_REQUIRE(s.n_slots == p.shape.n_slots && s.kv_heads == p.shape.kv_heads, at("tokens.size()"), s.n_slots,
                "the plan was made for ", p.shape.n_slots, " slots and ", p.shape.kv_heads,
                " KV heads; this layer has ", s.kv_heads);
  if (p.spec.needs().keys) {
    INFKV_REQUIRE(!in.keys.empty(), at("keys.data"), "null", p.spec.name, " reads the keys");
    INFKV_REQUIRE(in.keys.n_slots == s.n_slots, at("tokens.size()"), s.n_slots, "must equal keys.n_slots (",
                  in.keys.n_slots, ")");
    INFKV_REQUIRE(s.head_dim == p.shape.head_dim, at("keys.head_dim"), s.head_dim, "the plan was made for ",
                  p.shape.head_dim);
  }
  if (p.spec.reads_queries()) {
    INFKV_REQUIRE(s.q_heads == p.shape.q_heads && s.n_queries >= 1, at("queries.n_heads"), s.q_heads,
                  "the plan was made for ", p.shape.q_heads, " query heads; queries.n_slots = ", s.n_queries);
    const std::int64_t planned = std::min(p.spec.queries(), p.shape.n_queries);
    INFKV_REQUIRE(std::min(p.spec.queries(), s.n_queries) <= planned, at("queries.n_slots"), s.n_queries,
                  "the plan's workspace holds ", planned,
                  " window queries: plan with the largest query count the layers will have");
  }
  if (p.spec.needs().values) {
    INFKV_REQUIRE(!in.values.empty(), at("values.data"), "null", p.spec.name, " weights scores by value norms");
    INFKV_REQUIRE(in.values.n_slots == s.n_slots && in.values.n_heads == s.kv_heads, at("values.n_slots"),
                  in.values.n_slots, "values must have the keys' ", s.n_slots, " slots and ", s.kv_heads,
                  " KV heads; values.n_heads = ", in.values.n_heads);
  }
  if (p.spec.needs().attention)
    INFKV_REQUIRE((in.accumulated.data != nullptr || p.shape.n_slots == 0) && in.accumulated.rows == p.shape.kv_heads &&
                      in.accumulated.cols == p.shape.n_slots,
                  at("accumulated.rows"), in.accumulated.rows, "must be ", p.shape.kv_heads, " x ", p.shape.n_slots,
                  " accumulated scores; cols = ", in.accumulated.cols);
}

/// The backend's part of the workspace.
inline std::span<std::byte> scratch(const plan& p, std::span<std::byte> ws) {
  return ws.subspan(p.backend, ws.size() - p.backend);
}

/// Checks the workspace against the plan, and the backend's scratch need against what the plan
/// set aside: a plan made with another backend (a CPU backend with fewer threads) would overrun it.
template <class B>
void check_workspace(const plan& p, const B& be, std::span<std::byte> ws) {
  INFKV_REQUIRE(ws.size() >= p.workspace_bytes, "workspace.size()", ws.size(), "the plan needs ", p.workspace_bytes,
                " bytes");
  INFKV_REQUIRE(reinterpret_cast<std::uintptr_t>(ws.data()) % 64 == 0, "workspace.data()", "misaligned",
                "must be 64-byte aligned");
  const std::size_t need = scratch_need(be, p.spec, p.shape, p.opt);
  INFKV_REQUIRE(need <= p.workspace_bytes - p.backend, "backend", "this backend", "needs ", need,
                " bytes of scratch, the plan set aside ", p.workspace_bytes - p.backend,
                ": make the plan with the backend that runs it (the same thread count)");
}

/// The time order of the tokens shared by every layer (written once).
template <class B, row_source R>
const std::int64_t* order_of(const plan& p, const B& be, std::span<const layer_inputs<R>> layers,
                             std::span<std::byte> ws) {
  INFKV_REQUIRE(!layers.empty() && std::int64_t(layers.size()) == p.opt.n_layers, "layers.size()", layers.size(),
                "must equal plan_options.n_layers (", p.opt.n_layers, ")");
  for (std::size_t l = 0; l < layers.size(); ++l) {
    check_layer(p, layers[l], std::int32_t(l));
    INFKV_REQUIRE(layers[l].tokens.data() == layers[0].tokens.data(), "layers[" + std::to_string(l) + "].tokens",
                  "another list", "every layer of one decision must share the tokens of layer 0");
  }
  auto* order = at<std::int64_t>(ws, p.order);
  be.time_order(layers[0].tokens, order, scratch(p, ws));
  return order;
}

}  // namespace detail

/// Scores of one layer after the finish (pooling, group mean, bias) of score part `part` (0, or
/// 1 for a union's second), in the workspace: a [rows][n_slots] view (finished_rows for part 0).
/// `order` is the tokens' time order (see `run`).
template <class B, row_source R>
score_view finish_layer(const plan& p, const B& be, const layer_inputs<R>& in, const std::int64_t* order,
                        std::span<std::byte> ws, std::int32_t part = 0) {
  const std::int64_t n = p.shape.n_slots;
  const score_spec& spec = p.spec.part(part);
  const auto [rows, finished] = detail::part_rows(spec, p.shape);
  const score_view src{detail::at<float>(ws, p.scores), rows, n, n};
  const auto scratch = detail::scratch(p, ws);
  be.score(spec, in, order, src, scratch);
  if (spec.value_norm) be.value_norm(src, in.values, scratch);
  score_view out = src;
  if (spec.pools_per_query_head()) {  // pool each query head, then average the group
    be.pool(src, order, spec, scratch);
    out = {detail::at<float>(ws, p.finished), finished, n, n};
    be.group_mean(src, out);
  } else {
    be.pool(out, order, spec, scratch);
  }
  if (spec.pools()) be.fill_tail(out, order, spec.pool_tail, scratch);
  be.bias(out, in.tokens, order, spec, scratch);
  return out;
}

/// Scores of one layer after the finish: a [finished_rows][n_slots] view into `ws` (memory of the
/// backend), valid until the workspace is used again. Allocates nothing.
template <class B, row_source R>
score_view run_scores(const plan& p, const B& be, const layer_inputs<R>& in, std::span<std::byte> ws) {
  detail::check_workspace(p, be, ws);
  const auto order = detail::order_of(p, be, std::span<const layer_inputs<R>>(&in, 1), ws);
  return finish_layer(p, be, in, order, ws);
}

namespace detail {

/// The scores the selection reads: the finished layer's for per_head, else every layer's rows
/// reduced into the workspace's accumulator.
template <class B, row_source R>
score_view decision_scores(const plan& p, const B& be, std::span<const layer_inputs<R>> layers,
                           const std::int64_t* order, std::span<std::byte> ws, std::int32_t part = 0) {
  const std::int64_t n = p.shape.n_slots;
  score_view final_scores;
  std::int64_t folded = 0;
  const score_view acc{at<float>(ws, p.acc), 1, n, n};
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const score_view s = finish_layer(p, be, layers[l], order, ws, part);
    if (p.opt.g == granularity::per_head) {
      final_scores = s;
    } else {
      be.reduce(acc, s, p.opt.r, l == 0);
      folded += s.rows;
      final_scores = acc;
    }
  }
  if (p.opt.g != granularity::per_head) be.finish_reduction(acc, p.opt.r, folded);
  return final_scores;
}

}  // namespace detail

/// The scores one decision selects by, without selecting: for a per_token or per_layer plan one
/// row (every layer's heads reduced), for per_head the heads of the one layer; of score part
/// `part` (a union's second is 1). A view into `ws` (memory of the backend), valid until the
/// workspace is used again. For callers that select themselves (e.g. whole positions:
/// select_whole_positions). Allocates nothing.
template <class B, row_source R>
score_view run_decision_scores(const plan& p, const B& be, std::span<const layer_inputs<R>> layers,
                               std::span<std::byte> ws, std::int32_t part = 0) {
  detail::check_workspace(p, be, ws);
  INFKV_REQUIRE(part >= 0 && part < p.spec.parts(), "part", part, p.spec.name, " has ", p.spec.parts(),
                " score part(s)");
  const auto order = detail::order_of(p, be, layers, ws);
  return detail::decision_scores(p, be, layers, order, ws, part);
}

/// Runs the plan over `layers` (one, or n_layers for a per-token decision over several layers,
/// all sharing one token list) and writes the keep set to `out` (offsets: units + 1 entries,
/// slots: kept_total). Uses only `ws` (plan.workspace_bytes, 64-byte aligned) and allocates
/// nothing.
template <class B, row_source R>
void run(const plan& p, const B& be, std::span<const layer_inputs<R>> layers, std::span<std::byte> ws, keep_view out) {
  detail::check_workspace(p, be, ws);
  INFKV_REQUIRE(out.n_units == p.units && out.n_slots == p.shape.n_slots, "out.n_units", out.n_units,
                "the plan writes ", p.units, " units over ", p.shape.n_slots, " slots; out.n_slots = ", out.n_slots);
  const auto order = detail::order_of(p, be, layers, ws);
  const std::int64_t n = p.shape.n_slots;
  const auto tokens = layers[0].tokens;
  if (!p.evicts()) {  // everything stays: no scoring needed
    be.keep_top(score_view{nullptr, p.units, n, n}, tokens, order, nullptr, n, p.effective, out,
                detail::scratch(p, ws));
    return;
  }
  if (p.spec.second) {  // the union: the first score's share, then the budget by the second
    const score_view a = detail::decision_scores(p, be, layers, order, ws, 0);
    be.keep_top(a, tokens, order, nullptr, p.first_share, p.effective, out, detail::scratch(p, ws));
    const score_view b = detail::decision_scores(p, be, layers, order, ws, 1);
    be.mark(b, out.slots, p.first_share);
    be.keep_top(b, tokens, order, nullptr, p.keep_per_unit, p.effective, out, detail::scratch(p, ws));
    return;
  }
  const score_view final_scores = detail::decision_scores(p, be, layers, order, ws);
  std::int64_t* caps = nullptr;  // null: every unit keeps keep_per_unit
  if (p.opt.adakv) {
    caps = detail::at<std::int64_t>(ws, p.caps);
    be.allocate(*p.opt.adakv, final_scores, order, p.effective, p.keep_per_unit, caps, detail::scratch(p, ws));
  }
  be.keep_top(final_scores, tokens, order, caps, p.keep_per_unit, p.effective, out, detail::scratch(p, ws));
}

/// As above for layers the caller may still change.
template <class B, row_source R>
void run(const plan& p, const B& be, std::span<layer_inputs<R>> layers, std::span<std::byte> ws, keep_view out) {
  run(p, be, std::span<const layer_inputs<R>>(layers), ws, out);
}

/// As above for one layer.
template <class B, row_source R>
void run(const plan& p, const B& be, const layer_inputs<R>& layer, std::span<std::byte> ws, keep_view out) {
  run(p, be, std::span<const layer_inputs<R>>(&layer, 1), ws, out);
}

}  // namespace infkv
