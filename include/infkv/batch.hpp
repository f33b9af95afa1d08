// infkv: one plan over a batch of sequences of different lengths, as a serving engine holds them.
// The batch is ragged and indexed by offsets as FlashInfer's `indptr`: sequence s holds slots
// [slot_indptr[s], slot_indptr[s + 1]) of the batch's token list and window queries
// [query_indptr[s], query_indptr[s + 1]) of its query rows; its keys and values are one row source
// each (a paged batch's `key_rows(paged, s)`). Every sequence has its own budget; the policy and
// the plan options are the batch's.
//
// `make_batch_plan` plans each sequence as `make_plan` would and lays their keep sets out one
// after another; `run` runs the sequences one after another through the same pipeline as `run`
// on one sequence (so each keep set is exactly that sequence's own run), in one workspace sized
// for the largest. Everything is sized at plan time: the run allocates nothing.
//
// `compact_table` is the page-table half of compacting a paged batch: after each sequence's kept
// slots have moved to the front of its own pages (cpu::compact, cuda::compact on each sequence's
// rows, or cpu::compact_batch for all), it writes the batch's page table after compaction and
// the pages freed, for the engine to take back.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "error.hpp"
#include "keep_set.hpp"
#include "kv_view.hpp"
#include "pipeline.hpp"
#include "plan.hpp"
#include "policy.hpp"

namespace infkv {

/// The shape of a batch's layers: ragged slot and query counts by offsets, heads and head size
/// shared.
struct batch_shape {
  std::span<const std::int64_t> slot_indptr{};   ///< [n_seqs + 1]: sequence s holds slots [s], [s + 1)
  std::span<const std::int64_t> query_indptr{};  ///< [n_seqs + 1] window queries, or empty when none are read
  std::int32_t kv_heads = 1;
  std::int32_t q_heads = 0;  ///< query heads (0 when the policy reads no queries)
  std::int32_t head_dim = 0;
};

/// One layer of a batch's inputs; what `layer_inputs` is for one sequence. Keys and values are
/// one row source per sequence (host array of views); the rest is the batch's, concatenated in
/// sequence order and cut by the plan's offsets.
template <row_source R = const_tensor_view>
struct batch_inputs {
  std::span<const R> keys{};                  ///< [n_seqs], or empty when the policy reads no keys
  std::span<const R> values{};                ///< [n_seqs], or empty
  const_tensor_view queries{};                ///< [query_indptr[n_seqs]] x q_heads x head_dim
  std::span<const std::int64_t> query_pos{};  ///< [query_indptr[n_seqs]]
  std::span<const token> tokens{};            ///< [slot_indptr[n_seqs]]
  float scale = 0.f;
  const_score_view accumulated{};  ///< kv_heads x slot_indptr[n_seqs] (H2O); sequence s at columns from slot_indptr[s]
  std::optional<rope> rotary{};
};

/// A batch's keep sets, sequence after sequence: sequence s's keep view (its own CSR, its own
/// slot indices) has its slots at `slots + kept_indptr[s]` and its offsets (units + 1 entries) at
/// `offsets + unit_indptr[s] + s`. The offset arrays are host memory; `slots` and `offsets` are
/// the backend's.
template <class T>
struct basic_batch_keep_view {
  T* slots = nullptr;
  T* offsets = nullptr;
  const std::int64_t* slot_indptr = nullptr;  ///< [n_seqs + 1]: each sequence's slots before the eviction
  const std::int64_t* unit_indptr = nullptr;  ///< [n_seqs + 1]: its decision units
  const std::int64_t* kept_indptr = nullptr;  ///< [n_seqs + 1]: its kept slots
  std::int32_t n_seqs = 0;

