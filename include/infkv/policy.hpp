// infkv: a policy as data. Every policy value gives a `policy_spec`: where its raw scores come
// from (one of six score sources a backend implements once), how they are finished (pooling
// along time, attention bias) and what it always keeps. The pipeline (pipeline.hpp) runs any
// spec on any backend. Also the per-layer inputs a backend scores from.
// Sources and finish steps are shared: a new policy is usually a new parameter set of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "bias.hpp"
#include "budget.hpp"
#include "kv_view.hpp"
#include "rope.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

/// What a policy reads from an engine, per layer: the answer to "what must my engine capture?".
/// Every policy also reads the cached tokens' positions (`layer_inputs::tokens`).
struct capture_needs {
  bool keys = false;         ///< post-RoPE keys of every cached slot (`layer_inputs::keys`)
  bool values = false;       ///< values of every cached slot (`layer_inputs::values`): value-norm weighting
  std::int64_t queries = 0;  ///< the last `queries` post-RoPE queries and their positions (0: none)
  /// The attention of every decoded query, accumulated between evictions (H2O): after each decode,
  /// the step's queries and the cached keys go to `cpu::observe`, whose state the pipeline reads as
  /// `layer_inputs::accumulated`.
  bool attention = false;
  bool rope = false;  ///< the layer's RoPE (`layer_inputs::rotary`, else the policy's): queries are turned back

  /// True when the policy reads anything besides positions: the engine must observe its forward pass.
  constexpr bool observes() const { return keys || values || queries > 0 || attention; }
  friend constexpr bool operator==(const capture_needs&, const capture_needs&) = default;
};

/// Where a policy's raw scores come from. A backend implements each source once.
enum class score_source : std::uint8_t {
  recency,             ///< rank in time order, one row (StreamingLLM)
  key_diversity,       ///< -cos(k_j, mean unit key) per KV head (KeyDiff)
  window_attention,    ///< attention mass from the last `queries` queries, per KV head (SnapKV, Inf-MLLM)
  last_query,          ///< attention of the last query, mean over every head of the layer: one row (TOVA)
  accumulated,         ///< attention accumulated over decode steps, per KV head, kept by the backend (H2O)
  expected_attention,  ///< attention future queries are expected to give, from the window's statistics
};

/// Calls `f(std::integral_constant<score_source, S>{})` for the source `s` holds: how a backend
/// dispatches to its entry for each source (the entry holds the source's scratch beside its step,
/// see cpu::detail::source and cuda::detail::source_steps), so that a source missing from a
/// backend fails to compile there.
template <class F>
constexpr decltype(auto) visit_source(score_source s, F&& f) {
  switch (s) {
    case score_source::recency: return f(std::integral_constant<score_source, score_source::recency>{});
    case score_source::key_diversity: return f(std::integral_constant<score_source, score_source::key_diversity>{});
    case score_source::window_attention:
      return f(std::integral_constant<score_source, score_source::window_attention>{});
    case score_source::last_query: return f(std::integral_constant<score_source, score_source::last_query>{});
    case score_source::accumulated: return f(std::integral_constant<score_source, score_source::accumulated>{});
    case score_source::expected_attention:
      return f(std::integral_constant<score_source, score_source::expected_attention>{});
  }
  fail_arg("score_source", int(s), "is not a score source");
}

/// How Expected Attention computes its covariance term k' Sigma' k (the same number either way, to
/// rounding): as a d x d matrix per query head (m d^2 to form it, n d^2 to apply it), or as m
/// squared projections per key (n m d).
enum class covariance_form : std::uint8_t {
  cheaper,      ///< whichever costs less for the shapes (covariance_as_matrix)
  matrix,       ///< always the matrix
  projections,  ///< always the projections
};

/// True when the matrix form costs less for m window queries, head_dim d and n keys.
constexpr bool covariance_as_matrix(std::int64_t m, std::int64_t d, std::int64_t n) { return d * (m + n) < n * m; }

/// Expected Attention's parameters (Devoto et al., arXiv 2510.00636; kvpress's ExpectedAttentionPress):
/// the window queries are turned back to before RoPE, their mean mu and covariance Sigma per query
/// head model the next queries, RoPE is averaged over the next `future` positions (R = mean of
/// the rotations), and key j scores softmax_j(s mu'.k_j + s^2 k_j' Sigma' k_j / 2), mu' = R mu,
/// Sigma' = R Sigma R', s the attention scale; the mean over each KV head's query group.
struct expectation {
  rope rotary{};                                    ///< the model's RoPE (captured queries are post-RoPE)
  bool rotated = true;                              ///< false: the model has no RoPE (queries taken as they are)
  std::int64_t future = 512;                        ///< future positions the rotation is averaged over
  std::int64_t sinks = 4;                           ///< first slots in time order left out of the softmax; they score 1
  bool covariance = true;                           ///< false: the mean term only
  covariance_form form = covariance_form::cheaper;  ///< how the covariance term is computed
  /// True when there is a covariance term and it is computed as a matrix for these shapes.
  constexpr bool matrix(std::int64_t m, std::int64_t d, std::int64_t n) const {
    return covariance &&
           (form == covariance_form::matrix || (form == covariance_form::cheaper && covariance_as_matrix(m, d, n)));
  }
  static constexpr std::int64_t max_future = std::int64_t(1) << 20;  ///< one cos/sin pair per position and pair

