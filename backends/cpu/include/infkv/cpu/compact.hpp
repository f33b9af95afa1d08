// infkv CPU backend: in-place compaction of a cache after selection: the kept slots move to the
// front in increasing slot order, K, V and token metadata alike, for contiguous and paged views.
// Cost: O(kept * heads * d) bytes moved.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <infkv/keep_set.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/tokens.hpp>

namespace infkv::cpu {

namespace detail {

template <row_source R>
void move_row(const R& t, std::int64_t from, std::int64_t to, std::int32_t head) {
  if (from != to && !t.empty())
    std::memmove(t.row(to, head), t.row(from, head), std::size_t(t.head_dim) * size_of(t.type));
}

/// Checks that `keep` fits a cache of `n_slots` and `n_heads` heads and returns the kept count.
inline std::int64_t check_keep(const keep_set& keep, std::int64_t n_slots, std::int32_t n_heads, bool per_head_ok) {
  INFKV_REQUIRE(keep.n_slots() == n_slots, "keep.n_slots()", keep.n_slots(),
                "must equal the cache's slot count (", n_slots, ")");
  INFKV_REQUIRE(keep.n_units() == 1 || (per_head_ok && keep.n_units() == n_heads), "keep.n_units()",
                keep.n_units(), per_head_ok ? "must be 1 or the number of heads (" : "must be 1 (",
                per_head_ok ? n_heads : 1, ")");
  const std::int64_t m = keep.size(0);
  for (std::int64_t u = 1; u < keep.n_units(); ++u)
    INFKV_REQUIRE(keep.size(u) == m, "keep.size(" + std::to_string(u) + ")", keep.size(u),
                  "every head must keep the same number of slots (", m, ")");
  return m;
}

inline void compact_tokens(std::span<token> tokens, std::span<const std::int64_t> slots) {
  for (std::size_t i = 0; i < slots.size(); ++i) tokens[i] = tokens[std::size_t(slots[i])];
}

}  // namespace detail

/// Compacts a contiguous cache in place: keep.unit(h) (or unit 0 for all heads) moves to slots
/// [0, kept). `tokens` holds n_slots entries (one list for all heads) or n_heads x n_slots
/// (head-major, for per-head caches); its kept entries move alike. Returns the kept count and
/// sets kv.k/v.n_slots to it.
inline std::int64_t compact(kv_view& kv, std::span<token> tokens, const keep_set& keep) {
  validate(kv.k, "kv.k");
  if (!kv.v.empty()) {
    validate(kv.v, "kv.v");
    INFKV_REQUIRE(kv.v.n_slots == kv.k.n_slots && kv.v.n_heads == kv.k.n_heads, "kv.v.n_slots",
                  kv.v.n_slots, "V must have K's slots (", kv.k.n_slots, ") and heads (", kv.k.n_heads,
                  "); kv.v.n_heads = ", kv.v.n_heads);
  }
  const std::int64_t n = kv.k.n_slots, m = detail::check_keep(keep, n, kv.k.n_heads, true);
  const bool per_head_tokens = std::int64_t(tokens.size()) == n * kv.k.n_heads && kv.k.n_heads > 1;
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n || per_head_tokens, "tokens.size()", tokens.size(),
                "must be n_slots (", n, ") or n_heads x n_slots (", n * kv.k.n_heads, ")");
  INFKV_REQUIRE(keep.uniform() || per_head_tokens, "keep", "per-head units",
                "heads keeping different slots need one token list per head (n_heads x n_slots tokens)");
  for (std::int32_t h = 0; h < kv.k.n_heads; ++h) {
    const auto slots = keep.unit(keep.n_units() == 1 ? 0 : h);
    for (std::int64_t i = 0; i < m; ++i) {
      detail::move_row(kv.k, slots[std::size_t(i)], i, h);
      detail::move_row(kv.v, slots[std::size_t(i)], i, h);
    }
    if (per_head_tokens) detail::compact_tokens(tokens.subspan(std::size_t(h * n), std::size_t(n)), slots);
  }
  if (per_head_tokens) {  // pack the per-head lists to n_heads x m
    for (std::int32_t h = 1; h < kv.k.n_heads; ++h)
      for (std::int64_t i = 0; i < m; ++i) tokens[std::size_t(h * m + i)] = tokens[std::size_t(h * n + i)];
  } else {
    detail::compact_tokens(tokens, keep.unit(0));
  }
  kv.k.n_slots = m;
  if (!kv.v.empty()) kv.v.n_slots = m;
  return m;
}

/// Compacts sequence `seq` of a paged cache in place (one unit for all heads): kept slots move to
/// the front of the sequence's pages; pages no longer needed leave the table (the CSR arrays of
/// later sequences shift down) and are returned so the caller can free them.
inline std::vector<std::int32_t> compact(paged_view& p, std::int32_t seq, std::span<token> tokens,
                                         const keep_set& keep) {
  validate(p, "paged");
  INFKV_REQUIRE(seq >= 0 && seq < p.n_seqs, "seq", seq, "must be in [0, n_seqs = ", p.n_seqs, ")");
  const std::int64_t n = p.seq_len(seq), m = detail::check_keep(keep, n, p.n_heads, false);
  validate_tokens(tokens, n);
  const auto k = key_rows(p, seq);
  const auto v = value_rows(p, seq);
  const auto slots = keep.unit(0);
  for (std::int32_t h = 0; h < p.n_heads; ++h)
    for (std::int64_t i = 0; i < m; ++i) {
      detail::move_row(k, slots[std::size_t(i)], i, h);
      detail::move_row(v, slots[std::size_t(i)], i, h);
    }
  detail::compact_tokens(tokens, slots);
  const std::int32_t pages_before = p.indptr[seq + 1] - p.indptr[seq];
  const auto pages_after = std::int32_t((m + p.page_size - 1) / p.page_size);
  const std::int32_t drop = pages_before - pages_after, end = p.indptr[p.n_seqs];
  std::vector<std::int32_t> freed(p.indices + p.indptr[seq] + pages_after, p.indices + p.indptr[seq + 1]);
  std::memmove(p.indices + p.indptr[seq + 1] - drop, p.indices + p.indptr[seq + 1],
               std::size_t(end - p.indptr[seq + 1]) * sizeof(std::int32_t));
  for (std::int32_t s = seq + 1; s <= p.n_seqs; ++s) p.indptr[s] -= drop;
  p.last_page_len[seq] = m == 0 ? 0 : std::int32_t(m - std::int64_t(pages_after - 1) * p.page_size);
  return freed;
}

}  // namespace infkv::cpu
