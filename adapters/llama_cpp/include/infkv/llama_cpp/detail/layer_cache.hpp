// infkv llama.cpp adapter: what one layer keeps on the host so that any policy can score: the
// last `window` post-RoPE queries (f32, as the graph computes them) with their positions, and,
// where the session does not read llama.cpp's cache itself (key_source::copy), a copy of the
// post-RoPE keys of the cached tokens (in the session's key type: the cache's own f16 by default,
// in the session's slot order) and of their values when the policy reads them. Rows are copied
// straight from the graph's nodes during llama_decode into their place after the cached slots,
// and join only when the decode succeeds. Of each batch only the queries that can still be in the
// window are kept (all of them while H2O observes the batch), each held once; a stream decode's
// query rows take the place of the window's oldest ones (which its rows push out of the window
// anyway) when its first query node arrives, so the layer holds `window` rows, not the window
// plus a batch's; a decode that fails after that leaves the window's newest rows (abort()).
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

  /// Cached keys [n_slots][n_head_kv][head_dim] (empty view before the first decode).
  tensor_view keys() { return rows_view(keys_); }
  /// Cached values [n_slots][n_head_kv][head_dim] (empty view unless values are captured).
  tensor_view values() { return rows_view(values_); }
  /// Window queries [n_queries][n_head][head_dim], f32.
  tensor_view queries() {
    return queries_.empty() ? tensor_view{} : nhd(queries_.data(), dtype::f32, n_queries(), n_head_, head_dim_);
  }
  /// The queries kept of the last decode [kept][n_head][head_dim], f32 (all of the batch when
  /// begin() was asked for them), until trim() (or the next begin()).
  const_tensor_view batch_queries() const {
    return nhd(queries_.data() + landing_ * q_row(), dtype::f32, keep_q_, n_head_, head_dim_);
  }

  /// Before a decode of `n` tokens: their key (value) rows land after the cached slots when
  /// `rows` (the copies are kept), and the last `keep_queries` of their queries after the
  /// window's newest `hold - keep_queries` rows (the older ones leave when the first query node
  /// arrives; the default keeps the whole window: decodes aside). `cells`: the most slots the
  /// cache can hold (the context's cells): key and value storage is allocated once for them.
  void begin(std::int64_t n, std::int64_t keep_queries, bool rows, std::int64_t cells,
             std::int64_t hold = std::numeric_limits<std::int64_t>::max()) {
    batch_ = n, keep_q_ = std::min(keep_queries, n), cells_ = cells, rows_ = rows;
    seen_q_ = seen_k_ = seen_v_ = 0;
    landing_ = query_pos_.size(), hold_ = hold, pushed_ = 0;
  }
  /// After a decode that failed: the window keeps the rows it still holds (its newest ones, when
  /// the decode's first query node had pushed the oldest out).
  void abort() {
    query_pos_.erase(query_pos_.begin(), query_pos_.begin() + pushed_);
    queries_.resize(query_pos_.size() * q_row());
    landing_ = query_pos_.size(), keep_q_ = 0, pushed_ = 0;
  }

  /// Frees the key and value copies (the session reads llama.cpp's cache instead).
  void release_rows() {
    std::vector<unsigned char>().swap(keys_);  // `= {}` would keep the capacity
    std::vector<unsigned char>().swap(values_);
    n_slots_ = 0, rows_ = false;
  }

  /// One node's rows of the current decode (from inside llama_decode), each converted once into
  /// its place: keys and values after the cached slots, the kept queries into the staging rows.
  void take(const node_rows& r) {
    std::int64_t& seen = r.kind == node_kind::query ? seen_q_ : r.kind == node_kind::key ? seen_k_ : seen_v_;
    INFKV_REQUIRE(seen + r.n_tokens <= batch_, "node rows", seen + r.n_tokens, "exceed the batch's ", batch_,
                  " tokens");
    if (head_dim_ == 0) head_dim_ = std::int32_t(r.head_dim);
    INFKV_REQUIRE(r.head_dim == head_dim_, "head_dim", r.head_dim, "changed from ", head_dim_);
    tmp_.resize(std::size_t(head_dim_));
    if (r.kind == node_kind::query) {
      if (n_head_ == 0) n_head_ = std::int32_t(r.heads);
      if (seen == 0 && keep_q_ > 0) {  // the decode's first query rows: the oldest leave the window
        const std::int64_t old = std::int64_t(landing_);
        pushed_ = std::clamp<std::int64_t>(old + keep_q_ - std::max(hold_, keep_q_), 0, old);
        if (pushed_ > 0)
          std::copy(queries_.begin() + std::ptrdiff_t(std::size_t(pushed_) * q_row()),
                    queries_.begin() + std::ptrdiff_t(std::size_t(old) * q_row()), queries_.begin());
        landing_ = std::size_t(old - pushed_);
      }
      const std::size_t first = landing_;  // the landing rows follow what stays of the window
      const std::size_t need = (first + std::size_t(keep_q_)) * q_row();
      if (queries_.capacity() < need) queries_.reserve(need);  // exactly: max(window, one batch's kept rows)
      queries_.resize(need);
      for (std::int64_t i = 0; i < r.n_tokens; ++i) {
        const std::int64_t at = seen + i - (batch_ - keep_q_);  // the row among the kept ones
        if (at < 0) continue;
        for (std::int64_t h = 0; h < n_head_; ++h)
          r.row_to(i, h, dtype::f32, queries_.data() + (first + std::size_t(at)) * q_row() + std::size_t(h * head_dim_),
                   nullptr);
      }
    } else {
      INFKV_REQUIRE(rows_, "node rows", r.n_tokens, "of a key or value node arrived for a decode that keeps no copies");
      if (n_head_kv_ == 0) n_head_kv_ = std::int32_t(r.heads);
      INFKV_REQUIRE(r.heads == n_head_kv_, "heads", r.heads, "of a ", r.kind == node_kind::key ? "key" : "value",
                    " node differ from the layer's ", n_head_kv_, " KV heads");
      auto& rows = r.kind == node_kind::key ? keys_ : values_;
      const std::size_t row = row_bytes();
      fit(rows, std::size_t(n_slots_ + batch_) * row, std::size_t(cells_) * row);
      for (std::int64_t i = 0; i < r.n_tokens; ++i)
        for (std::int64_t h = 0; h < n_head_kv_; ++h)
          r.row_to(i, h, type_, rows.data() + std::size_t(n_slots_ + seen + i) * row + std::size_t(h) * head_bytes(),
                   tmp_.data());
    }
    seen += r.n_tokens;
  }

  /// After a successful decode: its keys (and values) join the cached slots, its kept queries at
  /// `pos` (one per token of the batch) the window (batch_queries() until trim()).
  void commit(std::span<const std::int64_t> pos) {
    if (rows_) n_slots_ += batch_;
    query_pos_.erase(query_pos_.begin(), query_pos_.begin() + pushed_);
    query_pos_.insert(query_pos_.end(), pos.end() - keep_q_, pos.end());
    pushed_ = 0;
  }
  /// The oldest queries beyond `window` leave.
  void trim(std::int64_t window) {
    const std::int64_t drop = std::max<std::int64_t>(0, n_queries() - window);
    queries_.erase(queries_.begin(), queries_.begin() + std::ptrdiff_t(std::size_t(drop) * q_row()));
    query_pos_.erase(query_pos_.begin(), query_pos_.begin() + drop);
    queries_.resize(query_pos_.size() * q_row());
  }

  /// Appends `m` slots whose keys (and values, when they are kept) are `k`, `v` ([m][n_head_kv]
  /// [head_dim] f32): rows brought back from the archive. `cells` as in begin().
  void append(const float* k, const float* v, std::int64_t m, std::int64_t cells) {
    if (n_head_kv_ == 0 || head_dim_ == 0) return;  // nothing captured: no copies to extend
    const std::size_t row = row_bytes();
    const std::int64_t e = std::int64_t(n_head_kv_) * head_dim_;
    for (auto* rows : {&keys_, &values_}) {
      if (rows == &values_ && values_.empty()) continue;
      fit(*rows, std::size_t(n_slots_ + m) * row, std::size_t(cells) * row);
      const float* src = rows == &keys_ ? k : v;
      for (std::int64_t j = 0; j < m; ++j)
        from_f32(type_, src + j * e, rows->data() + std::size_t(n_slots_ + j) * row, e);
    }
    n_slots_ += m;
  }

  /// Keeps the slots of `keep` (one unit), compacted to the front as `cpu::compact` does;
  /// `tokens` are the slots' metadata before the eviction (left unchanged). The storage keeps its
  /// size: the next block lands in it.
  void evict(const keep_set& keep, std::span<const token> tokens) {
    if (n_slots_ == 0) return;
    kv_view kv{keys(), values()};
    std::vector<token> scratch(tokens.begin(), tokens.end());
    n_slots_ = cpu::compact(kv, scratch, keep);
  }

  /// Drops the window queries whose position no longer holds a cached token, then moves the
  /// others by the delta of the token at their position: `moved` maps old position -> delta
  /// (sorted by old position), as produced by a position compaction.
  void remap_queries(std::span<const std::pair<std::int64_t, std::int64_t>> moved, const cpu::rope* r,
                     const cpu::executor& ex) {
    const std::size_t q_row = this->q_row();
    std::vector<std::int64_t> pos, delta;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < query_pos_.size(); ++i) {
      const auto it = std::lower_bound(
          moved.begin(), moved.end(),
          std::pair<std::int64_t, std::int64_t>{query_pos_[i], std::numeric_limits<std::int64_t>::min()});
      if (it == moved.end() || it->first != query_pos_[i]) continue;
      std::copy_n(queries_.begin() + std::ptrdiff_t(i * q_row), q_row, queries_.begin() + std::ptrdiff_t(kept * q_row));
      ++kept;
      pos.push_back(query_pos_[i] + it->second);
      delta.push_back(it->second);
    }
    queries_.resize(kept * q_row), query_pos_ = std::move(pos);
    if (r != nullptr && !queries_.empty()) cpu::rerotate(queries(), delta, *r, ex);
  }

  /// Re-rotates the cached keys by `delta` (one per slot).
  void rerotate_keys(std::span<const std::int64_t> delta, const cpu::rope& r, const cpu::executor& ex) {
    if (n_slots_ > 0) cpu::rerotate(keys(), delta, r, ex);
  }

  /// Frees what a long pass's queries grew the query buffer to (the window stays).
  void shrink_queries() {
    queries_.resize(query_pos_.size() * q_row());
    queries_.shrink_to_fit();
  }

  /// Bytes this layer holds: key and value storage, window queries (with a batch's landing rows),
  /// the conversion row.
  std::int64_t key_bytes() const { return std::int64_t(keys_.capacity()); }
  std::int64_t value_bytes() const { return std::int64_t(values_.capacity()); }
  std::int64_t query_bytes() const {
    return std::int64_t(queries_.capacity() * sizeof(float) + tmp_.capacity() * sizeof(float));
  }

 private:
  std::size_t q_row() const { return std::size_t(n_head_) * std::size_t(head_dim_); }
  std::size_t head_bytes() const { return std::size_t(head_dim_) * size_of(type_); }
  std::size_t row_bytes() const { return std::size_t(n_head_kv_) * head_bytes(); }
  tensor_view rows_view(std::vector<unsigned char>& rows) {
    return rows.empty() || n_slots_ == 0 ? tensor_view{} : nhd(rows.data(), type_, n_slots_, n_head_kv_, head_dim_);
  }
  /// Grows `rows` to at least `bytes`; the first allocation takes `room` (the context's cells),
  /// so that a cache growing a token at a time never reallocates, and holds no more than the
  /// context can.
  static void fit(std::vector<unsigned char>& rows, std::size_t bytes, std::size_t room) {
    if (rows.size() >= bytes) return;
    if (rows.capacity() < bytes) rows.reserve(std::max(bytes, rows.capacity() == 0 ? room : 2 * rows.capacity()));
    rows.resize(bytes);
  }

  dtype type_ = dtype::f16;
  std::int32_t n_head_ = 0, n_head_kv_ = 0, head_dim_ = 0;
  std::int64_t n_slots_ = 0;
  std::vector<unsigned char> keys_, values_;  // rows [0, n_slots_) cached; beyond: the decode landing
  std::vector<float> queries_;
  std::vector<std::int64_t> query_pos_;
  std::int64_t batch_ = 0, keep_q_ = 0, seen_q_ = 0, seen_k_ = 0, seen_v_ = 0, cells_ = 0;
  bool rows_ = true;                                              // this decode's key and value rows go into the copies
  std::size_t landing_ = 0;                                       // the first of this decode's kept query rows
  std::int64_t hold_ = std::numeric_limits<std::int64_t>::max();  // window rows after this decode, at most
  std::int64_t pushed_ = 0;  // the window's oldest rows this decode's queries pushed out
  std::vector<float> tmp_;
};

}  // namespace infkv::llama_cpp
