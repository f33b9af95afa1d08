// infkv CUDA backend: steps on the cache itself, after a decision: H2O's accumulation step and its
// eviction, compaction of strided and paged caches (gathered through the workspace), and RoPE
// re-rotation. Run by a launcher, as the primitives in steps.hpp are.
#pragma once

#include <initializer_list>

#include "steps.hpp"

namespace infkv::cuda {

/// H2O's state on a device: accumulated mass, lifetime (queries that could see the slot) and the
/// score the pipeline reads (`layer_inputs::accumulated = scores`), each [heads][n_slots] with row
/// stride `ld` (>= n_slots: room to append). Memory of the caller.
struct h2o_state_view {
  float* acc = nullptr;
  float* life = nullptr;
  float* score = nullptr;
  std::int32_t heads = 0;
  std::int64_t n_slots = 0;
  std::int64_t ld = 0;
  score_view scores() const { return {score, heads, n_slots, ld}; }
};

/// Scratch h2o_observe_steps needs for a layer of `shape` (every query of the layer observed).
template <class L>
std::size_t h2o_scratch_bytes(const layer_shape& shape) {
  const policy_spec spec{.name = "h2o", .source = score_source::window_attention, .queries = shape.n_queries};
  detail::carver c{nullptr, basic_backend<L>{}.scratch_bytes(spec, shape)};
  c.take<float>(std::int64_t(shape.kv_heads) * shape.n_slots), c.take<float>(shape.n_slots);
  return c.size();
}

/// One decode step (or prefill chunk) of H2O (cpu::observe's semantics): the attention every
/// query of `in` gives the cached keys (mean over each KV head's query heads), and per slot how
/// many of those queries could see it; acc = acc x forgetting + mass, life += seen, score = acc
/// (or acc / max(life, 1) with normalize_lifetime). The state must already hold in's slots.
template <class L, row_source R>
void h2o_observe_steps(const L& launch, const h2o_state_view& st, const h2o& cfg, const layer_inputs<R>& in,
                       std::span<std::byte> scratch) {
  cfg.validate();
  const std::int64_t n = in.keys.n_slots, nq = in.queries.n_slots;
  INFKV_REQUIRE(st.heads == in.keys.n_heads && st.n_slots == n && st.ld >= n, "h2o_state_view.n_slots", st.n_slots,
                "the state must hold the layer's ", n, " slots of ", in.keys.n_heads, " KV heads; heads = ", st.heads,
                ", ld = ", st.ld);
  INFKV_REQUIRE(std::int64_t(in.tokens.size()) == n, "tokens.size()", in.tokens.size(), "must equal keys.n_slots (", n,
                ")");
  const basic_backend<L> be{launch};
  const std::size_t after =
      be.scratch_bytes({.name = "h2o", .source = score_source::window_attention, .queries = nq}, shape_of(in));
  detail::carver c{scratch.data(), after};
  const score_view mass{c.take<float>(st.heads * n), st.heads, n, n};
  float* seen = c.take<float>(n);
  auto* status = reinterpret_cast<status_word*>(scratch.data());
  launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) { *status = status_ok; });
  detail::window_attention_steps(launch, in, nq, false, mass, scratch, 64);
  const token* t = in.tokens.data();
  const std::int64_t* qpos = in.query_pos.data();
  launch.for_each(n, [=] INFKV_HOST_DEVICE(std::int64_t j) {
    std::int64_t k = 0;
    for (std::int64_t i = 0; i < nq; ++i) k += t[j].pos <= qpos[i] ? 1 : 0;
    seen[j] = float(k);
  });
  const auto keep = float(cfg.forgetting);
  const bool normalize = cfg.normalize_lifetime;
  const h2o_state_view s = st;
  launch.for_each(st.heads * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t h = x / n, j = x % n, i = h * s.ld + j;
    s.acc[i] = s.acc[i] * keep + mass(h, j);
    s.life[i] += seen[j];
    s.score[i] = normalize ? s.acc[i] / fmaxf(s.life[i], 1.f) : s.acc[i];
  });
}