  /// Sequence s's keep view.
  basic_keep_view<T> seq(std::int32_t s) const {
    return {slots + kept_indptr[s], offsets + unit_indptr[s] + s, unit_indptr[s + 1] - unit_indptr[s],
            slot_indptr[s + 1] - slot_indptr[s]};
  }
  constexpr operator detail::read_only_view<std::is_const_v<T>, basic_batch_keep_view<const std::int64_t>>() const {
    return {slots, offsets, slot_indptr, unit_indptr, kept_indptr, n_seqs};
  }
};
using batch_keep_view = basic_batch_keep_view<std::int64_t>;
using const_batch_keep_view = basic_batch_keep_view<const std::int64_t>;

/// A sized run over a batch: each sequence's plan, the keep sets' layout, one workspace.
struct batch_plan {
  std::vector<plan> seqs;
  std::vector<std::int64_t> slot_indptr, query_indptr;  ///< the shape's, copied
  std::vector<std::int64_t> unit_indptr, kept_indptr;   ///< where each sequence's keep set lies
  std::size_t workspace_bytes = 0;                      ///< the largest sequence's

  std::int32_t n_seqs() const { return std::int32_t(seqs.size()); }
  std::int64_t units() const { return unit_indptr.back(); }
  std::int64_t kept_total() const { return kept_indptr.back(); }
  std::int64_t n_slots() const { return slot_indptr.back(); }
  /// The keep view's offsets array needs units() + n_seqs() entries, its slots array kept_total().
  std::int64_t offsets_size() const { return units() + n_seqs(); }
  /// The keep view over `slots` and `offsets` (sized as above).
  batch_keep_view keep(std::int64_t* slots, std::int64_t* offsets) const {
    return {slots, offsets, slot_indptr.data(), unit_indptr.data(), kept_indptr.data(), n_seqs()};
  }
};

namespace detail {

/// Checks an indptr array of `n + 1` entries (or of any length when n < 0): from 0, non-decreasing.
inline void check_indptr(std::span<const std::int64_t> p, std::int64_t n, const char* name) {
  INFKV_REQUIRE(!p.empty() && (n < 0 || std::int64_t(p.size()) == n + 1), std::string(name) + ".size()", p.size(),
                n < 0 ? std::string("must be n_seqs + 1 >= 1") : "must be n_seqs + 1 = " + std::to_string(n + 1));
  INFKV_REQUIRE(p[0] == 0, std::string(name) + "[0]", p[0], "must be 0");
  for (std::size_t s = 1; s < p.size(); ++s)
    INFKV_REQUIRE(p[s] >= p[s - 1], std::string(name) + "[" + std::to_string(s) + "]", p[s], "must not be below [",
                  s - 1, "] = ", p[s - 1]);
}

/// Runs f(), naming sequence s in the message of an invalid argument it raises.
template <class F>
decltype(auto) in_sequence(std::int64_t s, F&& f) {
  try {
    return f();
  } catch (const invalid_argument& e) {
    std::string_view why = e.what();
    if (why.starts_with("infkv: ")) why.remove_prefix(7);
    infkv::fail("infkv: sequence ", s, " of the batch: ", why);
  }
}

/// Sequence s of a batch as the layer list one `run` takes: layer l's inputs cut on the fly.
template <row_source R>
struct batch_sequence {
  const batch_plan* p;
  std::span<const batch_inputs<R>> layers;
  std::int32_t s;
  std::size_t size() const { return layers.size(); }
  layer_inputs<R> operator[](std::size_t l) const;
};

}  // namespace detail

/// Plans a run of `spec` over a batch of shape `shape` on backend `be`: budgets[s] for sequence s,
/// or budgets[0] for all. Each sequence is checked as make_plan checks one (the message names the
/// sequence).
template <class B>
batch_plan make_batch_plan(const B& be, const policy_spec& spec, std::span<const budget> budgets,
                           const batch_shape& shape, plan_options opt = {}) {
  detail::check_indptr(shape.slot_indptr, -1, "shape.slot_indptr");
  const auto n = std::int64_t(shape.slot_indptr.size()) - 1;
  if (!shape.query_indptr.empty()) detail::check_indptr(shape.query_indptr, n, "shape.query_indptr");
  INFKV_REQUIRE(std::int64_t(budgets.size()) == n || budgets.size() == 1, "budgets.size()", budgets.size(),
                "must be 1 or n_seqs (", n, ")");
  batch_plan bp;
  bp.slot_indptr.assign(shape.slot_indptr.begin(), shape.slot_indptr.end());
  bp.query_indptr.assign(shape.query_indptr.begin(), shape.query_indptr.end());
  bp.unit_indptr.assign(1, 0);
  bp.kept_indptr.assign(1, 0);
  bp.seqs.reserve(std::size_t(n));
  for (std::int64_t s = 0; s < n; ++s) {
    const layer_shape one{.n_slots = shape.slot_indptr[std::size_t(s + 1)] - shape.slot_indptr[std::size_t(s)],
                          .kv_heads = shape.kv_heads,
                          .q_heads = shape.q_heads,
                          .head_dim = shape.head_dim,
                          .n_queries = shape.query_indptr.empty() ? 0
                                                                  : shape.query_indptr[std::size_t(s + 1)] -
                                                                        shape.query_indptr[std::size_t(s)]};
    bp.seqs.push_back(detail::in_sequence(
        s, [&] { return make_plan(be, spec, budgets[budgets.size() == 1 ? 0 : std::size_t(s)], one, opt); }));
    const plan& p = bp.seqs.back();
    bp.unit_indptr.push_back(bp.unit_indptr.back() + p.units);
    bp.kept_indptr.push_back(bp.kept_indptr.back() + p.kept_total);
    bp.workspace_bytes = std::max(bp.workspace_bytes, p.workspace_bytes);
  }
  return bp;
}

/// As above for a policy value.
template <class B, policy P>
batch_plan make_batch_plan(const B& be, const P& policy, std::span<const budget> budgets, const batch_shape& shape,
                           plan_options opt = {}) {
  policy.validate();
  return make_batch_plan(be, policy.spec(), budgets, shape, opt);
}

/// Sequence s of one layer of a batch as `layer_inputs` (views into the batch's arrays). Throws
/// naming `s` outside [0, p.n_seqs()) and the layer's tokens when they are not the batch's slots.
template <row_source R>
layer_inputs<R> sequence_inputs(const batch_plan& p, const batch_inputs<R>& in, std::int32_t s) {
  INFKV_REQUIRE(s >= 0 && s < p.n_seqs(), "s", s, "must be a sequence of the batch, in [0, ", p.n_seqs(), ")");
  INFKV_REQUIRE(std::int64_t(in.tokens.size()) == p.n_slots(), "tokens.size()", in.tokens.size(),
                "must be the batch's slots (", p.n_slots(), ")");
  const auto at = [](const auto& v, std::int32_t i) { return v[std::size_t(i)]; };
  const std::int64_t s0 = at(p.slot_indptr, s), n = at(p.slot_indptr, s + 1) - s0;
  layer_inputs<R> one{
      .tokens = in.tokens.subspan(std::size_t(s0), std::size_t(n)), .scale = in.scale, .rotary = in.rotary};
  if (!in.keys.empty()) one.keys = at(in.keys, s);
  if (!in.values.empty()) one.values = at(in.values, s);
  if (!p.query_indptr.empty() && in.queries.data != nullptr) {
    const std::int64_t q0 = at(p.query_indptr, s), q = at(p.query_indptr, s + 1) - q0;
    one.queries = in.queries;
    one.queries.n_slots = q;
    if (q > 0) one.queries.data = in.queries.row(q0, 0);
    one.query_pos = in.query_pos.subspan(std::size_t(q0), std::size_t(q));
  }
  if (in.accumulated.rows > 0) one.accumulated = {in.accumulated.data + s0, in.accumulated.rows, n, in.accumulated.ld};
  return one;
}

template <row_source R>
layer_inputs<R> detail::batch_sequence<R>::operator[](std::size_t l) const {
  return sequence_inputs(*p, layers[l], s);
}

namespace detail {

template <row_source R>
void check_batch_layer(const batch_plan& p, const batch_inputs<R>& in, std::size_t l) {
  const auto at = [&](const char* what) { return "layers[" + std::to_string(l) + "]." + what; };
  const auto n = std::size_t(p.n_seqs());
  INFKV_REQUIRE(std::int64_t(in.tokens.size()) == p.n_slots(), at("tokens.size()"), in.tokens.size(),
                "must be the batch's slots (", p.n_slots(), ")");
  INFKV_REQUIRE(in.keys.empty() || in.keys.size() == n, at("keys.size()"), in.keys.size(),
                "must be one row source per sequence (", n, ") or none");
  INFKV_REQUIRE(in.values.empty() || in.values.size() == n, at("values.size()"), in.values.size(),
                "must be one row source per sequence (", n, ") or none");
  if (in.queries.data != nullptr) {
    INFKV_REQUIRE(!p.query_indptr.empty(), at("queries"), "given", "the plan was made without shape.query_indptr");
    INFKV_REQUIRE(
        in.queries.n_slots == p.query_indptr.back() && std::int64_t(in.query_pos.size()) == p.query_indptr.back(),
        at("queries.n_slots"), in.queries.n_slots, "must be the batch's queries (", p.query_indptr.back(),
        "), as must query_pos.size() (", in.query_pos.size(), ")");
  }
  if (in.accumulated.rows > 0)
    INFKV_REQUIRE(in.accumulated.cols == p.n_slots() && in.accumulated.ld >= in.accumulated.cols,
                  at("accumulated.cols"), in.accumulated.cols, "must be the batch's slots (", p.n_slots(), ")");
}

}  // namespace detail

/// Runs the batch plan over `layers` (one batch_inputs per layer of the decision) and writes every
/// sequence's keep set into `out` (p.keep(slots, offsets)). The sequences run one after another
/// through the one-sequence pipeline, sharing `ws` (p.workspace_bytes, 64-byte aligned); a fault
/// names its sequence. Allocates nothing.
template <class B, row_source R>
void run(const batch_plan& p, const B& be, std::span<const batch_inputs<R>> layers, std::span<std::byte> ws,
         batch_keep_view out) {
  INFKV_REQUIRE(out.n_seqs == p.n_seqs() && out.kept_indptr == p.kept_indptr.data(), "out", "another layout",
                "write the keep sets into plan.keep(slots, offsets)");
  for (std::size_t l = 0; l < layers.size(); ++l) detail::check_batch_layer(p, layers[l], l);
  for (std::int32_t s = 0; s < p.n_seqs(); ++s) {
    detail::in_sequence(s, [&] {
      detail::run_layers(p.seqs[std::size_t(s)], be, detail::batch_sequence<R>{&p, layers, s}, ws, out.seq(s));
    });
  }
}

/// As above for a one-layer decision.
template <class B, row_source R>
void run(const batch_plan& p, const B& be, const batch_inputs<R>& layer, std::span<std::byte> ws, batch_keep_view out) {
  run(p, be, std::span<const batch_inputs<R>>(&layer, 1), ws, out);
}

/// A paged batch's page table (host arrays), as `paged_view` holds it.
struct page_table {
  std::span<const std::int32_t> indptr;         ///< [n_seqs + 1]
  std::span<const std::int32_t> indices;        ///< [indptr[n_seqs]]
  std::span<const std::int32_t> last_page_len;  ///< [n_seqs]
};

/// Where compact_table writes the table after compaction (the engine's arrays, sized as the
/// table before: a sequence never gains pages) and the pages freed.
struct page_table_out {
  std::span<std::int32_t> indptr;
  std::span<std::int32_t> indices;
  std::span<std::int32_t> last_page_len;
  std::span<std::int32_t> freed;  ///< room for every page freed (at most indptr[n_seqs])
};

/// The page table of a paged batch after each sequence s kept kept_indptr[s + 1] - kept_indptr[s]
/// of its slots at the front
/// of its own pages (the first ceil(kept / page_size) of its list stay, in order; the rest are
/// freed). Writes `out`'s table and the freed pages in sequence order; returns how many were freed.
/// `out` may alias `before` (the table is rewritten front to back). Host arrays; O(pages).
inline std::int64_t compact_table(const page_table& before, std::int32_t page_size,
                                  std::span<const std::int64_t> kept_indptr, const page_table_out& out) {
  detail::check_indptr(kept_indptr, -1, "kept_indptr");
  const auto n = std::int64_t(kept_indptr.size()) - 1;
  const auto kept = [&](std::int64_t s) { return kept_indptr[std::size_t(s + 1)] - kept_indptr[std::size_t(s)]; };
  INFKV_REQUIRE(page_size > 0, "page_size", page_size, "must be > 0");
  INFKV_REQUIRE(std::int64_t(before.indptr.size()) == n + 1 && std::int64_t(before.last_page_len.size()) == n,
                "before.indptr.size()", before.indptr.size(), "must be kept_indptr.size() (", n + 1,
                ") and before.last_page_len.size() one less; last_page_len.size() = ", before.last_page_len.size());
  INFKV_REQUIRE(out.indptr.size() >= before.indptr.size() && out.last_page_len.size() >= before.last_page_len.size() &&
                    out.indices.size() >= std::size_t(before.indptr[std::size_t(n)]) &&
                    out.freed.size() >= std::size_t(before.indptr[std::size_t(n)]),
                "out.indices.size()", out.indices.size(), "out's arrays must be as large as the table before (",
                before.indptr[std::size_t(n)], " pages, ", n, " sequences), freed too");
  INFKV_REQUIRE(before.indptr[0] == 0 && std::int64_t(before.indices.size()) >= before.indptr[std::size_t(n)],
                "before.indices.size()", before.indices.size(),
                "must hold indptr[n_seqs] = ", before.indptr[std::size_t(n)], " pages (and indptr[0] must be 0)");
  for (std::int64_t s = 0; s < n; ++s) {  // check everything before writing anything
    const std::int32_t a = before.indptr[std::size_t(s)], b = before.indptr[std::size_t(s + 1)],
                       last = before.last_page_len[std::size_t(s)];
    INFKV_REQUIRE(b >= a && (a == b ? last == 0 : last >= 1 && last <= page_size),
                  "before.last_page_len[" + std::to_string(s) + "]", last, "does not fit ", b - a,
                  " pages of page_size ", page_size, " (indptr ", a, "..", b, ")");
    const std::int64_t had = a == b ? 0 : std::int64_t(b - a - 1) * page_size + last, k = kept(s);
    INFKV_REQUIRE(k <= had, "kept_indptr[" + std::to_string(s + 1) + "]", kept_indptr[std::size_t(s + 1)], "sequence ",
                  s, " would keep ", k, " of its ", had, " slots");
  }
  std::int64_t freed = 0;
  std::int32_t at = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int32_t a = before.indptr[std::size_t(s)], b = before.indptr[std::size_t(s + 1)];
    const std::int64_t k = kept(s);
    const auto stay = std::int32_t((k + page_size - 1) / page_size);
    for (std::int32_t i = a + stay; i < b; ++i) out.freed[std::size_t(freed++)] = before.indices[std::size_t(i)];
    for (std::int32_t i = 0; i < stay; ++i) out.indices[std::size_t(at + i)] = before.indices[std::size_t(a + i)];
    out.indptr[std::size_t(s)] = at;
    out.last_page_len[std::size_t(s)] = k == 0 ? 0 : std::int32_t(k - std::int64_t(stay - 1) * page_size);
    at += stay;
  }
  out.indptr[std::size_t(n)] = at;
  return freed;
}

}  // namespace infkv
