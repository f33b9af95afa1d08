// infkv CPU backend: in-place compaction of a cache after selection: the kept slots move to the
// front in increasing slot order, K, V and token metadata alike, for contiguous and paged views.
// Cost: O(kept * heads * d) bytes moved.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <infkv/batch.hpp>
#include <infkv/keep_set.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/tokens.hpp>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace infkv::cpu {

namespace detail {

/// Tensors at least this large move with non-temporal stores (where the target has AVX2): far
/// beyond any cache, so the destination is not read for ownership and does not evict the source.
inline constexpr std::int64_t stream_move_bytes = std::int64_t(128) << 20;

/// Copies `bytes` from src to a non-overlapping dst, 32-byte stores that bypass the caches
/// (AVX2; memcpy otherwise). The caller fences (_mm_sfence) before the data is used elsewhere.
inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
#if defined(__AVX2__)
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const std::size_t head = std::min<std::size_t>(bytes, (32 - reinterpret_cast<std::uintptr_t>(d) % 32) % 32);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 128; bytes -= 128, d += 128, s += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  for (; bytes >= 32; bytes -= 32, d += 32, s += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  std::memcpy(d, s, bytes);
#else
  std::memcpy(dst, src, bytes);
#endif
}

template <row_source R>
void move_row(const R& t, std::int64_t from, std::int64_t to, std::int32_t head) {
  if (from != to && !t.empty())
    std::memmove(t.row(to, head), t.row(from, head), std::size_t(t.head_dim) * size_of(t.type));
}

/// Checks that `keep` is a keep set that fits a cache of `n_slots` and `n_heads` heads and
/// returns the kept count.
inline std::int64_t check_keep(const const_keep_view& keep, std::int64_t n_slots, std::int32_t n_heads,
                               bool per_head_ok) {
  validate(keep, "keep");
  INFKV_REQUIRE(keep.n_slots == n_slots, "keep.n_slots", keep.n_slots, "must equal the cache's slot count (", n_slots,
                ")");
  INFKV_REQUIRE(keep.n_units == 1 || (per_head_ok && keep.n_units == n_heads), "keep.n_units", keep.n_units,
                per_head_ok ? "must be 1 or the number of heads (" : "must be 1 (", per_head_ok ? n_heads : 1, ")");
  const std::int64_t m = keep.size(0);
  for (std::int64_t u = 1; u < keep.n_units; ++u)
    INFKV_REQUIRE(keep.size(u) == m, "keep.size(" + std::to_string(u) + ")", keep.size(u),
                  "every head must keep the same number of slots (", m, ")");
  return m;
}

/// Moves slots[i] to slot i for i in [0, slots.size()) (slots increasing, slots[i] >= i) in a
/// contiguous tensor, for every head. Runs of consecutive kept slots move as one block: the whole
/// run when the heads of a slot are packed (NHD), a run per head when a head's slots are
/// (HND), otherwise row by row, slot by slot. Each write lands at or before everything still to
/// be read, so the moves are safe in place.
inline void move_slots(const tensor_view& t, std::span<const std::int64_t> slots) {
  if (t.empty()) return;
  const std::int64_t m = std::int64_t(slots.size()),
                     row_bytes = std::int64_t(t.head_dim) * std::int64_t(size_of(t.type));
  const bool packed_slots = t.head_stride == t.head_dim && t.slot_stride == std::int64_t(t.n_heads) * t.head_dim;
  const bool packed_heads = t.slot_stride == t.head_dim;
  if (!packed_slots && !packed_heads) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int32_t h = 0; h < t.n_heads; ++h) move_row(t, slots[std::size_t(i)], i, h);
    return;
  }
  const std::int32_t planes = packed_slots ? 1 : t.n_heads;
  const std::int64_t slot_bytes = packed_slots ? row_bytes * t.n_heads : row_bytes;
  const bool stream = t.n_slots * slot_bytes * planes >= stream_move_bytes;
  for (std::int32_t h = 0; h < planes; ++h)
    for (std::int64_t i = 0; i < m;) {
      const std::int64_t from = slots[std::size_t(i)];
      std::int64_t len = 1;
      while (i + len < m && slots[std::size_t(i + len)] == from + len) ++len;
      if (stream && from - i >= len)  // source and destination do not overlap
        stream_copy(t.row(i, h), t.row(from, h), std::size_t(len * slot_bytes));
      else if (from != i)
        std::memmove(t.row(i, h), t.row(from, h), std::size_t(len * slot_bytes));
      i += len;
    }