/// Page ids a paged compaction frees, given the sequence's slots before and after.
inline std::int64_t pages_freed(std::int64_t before, std::int64_t after, std::int32_t page_size) {
  return (before + page_size - 1) / page_size - (after + page_size - 1) / page_size;
}

namespace detail {

/// Checks a keep set of `units` units of `m` slots each over `n` slots (offsets u * m, slots
/// strictly increasing in [0, n)); records bad_keep.
template <class L>
void check_keep(const L& launch, const_keep_view keep, std::int64_t m, status_word* st) {
  const std::int64_t n = keep.n_slots;
  launch.for_each(keep.n_units * std::max<std::int64_t>(m, 1) + 1, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    if (x == keep.n_units * std::max<std::int64_t>(m, 1)) {
      for (std::int64_t u = 0; u <= keep.n_units; ++u)
        if (keep.offsets[u] != u * m) record(st, encode(fault::bad_keep, u, 0, keep.offsets[u]));
      return;
    }
    if (m == 0) return;
    const std::int64_t u = x / m, k = x % m, s = keep.slots[u * m + k];
    if (s < 0 || s >= n || (k > 0 && s <= keep.slots[u * m + k - 1]))
      record(st, encode(fault::bad_keep, u, 0, u * m + k));
  });
}

/// Copies `bytes` (a multiple of sizeof(W)) from each (slot, head) row to another, by W words.
template <class W, class L, class From, class To>
void copy_rows(const L& launch, std::int64_t rows, std::int64_t bytes, From from, To to, const status_word* st) {
  const std::int64_t words = bytes / std::int64_t(sizeof(W));
  launch.for_each(rows * words, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    if (*st != status_ok) return;  // a bad keep set moves nothing
    static_cast<W*>(to(x / words))[x % words] = static_cast<const W*>(from(x / words))[x % words];
  });
}

/// The widest word (16, 8, 4 or 2 bytes) that divides the row bytes, the strides and the bases.
inline int word_bytes(std::int64_t row_bytes, std::initializer_list<std::uint64_t> quantities) {
  std::uint64_t all = std::uint64_t(row_bytes);
  for (auto q : quantities) all |= q;
  for (int w : {16, 8, 4})
    if (all % std::uint64_t(w) == 0) return w;
  return 2;
}

struct alignas(16) w16 {
  std::uint64_t a, b;
};

template <class L, class From, class To>
void copy_rows_widest(const L& launch, std::int64_t rows, std::int64_t bytes, int word, From from, To to,
                      const status_word* st) {
  if (word == 16)
    copy_rows<w16>(launch, rows, bytes, from, to, st);
  else if (word == 8)
    copy_rows<std::uint64_t>(launch, rows, bytes, from, to, st);
  else if (word == 4)
    copy_rows<std::uint32_t>(launch, rows, bytes, from, to, st);
  else
    copy_rows<std::uint16_t>(launch, rows, bytes, from, to, st);
}

}  // namespace detail

/// Scratch a compaction of `kept` slots of `heads` heads of `row_bytes` (K and V) needs.
inline std::size_t compact_scratch_bytes(std::int64_t kept, std::int32_t heads, std::int64_t row_bytes) {
  return 64 + 2 * std::size_t(kept) * std::size_t(heads) * std::size_t(row_bytes) +
         std::size_t(kept) * sizeof(token) * std::size_t(heads) + 192;
}

