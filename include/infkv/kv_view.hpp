// infkv: non-owning views of a KV cache. Trivially copyable descriptors a kernel can take by
// value: a strided tensor (contiguous NHD or HND, any strides, K and V described separately) or a
// paged table in CSR form (indptr / page indices / last-page length, as FlashInfer and vLLM use).
// Slot order is not time order: the positions live in a parallel array of `token`s.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "dtype.hpp"
#include "error.hpp"

namespace infkv {

namespace detail {
/// a * b for a, b >= 0 when the product is at most 2^62; -1 when it is larger.
constexpr std::int64_t product(std::int64_t a, std::int64_t b) {
  if (a == 0 || b == 0) return 0;
  return a > (std::int64_t(1) << 62) / b ? -1 : a * b;
}
}  // namespace detail

namespace detail {
/// `char` with the constness of `Data` (void or const void): the byte type a view addresses.
template <class Data>
using byte_of = std::conditional_t<std::is_const_v<Data>, const char, char>;
}  // namespace detail

/// One cache tensor (K or V of one layer, one sequence): element (slot, head, d) lives at
/// `data + (slot * slot_stride + head * head_stride + d) * size_of(type)`; strides in elements.
/// `Data` is `void` for a view that may be written (`tensor_view`: compaction, re-rotation) and
/// `const void` for one that is only read (`const_tensor_view`: what scoring reads); a writable
/// view converts to a read-only one.
template <class Data>
struct basic_tensor_view {
  Data* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t n_slots = 0;
  std::int32_t n_heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;

  /// Address of the head_dim elements of (slot, head). No bounds check.
  INFKV_HOST_DEVICE Data* row(std::int64_t slot, std::int32_t head) const {
    return static_cast<detail::byte_of<Data>*>(data) +
           (slot * slot_stride + std::int64_t(head) * head_stride) * std::int64_t(size_of(type));
  }
  INFKV_HOST_DEVICE bool empty() const { return data == nullptr; }
  /// The same view, read-only.
  INFKV_HOST_DEVICE constexpr operator detail::read_only_view<std::is_const_v<Data>, basic_tensor_view<const void>>()
      const {
    return {data, type, n_slots, n_heads, head_dim, slot_stride, head_stride};
  }
};
using tensor_view = basic_tensor_view<void>;
using const_tensor_view = basic_tensor_view<const void>;

/// Keys and values of one layer; `v` may be empty for scorers that read keys only.
struct kv_view {
  tensor_view k;
  tensor_view v;
};

namespace detail {
template <class Data>
basic_tensor_view<Data> nhd(Data* data, dtype t, std::int64_t n_slots, std::int32_t n_heads, std::int32_t head_dim) {
  return {data, t, n_slots, n_heads, head_dim, std::int64_t(n_heads) * head_dim, head_dim};
}
template <class Data>
basic_tensor_view<Data> hnd(Data* data, dtype t, std::int64_t n_slots, std::int32_t n_heads, std::int32_t head_dim,
                            std::int64_t slot_capacity) {
  INFKV_REQUIRE(slot_capacity >= n_slots, "slot_capacity", slot_capacity, "must be >= n_slots (", n_slots,
                "): the rows of one head would run into the next head's");
  return {data, t, n_slots, n_heads, head_dim, head_dim, slot_capacity * head_dim};
}
}  // namespace detail

/// [slot][head][dim] layout, rows packed: a writable view of writable data, a read-only one of
/// const data.
inline tensor_view nhd(void* data, dtype t, std::int64_t n_slots, std::int32_t n_heads, std::int32_t head_dim) {
  return detail::nhd(data, t, n_slots, n_heads, head_dim);
}
inline const_tensor_view nhd(const void* data, dtype t, std::int64_t n_slots, std::int32_t n_heads,
                             std::int32_t head_dim) {
  return detail::nhd(data, t, n_slots, n_heads, head_dim);
}

/// [head][slot][dim] layout; `slot_capacity` is the allocated slots per head (>= n_slots).
inline tensor_view hnd(void* data, dtype t, std::int64_t n_slots, std::int32_t n_heads, std::int32_t head_dim,
                       std::int64_t slot_capacity) {
  return detail::hnd(data, t, n_slots, n_heads, head_dim, slot_capacity);
}
inline const_tensor_view hnd(const void* data, dtype t, std::int64_t n_slots, std::int32_t n_heads,
                             std::int32_t head_dim, std::int64_t slot_capacity) {
  return detail::hnd(data, t, n_slots, n_heads, head_dim, slot_capacity);
}

inline kv_view contiguous_nhd(void* k, void* v, dtype t, std::int64_t n_slots, std::int32_t n_heads,
                              std::int32_t head_dim) {
  return {nhd(k, t, n_slots, n_heads, head_dim), nhd(v, t, n_slots, n_heads, head_dim)};
}

inline kv_view contiguous_hnd(void* k, void* v, dtype t, std::int64_t n_slots, std::int32_t n_heads,
                              std::int32_t head_dim, std::int64_t slot_capacity) {
  return {hnd(k, t, n_slots, n_heads, head_dim, slot_capacity), hnd(v, t, n_slots, n_heads, head_dim, slot_capacity)};
}

/// Storage of one paged tensor (K or V): page p, in-page slot s, head h, element d at
/// `data + (p * page_stride + s * slot_stride + h * head_stride + d) * size_of(type)`. `Data` as
/// for basic_tensor_view.
template <class Data>
struct basic_page_storage {
  Data* data = nullptr;
  std::int64_t page_stride = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;
  INFKV_HOST_DEVICE constexpr operator detail::read_only_view<std::is_const_v<Data>, basic_page_storage<const void>>()
      const {
    return {data, page_stride, slot_stride, head_stride};
  }
};
using page_storage = basic_page_storage<void>;
using const_page_storage = basic_page_storage<const void>;

/// Paged cache of one layer for a batch of sequences (CSR page table). Sequence s owns pages
/// indices[indptr[s] .. indptr[s+1]), all full but the last, which holds last_page_len[s] slots;
/// page ids index a pool of `n_pages` pages in the storage.
struct paged_view {
  page_storage k;
  page_storage v;
  dtype type = dtype::f32;
  std::int32_t n_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t page_size = 0;
  std::int32_t n_seqs = 0;
  std::int32_t n_pages = 0;               // pages in the pool: every page id is in [0, n_pages)
  std::int32_t* indptr = nullptr;         // [n_seqs + 1]
  std::int32_t* indices = nullptr;        // [indptr[n_seqs]]
  std::int32_t* last_page_len = nullptr;  // [n_seqs]

