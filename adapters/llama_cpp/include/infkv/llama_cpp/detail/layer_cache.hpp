// infkv llama.cpp adapter: the host-side copy one layer keeps so that any policy can score:
// post-RoPE keys of the cached tokens (f32 or f16, in the session's slot order), their values
// when the session captures them, and the last `window` post-RoPE queries with their positions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <infkv/cpu/compact.hpp>
#include <infkv/cpu/rope.hpp>
#include <infkv/dtype.hpp>
#include <infkv/keep_set.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/tokens.hpp>

#include "../capture.hpp"

namespace infkv::llama_cpp {

/// Keys (and values) of the cached tokens and a window of recent queries of one layer.
class layer_cache {
 public:
  layer_cache() = default;
  explicit layer_cache(dtype key_type) : type_(key_type) {}

  std::int32_t n_head() const { return n_head_; }
  std::int32_t n_head_kv() const { return n_head_kv_; }
  std::int32_t head_dim() const { return head_dim_; }
  std::int64_t n_slots() const { return n_slots_; }
  std::int64_t n_queries() const { return std::int64_t(query_pos_.size()); }
  std::span<const std::int64_t> query_pos() const { return query_pos_; }

  /// Cached keys [n_slots][n_head_kv][head_dim] (empty view before the first append).
  tensor_view keys() {
    return keys_.empty() ? tensor_view{} : nhd(keys_.data(), type_, n_slots_, n_head_kv_, head_dim_);
  }
  /// Cached values [n_slots][n_head_kv][head_dim] (empty view unless values are captured).
  tensor_view values() {
    return values_.empty() ? tensor_view{} : nhd(values_.data(), type_, n_slots_, n_head_kv_, head_dim_);
  }
  /// Window queries [n_queries][n_head][head_dim], f32.
  tensor_view queries() {
    return queries_.empty() ? tensor_view{} : nhd(queries_.data(), dtype::f32, n_queries(), n_head_, head_dim_);
  }

  /// Appends the rows of one decode: keys (and values, when captured) of `rows.n_k` new slots
  /// and queries at `pos` (one per token); the oldest queries beyond `window` leave.
  void append(const layer_rows& rows, std::span<const std::int64_t> pos, std::int64_t window) {
    if (n_head_ == 0) n_head_ = rows.n_head, n_head_kv_ = rows.n_head_kv, head_dim_ = rows.head_dim;
    const std::size_t k_row = std::size_t(n_head_kv_) * std::size_t(head_dim_);
    const std::size_t q_row = std::size_t(n_head_) * std::size_t(head_dim_);
    const std::size_t at = keys_.size();
    keys_.resize(at + std::size_t(rows.n_k) * k_row * size_of(type_));
    from_f32(type_, rows.k.data(), keys_.data() + at, rows.n_k * std::int64_t(k_row));
    if (rows.n_v > 0) {
      values_.resize(at + std::size_t(rows.n_v) * k_row * size_of(type_));
      from_f32(type_, rows.v.data(), values_.data() + at, rows.n_v * std::int64_t(k_row));
    }
    n_slots_ += rows.n_k;
    const std::int64_t take = std::min<std::int64_t>(rows.n_q, window);
    const std::int64_t skip = rows.n_q - take;
    queries_.insert(queries_.end(), rows.q.begin() + std::ptrdiff_t(std::size_t(skip) * q_row), rows.q.end());
    query_pos_.insert(query_pos_.end(), pos.begin() + skip, pos.end());
    const std::int64_t drop = std::max<std::int64_t>(0, n_queries() - window);
    queries_.erase(queries_.begin(), queries_.begin() + std::ptrdiff_t(std::size_t(drop) * q_row));
    query_pos_.erase(query_pos_.begin(), query_pos_.begin() + drop);
  }

  /// Keeps the slots of `keep` (one unit), compacted to the front as `cpu::compact` does;
  /// `tokens` are the slots' metadata before the eviction (left unchanged).
  void evict(const keep_set& keep, std::span<const token> tokens) {
    if (n_slots_ == 0) return;
    kv_view kv{keys(), values()};
    std::vector<token> scratch(tokens.begin(), tokens.end());
    const std::int64_t m = cpu::compact(kv, scratch, keep);
    keys_.resize(std::size_t(m) * std::size_t(n_head_kv_) * std::size_t(head_dim_) * size_of(type_));
    if (!values_.empty()) values_.resize(keys_.size());
    n_slots_ = m;
  }

  /// Drops the window queries whose position no longer holds a cached token, then moves the
  /// others by the delta of the token at their position: `moved` maps old position -> delta
  /// (sorted by old position), as produced by a position compaction.
  void remap_queries(std::span<const std::pair<std::int64_t, std::int64_t>> moved, const cpu::rope* r,
                     const cpu::executor& ex) {
    const std::size_t q_row = std::size_t(n_head_) * std::size_t(head_dim_);
    std::vector<float> q;
    std::vector<std::int64_t> pos, delta;
    for (std::size_t i = 0; i < query_pos_.size(); ++i) {
      const auto it = std::lower_bound(
          moved.begin(), moved.end(),
          std::pair<std::int64_t, std::int64_t>{query_pos_[i], std::numeric_limits<std::int64_t>::min()});
      if (it == moved.end() || it->first != query_pos_[i]) continue;
      q.insert(q.end(), queries_.begin() + std::ptrdiff_t(i * q_row),
               queries_.begin() + std::ptrdiff_t((i + 1) * q_row));
      pos.push_back(query_pos_[i] + it->second);
      delta.push_back(it->second);
    }
    queries_ = std::move(q), query_pos_ = std::move(pos);
    if (r != nullptr && !queries_.empty()) cpu::rerotate(queries(), delta, *r, ex);
  }

  /// Re-rotates the cached keys by `delta` (one per slot).
  void rerotate_keys(std::span<const std::int64_t> delta, const cpu::rope& r, const cpu::executor& ex) {
    if (n_slots_ > 0) cpu::rerotate(keys(), delta, r, ex);
  }

 private:
  dtype type_ = dtype::f32;
  std::int32_t n_head_ = 0, n_head_kv_ = 0, head_dim_ = 0;
  std::int64_t n_slots_ = 0;
  std::vector<unsigned char> keys_, values_;
  std::vector<float> queries_;
  std::vector<std::int64_t> query_pos_;
};

}  // namespace infkv::llama_cpp