  void validate(std::string_view policy) const {
    INFKV_REQUIRE(future >= 1 && future <= max_future, std::string(policy) + ".future", future,
                  "must be in [1, 2^20] (kvpress: 512)");
    INFKV_REQUIRE(sinks >= 0, std::string(policy) + ".sinks", sinks, "must be >= 0");
    if (rotated) rotary.validate();
  }
};

/// How accumulated attention is kept (H2O's state, cpu::h2o_state): old mass forgotten by
/// `forgetting` before each step, and optionally divided by the number of queries that saw the slot.
struct accumulation {
  bool normalize_lifetime = false;  ///< divide by the number of queries that saw the slot
  double forgetting = 1.0;          ///< old mass is multiplied by this before each step, in (0, 1]

  void validate(std::string_view policy) const {
    INFKV_REQUIRE(std::isfinite(forgetting) && forgetting > 0.0 && forgetting <= 1.0,
                  std::string(policy) + ".forgetting", forgetting, "must be in (0, 1]");
  }
  friend constexpr bool operator==(const accumulation&, const accumulation&) = default;
};

/// How one row set of scores is made: the source, then the finish (pooling along time with the
/// observation window left out, then the attention bias). A backend's scoring primitives read only this.
struct score_spec {
  score_source source = score_source::recency;
  std::int64_t queries = 0;  ///< the last queries the source reads (window_attention; 1 for last_query)
  pooling pool = pooling::none;
  std::int32_t kernel = 1;     ///< pooling width (odd)
  std::int64_t pool_tail = 0;  ///< last slots in time order left out of pooling (the observation window)
  attention_bias bias{};
  bool value_norm = false;    ///< scores times |v_j| of their KV head, before pooling
  expectation expect{};       ///< expected_attention's parameters
  accumulation accumulate{};  ///< accumulated's parameters (how the engine's state keeps the mass)

  /// Checks the parameters, naming them after `policy` ("snapkv.kernel", "h2o.forgetting", ...):
  /// the one check of every policy's parameters (a policy's validate() calls it on its spec).
  void validate(std::string_view policy) const {
    const std::string name(policy);
    if (reads_queries()) INFKV_REQUIRE(queries >= 1, name + ".window", queries, "must be >= 1");
    INFKV_REQUIRE(kernel >= 1 && kernel % 2 == 1, name + ".kernel", kernel, "must be odd and >= 1");
    INFKV_REQUIRE(pool_tail >= 0, name + ".pool_tail", pool_tail, "must be >= 0");
    bias.validate();
    if (source == score_source::expected_attention) expect.validate(name);
    if (source == score_source::accumulated) accumulate.validate(name);
    INFKV_REQUIRE(!value_norm || !one_row(), name + ".value_norm", "true", "value norms weight per-KV-head scores; ",
                  name, " scores one row for all heads");
  }
  /// True when the source reads window queries (`queries` of them).
  constexpr bool reads_queries() const {
    return source == score_source::window_attention || source == score_source::last_query ||
           source == score_source::expected_attention;
  }
  /// True when the source scores one row for all heads of the layer (recency, last_query).
  constexpr bool one_row() const { return source == score_source::recency || source == score_source::last_query; }
  /// What the source reads (see capture_needs).
  constexpr capture_needs needs() const {
    return {.keys = source != score_source::recency && source != score_source::accumulated,
            .values = value_norm,
            .queries = reads_queries() ? queries : 0,
            .attention = source == score_source::accumulated,
            .rope = source == score_source::expected_attention && expect.rotated};
  }
  /// True when max pooling must run per query head before the GQA group mean (as SnapKV and
  /// kvpress do); for avg and sum pooling the order does not matter.
  constexpr bool pools_per_query_head() const {
    return pools() && pool == pooling::max && source == score_source::window_attention;
  }
  /// True when pooling changes anything (and the observation window then gets the row's mean).
  constexpr bool pools() const { return pool != pooling::none && kernel > 1; }
};

/// A policy as data: how its scores are made, what it always keeps, and the granularity it is
/// natural at. A union of two selections (union_of) has a second score: after the protected
/// tokens, `share` of the room goes to the first score's best and the rest to the second's best
/// among the others.
struct policy_spec {
  std::string_view name;
  score_spec score{};
  std::int64_t protect_sinks = 0;   ///< the policy keeps at least this many oldest tokens
  std::int64_t protect_recent = 0;  ///< the policy keeps at least this many newest tokens
  granularity natural = granularity::per_token;
  std::optional<score_spec> second{};  ///< the union's second score (union_of)
  double share = 1.0;                  ///< of the unprotected room, kept by `score` (with `second`); in [0, 1]

