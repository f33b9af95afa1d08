// infkv: the parts a policy is made of, as concepts: a scorer that declares its inputs, a bias
// that adds to scores, a selector (scores + budget -> keep set), a schedule (when to evict) and
// the hooks of stateful scorers. Also the per-layer inputs a backend scores from.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string_view>

#include "budget.hpp"
#include "keep_set.hpp"
#include "kv_view.hpp"
#include "scores.hpp"
#include "select.hpp"
#include "tokens.hpp"

namespace infkv {

/// Inputs a scorer reads, as bit flags.
enum input : unsigned {
  needs_nothing = 0,
  needs_keys = 1u << 0,        ///< cached keys
  needs_values = 1u << 1,      ///< cached values
  needs_queries = 1u << 2,     ///< a window of recent (post-RoPE) queries
  needs_attention = 1u << 3,   ///< attention probabilities of every decode step (stateful)
};

/// What one layer of one sequence offers a scorer. `keys`/`values`: [n_slots][Hkv][D] rows;
/// `queries`: [n_q][Hq][D] with Hq a multiple of Hkv, and `query_pos` their positions (key j is
/// visible to query i iff tokens[j].pos <= query_pos[i]); `scale` 0 means 1/sqrt(D).
template <row_source Rows = tensor_view>
struct layer_inputs {
  Rows keys{};
  Rows values{};
  tensor_view queries{};
  std::span<const std::int64_t> query_pos{};
  std::span<const token> tokens{};
  float scale = 0.f;
};

/// A scorer: a named value declaring the inputs it needs, that can check its own parameters.
template <class S>
concept scorer = requires(const S& s) {
  { S::name } -> std::convertible_to<std::string_view>;
  { S::needs } -> std::convertible_to<unsigned>;
  { S::natural_granularity } -> std::convertible_to<granularity>;
  s.validate();
};

/// A bias: adds to a score matrix, given the slots' metadata.
template <class B>
concept bias = requires(const B& b, score_matrix& s, std::span<const token> t) { b.apply(s, t); };

/// A selector: scores + budget -> keep set.
template <class S>
concept selector = requires(const S& s, const score_matrix& m, std::span<const token> t, const budget& b) {
  { s.select(m, t, b) } -> std::same_as<keep_set>;
};

/// A schedule: whether a cache of `n_cached` slots is due for eviction, and to how many slots.
template <class S>
concept schedule = requires(const S& s, std::int64_t n_cached) {
  { s.due(n_cached) } -> std::convertible_to<bool>;
  { s.target(n_cached) } -> std::convertible_to<std::int64_t>;
};

/// A stateful scorer's state, mirroring the cache: slots appended, evicted (compacted in keep
/// order, as `cpu::compact` does) and positions shifted.
template <class S>
concept scorer_state = requires(S& s, std::int64_t n, const keep_set& k, std::span<const token> t) {
  s.append(n);
  s.evict(k);
  s.shift(t);
};

/// A policy: a scorer plus its host-side finish (pooling, bias) and the budget it protects.
template <class P>
concept policy = scorer<P> && requires(const P& p, score_matrix& s, std::span<const token> t, const budget& b) {
  p.finish(s, t);
  { p.protect(b) } -> std::same_as<budget>;
};

/// The default selector: protected sinks and recent window, then top scores.
struct top_k {
  keep_set select(const score_matrix& s, std::span<const token> t, const budget& b) const {
    return select_top(s, t, b);
  }
};

}  // namespace infkv