#if defined(__AVX2__)
  if (stream) _mm_sfence();
#endif
}

inline void compact_tokens(std::span<token> tokens, std::span<const std::int64_t> slots) {
  for (std::size_t i = 0; i < slots.size(); ++i) tokens[i] = tokens[std::size_t(slots[i])];
}

}  // namespace detail

/// Compacts a contiguous cache in place: unit h of `keep` (or unit 0 for all heads) moves to
/// slots [0, kept). `tokens` holds n_slots entries (one list for all heads) or n_heads x n_slots
/// (head-major, for per-head caches); its kept entries move alike. Returns the kept count and
/// sets kv.k/v.n_slots to it. (cuda::compact is the same on a device.)
inline std::int64_t compact(kv_view& kv, std::span<token> tokens, const_keep_view keep) {
  validate(kv.k, "kv.k");
  if (!kv.v.empty()) {
    validate(kv.v, "kv.v");
    INFKV_REQUIRE(kv.v.n_slots == kv.k.n_slots && kv.v.n_heads == kv.k.n_heads, "kv.v.n_slots", kv.v.n_slots,
                  "V must have K's slots (", kv.k.n_slots, ") and heads (", kv.k.n_heads,
                  "); kv.v.n_heads = ", kv.v.n_heads);
  }
  const std::int64_t n = kv.k.n_slots, m = detail::check_keep(keep, n, kv.k.n_heads, true);
  const bool per_head_tokens = std::int64_t(tokens.size()) == n * kv.k.n_heads && kv.k.n_heads > 1;
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n || per_head_tokens, "tokens.size()", tokens.size(),
                "must be n_slots (", n, ") or n_heads x n_slots (", n * kv.k.n_heads, ")");
  INFKV_REQUIRE(uniform(keep) || per_head_tokens, "keep", "per-head units",
                "heads keeping different slots need one token list per head (n_heads x n_slots tokens)");
  if (keep.n_units == 1) {  // one list for all heads: whole slots (or runs of them) move
    detail::move_slots(kv.k, unit_span(keep, 0));
    detail::move_slots(kv.v, unit_span(keep, 0));
  } else {  // slot by slot, each head from its own list: one pass over the cache
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int32_t h = 0; h < kv.k.n_heads; ++h) {
        const std::int64_t from = keep.unit(h)[i];
        detail::move_row(kv.k, from, i, h);
        detail::move_row(kv.v, from, i, h);
      }
  }
  if (per_head_tokens)
    for (std::int32_t h = 0; h < kv.k.n_heads; ++h)
      detail::compact_tokens(tokens.subspan(std::size_t(h * n), std::size_t(n)),
                             unit_span(keep, keep.n_units == 1 ? 0 : h));
  if (per_head_tokens) {  // pack the per-head lists to n_heads x m
    for (std::int32_t h = 1; h < kv.k.n_heads; ++h)
      for (std::int64_t i = 0; i < m; ++i) tokens[std::size_t(h * m + i)] = tokens[std::size_t(h * n + i)];
  } else {
    detail::compact_tokens(tokens, unit_span(keep, 0));
  }
  kv.k.n_slots = m;
  if (!kv.v.empty()) kv.v.n_slots = m;
  return m;
}

/// Compacts one sequence of a paged cache in place (one unit for all heads): its kept slots move
/// to the first ceil(kept / page_size) pages of its page list, and `tokens` (n_slots entries)
/// alike; `v` may be empty. The page table is the engine's and is never touched: the last
/// pages_freed(n_slots, kept, page_size) pages of the sequence's list are free for the engine to
/// take back, and the sequence's length becomes the returned kept count. (cuda::compact is the
/// same on a device.)
inline std::int64_t compact(const paged_rows& k, const paged_rows& v, std::span<token> tokens, const_keep_view keep) {
  validate(k, "k");
  if (!v.empty()) {
    validate(v, "v");
    INFKV_REQUIRE(v.n_slots == k.n_slots && v.n_heads == k.n_heads && v.pages == k.pages, "v.n_slots", v.n_slots,
                  "V must be the same sequence's rows as K (", k.n_slots, " slots, ", k.n_heads,
                  " heads, the same pages)");
  }
  const std::int64_t n = k.n_slots, m = detail::check_keep(keep, n, k.n_heads, false);
  validate_tokens(tokens, n);
  const auto slots = unit_span(keep, 0);
  for (std::int64_t i = 0; i < m; ++i)  // slot by slot: one pass over the pages
    for (std::int32_t h = 0; h < k.n_heads; ++h) {
      detail::move_row(k, slots[std::size_t(i)], i, h);
      detail::move_row(v, slots[std::size_t(i)], i, h);
    }
  detail::compact_tokens(tokens, slots);
  return m;
}