  /// The score parts: `score`, and `second` when there is one.
  constexpr std::int32_t parts() const { return second ? 2 : 1; }
  constexpr const score_spec& part(std::int32_t i) const { return i == 0 ? score : *second; }
  /// True when any part reads window queries.
  constexpr bool reads_queries() const { return score.reads_queries() || (second && second->reads_queries()); }
  /// The most window queries any part reads.
  constexpr std::int64_t queries() const { return needs().queries; }
  /// What the policy reads (both parts' needs for a union).
  constexpr capture_needs needs() const {
    const capture_needs a = score.needs();
    if (!second) return a;
    const capture_needs b = second->needs();
    return {.keys = a.keys || b.keys,
            .values = a.values || b.values,
            .queries = std::max(a.queries, b.queries),
            .attention = a.attention || b.attention,
            .rope = a.rope || b.rope};
  }
  /// The accumulation a part reads, when one does (its engine keeps that state).
  constexpr std::optional<accumulation> accumulates() const {
    for (std::int32_t i = 0; i < parts(); ++i)
      if (part(i).source == score_source::accumulated) return part(i).accumulate;
    return std::nullopt;
  }
  /// The budget the policy actually keeps: sinks widened to protect_sinks, recent to protect_recent.
  budget protect(budget b) const {
    b.sinks = std::max(b.sinks, protect_sinks);
    b.recent = std::max(b.recent, protect_recent);
    return b;
  }
};

/// A policy: a value that checks its parameters and describes itself as a `policy_spec`.
template <class P>
concept policy = requires(const P& p) {
  p.validate();
  { p.spec() } -> std::same_as<policy_spec>;
};

/// The budget policy `p` keeps given `b` (its window widens the recent tokens, its sinks the first).
template <policy P>
budget protect(const P& p, const budget& b) {
  return p.spec().protect(b);
}

/// What an engine must capture, per layer, for policy `p` to score (checks `p` first).
template <policy P>
capture_needs capture_needs_of(const P& p) {
  p.validate();
  return p.spec().needs();
}

/// What one layer of one sequence offers a scorer. `keys`/`values`: [n_slots][Hkv][D] rows;
/// `queries`: [n_q][Hq][D] with Hq a multiple of Hkv, and `query_pos` their positions (key j is
/// visible to query i iff tokens[j].pos <= query_pos[i]); `scale` 0 means 1/sqrt(D);
/// `accumulated`: [Hkv][n_slots] scores of a stateful source (H2O), owned by the backend.
/// Everything is only read: the views are read-only ones (`const_tensor_view`, or
/// `const_paged_rows` for a paged cache), and writable views convert to them.
template <row_source Rows = const_tensor_view>
struct layer_inputs {
  Rows keys{};
  Rows values{};
  const_tensor_view queries{};
  std::span<const std::int64_t> query_pos{};
  std::span<const token> tokens{};
  float scale = 0.f;
  const_score_view accumulated{};
  /// This layer's RoPE where layers differ (parameters, by value); overrides expected_attention's.
  std::optional<rope> rotary{};
};

/// Checks the keys, queries and query positions of `in` against each other (shapes, counts,
/// scale): what every source that reads window queries checks before it scores, on any backend.
/// The values themselves (finite keys and queries) are checked by the backends as they read them.
template <row_source R>
void check_query_inputs(const layer_inputs<R>& in) {
  validate(in.keys, "keys");
  validate(in.queries, "queries");
  INFKV_REQUIRE(in.queries.head_dim == in.keys.head_dim, "queries.head_dim", in.queries.head_dim,
                "must equal keys.head_dim (", in.keys.head_dim, ")");
  INFKV_REQUIRE(in.queries.n_heads % in.keys.n_heads == 0, "queries.n_heads", in.queries.n_heads,
                "must be a multiple of keys.n_heads (", in.keys.n_heads, ")");
  INFKV_REQUIRE(std::int64_t(in.query_pos.size()) == in.queries.n_slots, "query_pos.size()", in.query_pos.size(),
                "must equal the number of queries (", in.queries.n_slots, ")");
  INFKV_REQUIRE(in.queries.n_slots >= 1, "queries.n_slots", in.queries.n_slots, "needs at least one query");
  INFKV_REQUIRE(std::isfinite(in.scale) && in.scale >= 0.f, "scale", in.scale, "must be finite and >= 0");
}

/// `in` with its last `count` queries only (all of them when fewer are given): the window a
/// source reads (score_spec::queries).
template <row_source R>
layer_inputs<R> last_queries(layer_inputs<R> in, std::int64_t count) {
  const std::int64_t drop = std::max<std::int64_t>(0, in.queries.n_slots - count);
  if (drop == 0) return in;
  in.queries.data = in.queries.row(drop, 0);
  in.queries.n_slots -= drop;
  in.query_pos = in.query_pos.subspan(std::size_t(drop));
  return in;
}

}  // namespace infkv