/// Compacts K, V (either may be empty) and tokens of a strided cache: unit u (or unit 0 for all
/// heads) of `keep`, `m` slots per unit, moves to slots [0, m) in increasing slot order, through
/// the scratch (an in-place parallel move would race). `tokens` holds n_slots entries (uniform
/// keep) or heads x n_slots (per-head keep, packed to heads x m), or is null. Nothing moves when
/// the keep set is inconsistent (status bad_keep).
template <class L>
void compact_steps(const L& launch, tensor_view k, tensor_view v, token* tokens, std::int64_t n_tokens,
                   const_keep_view keep, std::int64_t m, std::span<std::byte> scratch) {
  status_word* st = reinterpret_cast<status_word*>(scratch.data());
  launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) { *st = status_ok; });
  detail::check_keep(launch, keep, m, st);
  const std::int64_t heads = k.n_heads, row_bytes = k.head_dim * std::int64_t(size_of(k.type)), n = k.n_slots;
  const bool per_head = keep.n_units > 1;
  detail::carver c{scratch.data(), 64};
  for (const tensor_view& t : {k, v}) {
    if (t.empty()) continue;
    auto* buf = c.take<std::byte>(m * heads * row_bytes);
    const std::int64_t es = std::int64_t(size_of(t.type));
    const int word = detail::word_bytes(
        row_bytes, {std::uint64_t(reinterpret_cast<std::uintptr_t>(t.data)), std::uint64_t(t.slot_stride * es),
                    std::uint64_t(t.head_stride * es), std::uint64_t(reinterpret_cast<std::uintptr_t>(buf))});
    const auto kept_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* {  // r = head * m + i
      const std::int64_t h = r / m, i = r % m;
      return t.row(keep.slots[(per_head ? h * m : 0) + i], std::int32_t(h));
    };
    const auto buf_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* { return buf + r * row_bytes; };
    const auto new_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* { return t.row(r % m, std::int32_t(r / m)); };
    detail::copy_rows_widest(launch, heads * m, row_bytes, word, kept_row, buf_row, st);
    detail::copy_rows_widest(launch, heads * m, row_bytes, word, buf_row, new_row, st);
  }
  if (tokens == nullptr) return;
  const std::int64_t lists = n_tokens == n ? 1 : heads;
  auto* tb = c.take<token>(lists * m);
  launch.for_each(lists * m, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    if (*st != status_ok) return;
    const std::int64_t h = x / m, i = x % m;
    tb[x] = tokens[h * n + keep.slots[(per_head ? h * m : 0) + i]];
  });
  launch.for_each(lists * m, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    if (*st == status_ok) tokens[x] = tb[x];
  });
}

/// Keeps the slots of `keep` (`m` per unit) in H2O's state, compacted to the front as the cache
/// is (cpu::h2o_state::evict): the state's rows are [heads][ld] tensors of one f32 per slot.
template <class L>
void h2o_evict_steps(const L& launch, h2o_state_view& st, const_keep_view keep, std::int64_t m,
                     std::span<std::byte> scratch) {
  const auto rows = [&](float* p) { return tensor_view{p, dtype::f32, st.n_slots, st.heads, 1, 1, st.ld}; };
  compact_steps(launch, rows(st.acc), rows(st.life), nullptr, 0, keep, m, scratch);
  compact_steps(launch, rows(st.score), tensor_view{}, nullptr, 0, keep, m, scratch);
  st.n_slots = m;
}

