// infkv CPU backend: H2O's state, accumulated attention per (KV head, slot) in host memory, kept
// in the cache's slot order by the hooks, and the observation hook that feeds it. The policy is
// `infkv::h2o` (score source: accumulated); the pipeline reads the state's scores through
// layer_inputs::accumulated (`attach`).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <infkv/keep_set.hpp>
#include <infkv/policies/h2o.hpp>
#include <infkv/policy.hpp>

#include "attention.hpp"
#include "compact.hpp"
#include "executor.hpp"

namespace infkv::cpu {

/// Accumulated attention per (KV head, slot), kept in the cache's slot order by the hooks: the
/// state behind policy `h2o`, whose pipeline reads `attach(inputs)`.
class h2o_state {
 public:
  h2o_state(accumulation config, std::int32_t n_kv_heads) : cfg_(config), heads_(n_kv_heads) {
    cfg_.validate(h2o::name);
    INFKV_REQUIRE(n_kv_heads > 0, "n_kv_heads", n_kv_heads, "must be > 0");
    refresh();
  }
  h2o_state(const h2o& policy, std::int32_t n_kv_heads) : h2o_state(policy.spec().score.accumulate, n_kv_heads) {}

  std::int64_t n_slots() const { return n_; }
  std::int32_t n_heads() const { return heads_; }
  const accumulation& config() const { return cfg_; }

  /// `in` with this state's scores as its accumulated scores (what policy `h2o` reads); the state
  /// must mirror the cache `in` describes (as many slots).
  template <row_source R>
  layer_inputs<R> attach(layer_inputs<R> in) const {
    INFKV_REQUIRE(n_ == std::int64_t(in.tokens.size()), "h2o_state.n_slots()", n_, "must equal the cached slots (",
                  in.tokens.size(), ")");
    in.accumulated = score_.view();
    return in;
  }

  /// New slots appended at the end of the cache with no mass yet.
  void append(std::int64_t n) {
    INFKV_REQUIRE(n >= 0, "n", n, "must be >= 0");
    resize(n_ + n);
  }

  /// Adds one step's attention: `probs` [Hkv][n_slots] summed over the step's queries, and
  /// `seen` [n_slots] how many of those queries could see each slot (for lifetime).
  void accumulate(const score_matrix& probs, std::span<const std::int64_t> seen) {
    INFKV_REQUIRE(probs.rows == heads_, "probs.rows", probs.rows, "must equal n_kv_heads (", heads_, ")");
    INFKV_REQUIRE(probs.cols == n_, "probs.cols", probs.cols, "must equal the state's slots (", n_, ")");
    INFKV_REQUIRE(std::int64_t(seen.size()) == n_, "seen.size()", seen.size(), "must equal n_slots (", n_, ")");
    check_scores(probs, "probs");
    const float keep = float(cfg_.forgetting);
    for (std::int64_t h = 0; h < heads_; ++h)
      for (std::int64_t j = 0; j < n_; ++j) {
        const auto i = std::size_t(h * n_ + j);
        acc_[i] = acc_[i] * keep + probs(h, j);
        life_[i] += float(seen[std::size_t(j)]);
      }
    refresh();
  }

  /// Keeps the slots of `k` (one unit for all heads, or one per head of equal size), compacted
  /// to the front in increasing slot order, as the cache itself is compacted.
  void evict(const_keep_view k) {
    const std::int64_t m = detail::check_keep(k, n_, std::int32_t(heads_), true);
    std::vector<float> acc(static_cast<std::size_t>(heads_ * m)), life(static_cast<std::size_t>(heads_ * m));
    for (std::int64_t h = 0; h < heads_; ++h) {
      const std::int64_t* slots = k.unit(k.n_units == 1 ? 0 : h);
      for (std::int64_t i = 0; i < m; ++i) {
        acc[std::size_t(h * m + i)] = acc_[std::size_t(h * n_ + slots[i])];
        life[std::size_t(h * m + i)] = life_[std::size_t(h * n_ + slots[i])];
      }
    }
    acc_ = std::move(acc), life_ = std::move(life), n_ = m;
    refresh();
  }

  /// Positions changed (compaction): scores do not depend on positions; checks the slot count.
  void shift(std::span<const token> tokens) { validate_tokens(tokens, n_); }

  /// Current scores [Hkv][n_slots].
  const score_matrix& scores() const { return score_; }
  /// Bytes of the state: accumulated mass, lifetimes and scores per (head, slot).
  std::int64_t bytes() const {
    return std::int64_t((acc_.capacity() + life_.capacity() + score_.data.capacity()) * sizeof(float));
  }

 private:
  void resize(std::int64_t n) {
    std::vector<float> acc(static_cast<std::size_t>(heads_ * n), 0.f), life(static_cast<std::size_t>(heads_ * n), 0.f);
    for (std::int64_t h = 0; h < heads_; ++h)
      for (std::int64_t j = 0; j < std::min(n, n_); ++j) {
        acc[std::size_t(h * n + j)] = acc_[std::size_t(h * n_ + j)];
        life[std::size_t(h * n + j)] = life_[std::size_t(h * n_ + j)];
      }
    acc_ = std::move(acc), life_ = std::move(life), n_ = n;
    refresh();
  }

  void refresh() {
    score_ = score_matrix(heads_, n_);
    for (std::size_t i = 0; i < acc_.size(); ++i)
      score_.data[i] = cfg_.normalize_lifetime ? acc_[i] / std::max(life_[i], 1.f) : acc_[i];
  }

  accumulation cfg_;
  std::int32_t heads_;
  std::int64_t n_ = 0;
  std::vector<float> acc_, life_;
  score_matrix score_;
};

/// H2O hook: accumulates the attention the queries of `in` (one decode step or a prefill chunk)
/// give to the cached keys. The state must already mirror the cache (append first).
template <row_source R>
void observe(h2o_state& s, const layer_inputs<R>& in, const executor& ex = {}) {
  s.accumulate(window_attention(in, ex), visible_counts(in.query_pos, in.tokens));
}

}  // namespace infkv::cpu