/// Compacts a paged batch in place: sequence s keeps the slots of keep.seq(s) (one unit for all
/// heads), which move to the front of its own pages, K and V alike (kv.v may be null); `tokens`
/// (the batch's, ragged by keep.slot_indptr) are packed to the kept ones, sequence s's then at
/// keep.kept_indptr[s]; the page table after compaction and the pages freed go to `out`
/// (compact_table; it may be kv's own table). Every argument is checked before anything moves.
/// Returns the number of pages freed.
inline std::int64_t compact(const paged_view& kv, std::span<token> tokens, const_batch_keep_view keep,
                            const page_table_out& out) {
  validate(kv, "kv");
  INFKV_REQUIRE(keep.n_seqs == kv.n_seqs, "keep.n_seqs", keep.n_seqs, "must be kv.n_seqs (", kv.n_seqs, ")");
  const auto n = std::size_t(kv.n_seqs);
  INFKV_REQUIRE(std::int64_t(tokens.size()) == keep.slot_indptr[n], "tokens.size()", tokens.size(),
                "must be the batch's slots (", keep.slot_indptr[n], ")");
  const auto rows = [&](const page_storage& st, std::int32_t s) {
    return paged_rows{st, kv.indices + kv.indptr[s], kv.type, kv.seq_len(s), kv.n_heads, kv.head_dim, kv.page_size};
  };
  for (std::int32_t s = 0; s < kv.n_seqs; ++s) {
    const const_keep_view k = keep.seq(s);
    infkv::detail::in_sequence(s, [&] {
      INFKV_REQUIRE(k.n_slots == kv.seq_len(s), "keep.n_slots", k.n_slots, "must be the sequence's slots in kv (",
                    kv.seq_len(s), ")");
      INFKV_REQUIRE(k.offsets[k.n_units] == keep.kept_indptr[s + 1] - keep.kept_indptr[s], "keep.kept_indptr",
                    keep.kept_indptr[s + 1] - keep.kept_indptr[s], "the keep set holds ", k.offsets[k.n_units],
                    " slots");
      detail::check_keep(k, k.n_slots, kv.n_heads, false);
    });
  }
  const auto ptr = [](std::int32_t* p, std::size_t count) { return std::span<const std::int32_t>(p, count); };
  const page_table before{ptr(kv.indptr, n + 1), ptr(kv.indices, std::size_t(kv.indptr[n])), ptr(kv.last_page_len, n)};
  const std::span<const std::int64_t> kept(keep.kept_indptr, n + 1);
  // The table is checked (and written) last, but checked here too: nothing moves before it fits.
  INFKV_REQUIRE(out.indptr.size() >= n + 1 && out.last_page_len.size() >= n &&
                    out.indices.size() >= before.indices.size() && out.freed.size() >= before.indices.size(),
                "out.indices.size()", out.indices.size(), "out's arrays must be as large as kv's table (",
                before.indices.size(), " pages, ", n, " sequences), freed too");
  for (std::int32_t s = 0; s < kv.n_seqs; ++s) {
    const const_keep_view k = keep.seq(s);
    const std::int64_t from = keep.slot_indptr[s], to = keep.kept_indptr[s], m = k.offsets[1];
    const paged_rows v = kv.v.data ? rows(kv.v, s) : paged_rows{};
    compact(rows(kv.k, s), v, tokens.subspan(std::size_t(from), std::size_t(k.n_slots)), k);
    std::copy_n(tokens.begin() + from, m, tokens.begin() + to);  // to <= from: forward copy is safe
  }
  return compact_table(before, kv.page_size, kept, out);
}

}  // namespace infkv::cpu
