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
#include <cstddef>
#include <cstdint>
#include <span>

#include "keep_set.hpp"
#include "plan.hpp"
#include "policy.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

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

/// The layers of one decision, by index: a span of layer_inputs, or a batch's sequence whose
/// inputs are cut out of the batch's on the fly (batch.hpp); `layers[l]` gives a layer_inputs.
template <class L>
concept layer_list = requires(const L& l, std::size_t i) {
  { l.size() } -> std::convertible_to<std::size_t>;
  l[i].tokens;
};

/// The time order of the tokens shared by every layer (written once).
template <class B, layer_list Layers>
const std::int64_t* order_of(const plan& p, const B& be, const Layers& layers, std::span<std::byte> ws) {
  INFKV_REQUIRE(layers.size() != 0 && std::int64_t(layers.size()) == p.opt.n_layers, "layers.size()", layers.size(),
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
template <class B, layer_list Layers>
score_view decision_scores(const plan& p, const B& be, const Layers& layers, const std::int64_t* order,
                           std::span<std::byte> ws, std::int32_t part = 0) {
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

namespace detail {

/// `run` over any layer_list (a span, or one sequence of a batch).
template <class B, layer_list Layers>
void run_layers(const plan& p, const B& be, const Layers& layers, std::span<std::byte> ws, keep_view out) {
  check_workspace(p, be, ws);
  INFKV_REQUIRE(out.n_units == p.units && out.n_slots == p.shape.n_slots, "out.n_units", out.n_units,
                "the plan writes ", p.units, " units over ", p.shape.n_slots, " slots; out.n_slots = ", out.n_slots);
  const auto order = order_of(p, be, layers, ws);
  const std::int64_t n = p.shape.n_slots;
  const auto tokens = layers[0].tokens;
  if (!p.evicts()) {  // everything stays: no scoring needed
    be.keep_top(score_view{nullptr, p.units, n, n}, tokens, order, nullptr, n, p.effective, out, scratch(p, ws));
    return;
  }
  if (p.spec.second) {  // the union: the first score's share, then the budget by the second
    const score_view a = decision_scores(p, be, layers, order, ws, 0);
    be.keep_top(a, tokens, order, nullptr, p.first_share, p.effective, out, scratch(p, ws));
    const score_view b = decision_scores(p, be, layers, order, ws, 1);
    be.mark(b, out.slots, p.first_share);
    be.keep_top(b, tokens, order, nullptr, p.keep_per_unit, p.effective, out, scratch(p, ws));
    return;
  }
  const score_view final_scores = decision_scores(p, be, layers, order, ws);
  std::int64_t* caps = nullptr;  // null: every unit keeps keep_per_unit
  if (p.opt.adakv) {
    caps = at<std::int64_t>(ws, p.caps);
    be.allocate(*p.opt.adakv, final_scores, order, p.effective, p.keep_per_unit, caps, scratch(p, ws));
  }
  be.keep_top(final_scores, tokens, order, caps, p.keep_per_unit, p.effective, out, scratch(p, ws));
}

}  // namespace detail

/// Runs the plan over `layers` (one, or n_layers for a per-token decision over several layers,
/// all sharing one token list) and writes the keep set to `out` (offsets: units + 1 entries,
/// slots: kept_total). Uses only `ws` (plan.workspace_bytes, 64-byte aligned) and allocates
/// nothing.
template <class B, row_source R>
void run(const plan& p, const B& be, std::span<const layer_inputs<R>> layers, std::span<std::byte> ws, keep_view out) {
  detail::run_layers(p, be, layers, ws, out);
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