  /// Slots held by sequence s.
  INFKV_HOST_DEVICE std::int64_t seq_len(std::int32_t s) const {
    const std::int32_t pages = indptr[s + 1] - indptr[s];
    return pages == 0 ? 0 : std::int64_t(pages - 1) * page_size + last_page_len[s];
  }
};

/// Rows of one sequence of a paged tensor, with the same interface as `tensor_view`; writable
/// (`paged_rows`) or read-only (`const_paged_rows`), as basic_tensor_view.
template <class Data>
struct basic_paged_rows {
  basic_page_storage<Data> store;
  const std::int32_t* pages = nullptr;  // this sequence's page ids
  dtype type = dtype::f32;
  std::int64_t n_slots = 0;
  std::int32_t n_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t page_size = 0;

  INFKV_HOST_DEVICE Data* row(std::int64_t slot, std::int32_t head) const {
    const std::int64_t page = pages[slot / page_size], in = slot % page_size;
    return static_cast<detail::byte_of<Data>*>(store.data) +
           (page * store.page_stride + in * store.slot_stride + std::int64_t(head) * store.head_stride) *
               std::int64_t(size_of(type));
  }
  INFKV_HOST_DEVICE bool empty() const { return store.data == nullptr; }
  INFKV_HOST_DEVICE constexpr operator detail::read_only_view<std::is_const_v<Data>, basic_paged_rows<const void>>()
      const {
    return {store, pages, type, n_slots, n_heads, head_dim, page_size};
  }
};
using paged_rows = basic_paged_rows<void>;
using const_paged_rows = basic_paged_rows<const void>;

/// The read-only counterpart of a view type (itself when it is read-only already).
template <class View>
struct read_only;
template <class Data>
struct read_only<basic_tensor_view<Data>> {
  using type = const_tensor_view;
};
template <class Data>
struct read_only<basic_paged_rows<Data>> {
  using type = const_paged_rows;
};
template <class View>
using read_only_t = typename read_only<View>::type;

inline void validate(const paged_view& p, const char* name);

/// Pages a compaction of a paged sequence frees (cpu::compact, cuda::compact): the last ones of
/// its page list, given the sequence's slots before and after.
inline std::int64_t pages_freed(std::int64_t before, std::int64_t after, std::int32_t page_size) {
  return (before + page_size - 1) / page_size - (after + page_size - 1) / page_size;
}

/// Key rows of sequence s; checks the page table first (O(n_seqs)).
inline paged_rows key_rows(const paged_view& p, std::int32_t s) {
  validate(p, "paged");
  INFKV_REQUIRE(s >= 0 && s < p.n_seqs, "seq", s, "must be in [0, n_seqs = ", p.n_seqs, ")");
  return {p.k, p.indices + p.indptr[s], p.type, p.seq_len(s), p.n_heads, p.head_dim, p.page_size};
}
/// Value rows of sequence s; checks the page table first (O(n_seqs)).
inline paged_rows value_rows(const paged_view& p, std::int32_t s) {
  validate(p, "paged");
  INFKV_REQUIRE(s >= 0 && s < p.n_seqs, "seq", s, "must be in [0, n_seqs = ", p.n_seqs, ")");
  return {p.v, p.indices + p.indptr[s], p.type, p.seq_len(s), p.n_heads, p.head_dim, p.page_size};
}

/// Anything that hands out rows of head_dim elements by (slot, head): the tensor views and paged rows.
template <class R>
concept row_source = requires(const R& r, std::int64_t slot, std::int32_t head) {
  { r.row(slot, head) } -> std::convertible_to<const void*>;
  { r.n_slots } -> std::convertible_to<std::int64_t>;
  { r.n_heads } -> std::convertible_to<std::int32_t>;
  { r.head_dim } -> std::convertible_to<std::int32_t>;
  { r.type } -> std::convertible_to<dtype>;
};

/// Checks that a row source is usable; `name` is the argument's name in the message.
template <row_source R>
void validate(const R& r, const char* name) {
  if (r.empty()) infkv::fail("infkv: ", name, ".data = null: the view holds no storage");
  INFKV_REQUIRE(r.n_slots >= 0, std::string(name) + ".n_slots", r.n_slots, "must be >= 0");
  INFKV_REQUIRE(r.n_heads > 0, std::string(name) + ".n_heads", r.n_heads, "must be > 0");
  INFKV_REQUIRE(r.head_dim > 0, std::string(name) + ".head_dim", r.head_dim, "must be > 0");
  if constexpr (requires { r.page_size; })
    INFKV_REQUIRE(r.page_size > 0, std::string(name) + ".page_size", r.page_size, "must be > 0");
  if constexpr (requires { r.slot_stride; }) {
    // Rows (slot, head) of head_dim elements must not overlap: the smaller stride spans a row,
    // the larger one spans all rows of the smaller.
    const bool heads_inner = r.n_heads == 1 ? false : r.n_slots <= 1 ? true : r.head_stride <= r.slot_stride;
    const std::int64_t inner = heads_inner ? r.head_stride : r.slot_stride;
    const std::int64_t outer = heads_inner ? r.slot_stride : r.head_stride;
    const std::int64_t inner_count = heads_inner ? r.n_heads : r.n_slots;
    const std::int64_t outer_count = heads_inner ? r.n_slots : r.n_heads;
    INFKV_REQUIRE(inner_count <= 1 || inner >= r.head_dim,
                  std::string(name) + (heads_inner ? ".head_stride" : ".slot_stride"), inner,
                  "rows of head_dim = ", r.head_dim, " elements would overlap");
    const std::int64_t block = detail::product(inner_count, std::max<std::int64_t>(inner, r.head_dim));
    INFKV_REQUIRE(outer_count <= 1 || (block >= 0 && outer >= block),
                  std::string(name) + (heads_inner ? ".slot_stride" : ".head_stride"), outer, "must span the ",
                  inner_count, heads_inner ? " heads" : " slots", " of stride ", inner, " (rows would overlap)");
    // The last element's offset in bytes must be representable (no address arithmetic overflows).
    const std::int64_t last_slot =
        detail::product(std::max<std::int64_t>(r.n_slots - 1, 0), std::max<std::int64_t>(r.slot_stride, 0));
    const std::int64_t last_head = detail::product(r.n_heads - 1, std::max<std::int64_t>(r.head_stride, 0));
    constexpr std::int64_t limit = std::int64_t(1) << 62;
    INFKV_REQUIRE(last_slot >= 0 && last_head >= 0 && last_slot <= limit - last_head - r.head_dim &&
                      detail::product(last_slot + last_head + r.head_dim, std::int64_t(size_of(r.type))) >= 0,
                  std::string(name) + ".slot_stride", r.slot_stride,
                  "the view would span more than 2^62 bytes (head_stride = ", r.head_stride, ", n_slots = ", r.n_slots,
                  ")");
  }
}

/// Checks a whole paged table: strictly consistent CSR arrays and last-page lengths in range.
inline void validate(const paged_view& p, const char* name) {
  INFKV_REQUIRE(p.n_seqs >= 0, std::string(name) + ".n_seqs", p.n_seqs, "must be >= 0");
  INFKV_REQUIRE(p.page_size > 0, std::string(name) + ".page_size", p.page_size, "must be > 0");
  INFKV_REQUIRE(p.n_heads > 0, std::string(name) + ".n_heads", p.n_heads, "must be > 0");
  INFKV_REQUIRE(p.head_dim > 0, std::string(name) + ".head_dim", p.head_dim, "must be > 0");
  if (!p.indptr || !p.indices || !p.last_page_len || !p.k.data)
    infkv::fail("infkv: ", name, ": indptr, indices, last_page_len and k.data must be non-null");
  INFKV_REQUIRE(p.n_pages >= 0, std::string(name) + ".n_pages", p.n_pages, "must be >= 0");
  INFKV_REQUIRE(p.indptr[0] == 0, std::string(name) + ".indptr[0]", p.indptr[0], "must be 0");
  for (std::int32_t s = 0; s < p.n_seqs; ++s) {
    INFKV_REQUIRE(p.indptr[s + 1] >= p.indptr[s], std::string(name) + ".indptr[" + std::to_string(s + 1) + "]",
                  p.indptr[s + 1], "must not be below indptr[", s, "] = ", p.indptr[s]);
    const std::int64_t pages = std::int64_t(p.indptr[s + 1]) - p.indptr[s];
    const std::int32_t last = p.last_page_len[s];
    INFKV_REQUIRE(pages == 0 ? last == 0 : (last >= 1 && last <= p.page_size),
                  std::string(name) + ".last_page_len[" + std::to_string(s) + "]", last,
                  "must be in [1, page_size = ", p.page_size, "] for a sequence with pages, 0 without");
  }
  for (std::int32_t i = 0; i < p.indptr[p.n_seqs]; ++i)
    INFKV_REQUIRE(p.indices[i] >= 0 && p.indices[i] < p.n_pages,
                  std::string(name) + ".indices[" + std::to_string(i) + "]", p.indices[i],
                  "must be a page of the pool: in [0, n_pages = ", p.n_pages, ")");
  // Each storage: the rows of a page must not overlap and must fit in page_stride.
  for (const page_storage* st : {&p.k, &p.v}) {
    if (st->data == nullptr) continue;
    const std::string at = std::string(name) + (st == &p.k ? ".k" : ".v");
    const tensor_view page{st->data, p.type, p.page_size, p.n_heads, p.head_dim, st->slot_stride, st->head_stride};
    validate(page, at.c_str());
    const std::int64_t extent =
        (p.page_size - 1) * page.slot_stride + std::int64_t(p.n_heads - 1) * page.head_stride + p.head_dim;
    INFKV_REQUIRE(st->page_stride >= extent, at + ".page_stride", st->page_stride, "must hold a page's rows: ", extent,
                  " elements (page_size ", p.page_size, ", slot_stride ", st->slot_stride, ", head_stride ",
                  st->head_stride, ")");
    INFKV_REQUIRE(detail::product(p.n_pages, st->page_stride) >= 0 &&
                      detail::product(detail::product(p.n_pages, st->page_stride), std::int64_t(size_of(p.type))) >= 0,
                  at + ".page_stride", st->page_stride, "the pool of ", p.n_pages,
                  " pages would span more than 2^62 bytes");
  }
}

}  // namespace infkv