/// Compacts sequence `seq` of a paged cache (one unit for all heads; the sequence holds `n`
/// slots): kept rows move to the front of its pages through the scratch, the page table drops
/// the pages no longer needed (later sequences' indices shift down) and their ids go to `freed`
/// (pages_freed(n, m) entries). A table whose sequence does not hold n slots, or a bad keep set,
/// changes nothing (status bad_pages / bad_keep).
template <class L>
void compact_paged_steps(const L& launch, paged_view p, std::int32_t seq, std::int64_t n, token* tokens,
                         const_keep_view keep, std::int64_t m, std::int32_t* freed, std::span<std::byte> scratch) {
  status_word* st = reinterpret_cast<status_word*>(scratch.data());
  launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) {
    *st = status_ok;
    if (p.seq_len(seq) != n) detail::record(st, encode(fault::bad_pages, 0, 0, n));
    for (std::int32_t i = p.indptr[seq]; i < p.indptr[seq + 1]; ++i)
      if (p.indices[i] < 0 || p.indices[i] >= p.n_pages) detail::record(st, encode(fault::bad_pages, 1, 0, i));
  });
  detail::check_keep(launch, keep, m, st);
  const std::int64_t heads = p.n_heads, row_bytes = p.head_dim * std::int64_t(size_of(p.type));
  const paged_rows kr{p.k, p.indices, p.type, n, p.n_heads, p.head_dim, p.page_size};
  paged_rows vr = kr;
  vr.store = p.v;
  const std::int32_t* indptr = p.indptr;
  detail::carver c{scratch.data(), 64};
  for (const paged_rows& t : {kr, vr}) {
    if (t.empty()) continue;
    auto* buf = c.take<std::byte>(m * heads * row_bytes);
    const std::int64_t es = std::int64_t(size_of(t.type));
    const int word = detail::word_bytes(
        row_bytes, {std::uint64_t(reinterpret_cast<std::uintptr_t>(t.store.data)),
                    std::uint64_t(t.store.page_stride * es), std::uint64_t(t.store.slot_stride * es),
                    std::uint64_t(t.store.head_stride * es), std::uint64_t(reinterpret_cast<std::uintptr_t>(buf))});
    const auto row_of = [=] INFKV_HOST_DEVICE(std::int64_t slot, std::int64_t h) -> void* {
      paged_rows r = t;
      r.pages = t.pages + indptr[seq];  // this sequence's pages
      return r.row(slot, std::int32_t(h));
    };
    const auto kept_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* { return row_of(keep.slots[r % m], r / m); };
    const auto buf_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* { return buf + r * row_bytes; };
    const auto new_row = [=] INFKV_HOST_DEVICE(std::int64_t r) -> void* { return row_of(r % m, r / m); };
    detail::copy_rows_widest(launch, heads * m, row_bytes, word, kept_row, buf_row, st);
    detail::copy_rows_widest(launch, heads * m, row_bytes, word, buf_row, new_row, st);
  }
  auto* tb = c.take<token>(m);
  launch.for_each(m, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    if (*st == status_ok) tb[i] = tokens[keep.slots[i]];
  });
  launch.for_each(m, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    if (*st == status_ok) tokens[i] = tb[i];
  });
  launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) {  // the table: one thread, in order
    if (*st != status_ok) return;
    const std::int32_t before = p.indptr[seq + 1] - p.indptr[seq],
                       after = std::int32_t((m + p.page_size - 1) / p.page_size);
    const std::int32_t drop = before - after, end = p.indptr[p.n_seqs];
    for (std::int32_t i = 0; i < drop; ++i) freed[i] = p.indices[p.indptr[seq] + after + i];
    for (std::int32_t i = p.indptr[seq + 1]; i < end; ++i) p.indices[i - drop] = p.indices[i];
    for (std::int32_t s = seq + 1; s <= p.n_seqs; ++s) p.indptr[s] -= drop;
    p.last_page_len[seq] = m == 0 ? 0 : std::int32_t(m - std::int64_t(after - 1) * p.page_size);
  });
}

/// Rotates every head of slot j of the (post-RoPE) keys by delta[j] positions (compact position
/// mode; cpu::rerotate's semantics): one thread per (slot, frequency pair), heads in a loop.
template <class L, row_source R>
void rerotate_steps(const L& launch, const R& keys, const std::int64_t* delta, const rope& r) {
  validate(keys, "keys");
  const std::int32_t dims = r.checked_dims(keys.head_dim);
  const std::int32_t half = dims / 2;
  const rope rot = r;
  launch.for_each(keys.n_slots * half, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t j = x / half, dp = delta[j];
    const auto i = std::int32_t(x % half);
    if (dp == 0) return;
    const double a = double(dp) * rope_frequency(rot, i, dims);
    const auto cs = float(cos(a)), sn = float(sin(a));
    std::int32_t ea = 0, eb = 0;
    rope_pair(rot.style, i, dims, ea, eb);
    for (std::int32_t h = 0; h < keys.n_heads; ++h) {
      void* row = keys.row(j, h);
      const float x0 = detail::load(keys.type, row, ea), x1 = detail::load(keys.type, row, eb);
      detail::store(keys.type, row, ea, x0 * cs - x1 * sn);
      detail::store(keys.type, row, eb, x0 * sn + x1 * cs);
    }
  });
}

}  // namespace infkv::cuda
