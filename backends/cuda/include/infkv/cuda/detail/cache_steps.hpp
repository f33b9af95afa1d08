// infkv CUDA backend: steps on the cache itself, after a decision: H2O's accumulation step and its
// eviction, compaction of strided and paged caches (in place, phase by phase through a bounded
// scratch: two launches a phase, one phase at the reference size), and RoPE re-rotation. Run by a launcher, as the
// primitives in steps.hpp are; every step records faults in the caller's status word and changes nothing once it holds
// one.
#pragma once

#include <initializer_list>

#include "../cache.hpp"
#include "steps.hpp"

namespace infkv::cuda {

/// Scratch h2o_observe_steps needs for a layer of `shape` (every query of the layer observed).
template <class L>
std::size_t h2o_scratch_bytes(const layer_shape& shape) {
  const score_spec spec{.source = score_source::window_attention, .queries = shape.n_queries};
  detail::carver c{nullptr, basic_backend<L>{}.scratch_bytes(spec, shape)};
  c.take<float>(std::int64_t(shape.kv_heads) * shape.n_slots), c.take<float>(shape.n_slots);
  return c.size();
}

/// One decode step (or prefill chunk) of H2O (cpu::observe's semantics): the attention every
/// query of `in` gives the cached keys (mean over each KV head's query heads), and per slot how
/// many of those queries could see it; acc = acc x forgetting + mass, life += seen, score = acc
/// (or acc / max(life, 1) with normalize_lifetime). The state must already hold in's slots.
template <class L, row_source R>
void h2o_observe_steps(const L& launch, status_word* status, const h2o_state_view& st, const h2o& cfg,
                       const layer_inputs<R>& in, std::span<std::byte> scratch) {
  cfg.validate();
  const std::int64_t n = in.keys.n_slots, nq = in.queries.n_slots;
  INFKV_REQUIRE(st.heads == in.keys.n_heads && st.n_slots == n && st.ld >= n, "h2o_state_view.n_slots", st.n_slots,
                "the state must hold the layer's ", n, " slots of ", in.keys.n_heads, " KV heads; heads = ", st.heads,
                ", ld = ", st.ld);
  INFKV_REQUIRE(std::int64_t(in.tokens.size()) == n, "tokens.size()", in.tokens.size(), "must equal keys.n_slots (", n,
                ")");
  const basic_backend<L> be{launch};
  const std::size_t after = be.scratch_bytes({.source = score_source::window_attention, .queries = nq}, shape_of(in));
  detail::carver c{scratch.data(), after};
  const score_view mass{c.take<float>(st.heads * n), st.heads, n, n};
  float* seen = c.take<float>(n);
  detail::window_attention_steps(launch, status, in, nq, false, mass, scratch, 0, be.window_tile_limit);
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
    if (*status != status_ok) return;  // a NaN key or query (or an earlier fault) changes nothing
    const std::int64_t h = x / n, j = x % n, i = h * s.ld + j;
    s.acc[i] = s.acc[i] * keep + mass(h, j);
    s.life[i] += seen[j];
    s.score[i] = normalize ? s.acc[i] / fmaxf(s.life[i], 1.f) : s.acc[i];
  });
}

namespace detail {

/// Whether entry x of a keep set of `units` units of `m` slots each over `n` slots is wrong
/// (x < units m: slot x, strictly increasing within its unit, in [0, n); x = units m: the offsets,
/// u m each); records bad_keep. keep_items(keep, m) entries in all.
INFKV_HOST_DEVICE inline std::int64_t keep_items(const_keep_view keep, std::int64_t m) {
  return keep.n_units * (m > 1 ? m : 1) + 1;
}
INFKV_HOST_DEVICE inline void check_keep_item(const_keep_view keep, std::int64_t m, std::int64_t x, status_word* st) {
  const std::int64_t n = keep.n_slots;
  if (x == keep.n_units * (m > 1 ? m : 1)) {
    for (std::int64_t u = 0; u <= keep.n_units; ++u)
      if (keep.offsets[u] != u * m) record(st, encode(fault::bad_keep, u, 0, keep.offsets[u]));
    return;
  }
  if (m == 0) return;
  const std::int64_t u = x / m, k = x % m, s = keep.slots[u * m + k];
  if (s < 0 || s >= n || (k > 0 && s <= keep.slots[u * m + k - 1]))
    record(st, encode(fault::bad_keep, u, 0, u * m + k));
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

/// What one phase of a compaction moves: slots [a, b) of K and V (every head, both planes) and
/// entries [ta, tb) of the token lists (flattened: entry f = h m + i of list h comes from
/// h n + slots[i], lists packed from n to m entries each), through `buf` and `tbuf`.
struct compact_phase {
  std::int64_t a, b, ta, tb;
  std::byte* buf;
  token* tbuf;
};

/// One launch of a compaction phase (gather, then move). Destinations only move forward (a kept
/// slot i comes from slots[i] >= i) and phases run in order, so a phase only overwrites rows no
/// later phase reads; within it, only a row whose source lies in [a, b) (a destination of this
/// phase) can be overwritten before it is read: `gather` copies exactly those rows to the
/// scratch, the move writes them from there and every other row from its source (rows already in
/// place are not touched). The token lists alike. With `check` (the first gather), the launch
/// also checks the keep set (the gather writes only the scratch and reads only rows of [a, b), so
/// a bad keep set reads nothing out of bounds; every move comes a launch later and does nothing
/// once bad_keep is recorded). Indices of K and V inside the launch are 32-bit.
template <class W, class L, row_source R>
void compact_launch(const L& launch, const R& k, const R& v, token* tokens, std::int64_t n, const_keep_view keep,
                    std::int64_t m, const compact_phase& ph, std::int64_t row_bytes, bool gather, bool check,
                    status_word* st) {
  const auto words = std::uint32_t(row_bytes / std::int64_t(sizeof(W))), len = std::uint32_t(ph.b - ph.a),
             heads = std::uint32_t(k.n_heads), planes = v.empty() ? 1u : 2u;
  const std::int64_t checks = check ? keep_items(keep, m) : 0;
  const std::int64_t kv = std::int64_t(planes) * heads * len * words;  // < 2^32: checked by compact_steps
  const bool per_head = keep.n_units > 1;
  const compact_phase p = ph;
  const std::int64_t moves = kv + (p.tb - p.ta);
  // The checks come last in the index space: a host launcher, which runs it in order, moves rows
  // before it checks, so a check that did not come one launch before the moves shows in tests.
  launch.for_each(moves + checks, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    if (x >= moves) return check_keep_item(keep, m, x - moves, st);
    if (*st != status_ok) return;  // a bad keep set, or an earlier fault: nothing moves
    if (x < kv) {
      const auto x32 = std::uint32_t(x), w = x32 % words, row = x32 / words, r = row % len, hp = row / len;
      const std::uint32_t h = hp % heads, pl = hp / heads;
      const std::int64_t i = p.a + r, from = keep.slots[(per_head ? std::int64_t(h) * m : 0) + i];
      W* stage = reinterpret_cast<W*>(p.buf + (std::int64_t(hp) * len + r) * row_bytes) + w;
      const R& t = pl == 0 ? k : v;
      if (from == i) return;
      if (gather) {
        if (from >= p.a && from < p.b) *stage = static_cast<const W*>(t.row(from, std::int32_t(h)))[w];
      } else {
        static_cast<W*>(t.row(i, std::int32_t(h)))[w] =
            from < p.b ? *stage : static_cast<const W*>(t.row(from, std::int32_t(h)))[w];
      }
      return;
    }
    const std::int64_t f = p.ta + (x - kv), h = f / m;
    const std::int64_t src = h * n + keep.slots[(per_head ? h * m : 0) + f % m];
    if (src == f) return;
    if (gather) {
      if (src >= p.ta && src < p.tb) p.tbuf[f - p.ta] = tokens[src];
    } else {
      tokens[f] = src < p.tb ? p.tbuf[f - p.ta] : tokens[src];
    }
  });
}

}  // namespace detail

/// Compacts K, V (V may be empty; both strided views or both one sequence's paged rows) and
/// tokens in place: unit u (or unit 0 for all heads) of `keep`, `m` slots per unit, moves to
/// slots [0, m) in increasing slot order, phase by phase through a bounded scratch (one chunk of
/// K and V rows and one of token entries per phase, two launches each: compact_launch; the keep
/// set checked in the first). `tokens` holds n_slots entries (one list) or heads x n_slots (one
/// list per head, packed to heads x m), or is null. Nothing moves when the keep set is
/// inconsistent (bad_keep is recorded) or the status word already holds a fault.
template <class L, row_source R>
void compact_steps(const L& launch, status_word* st, const R& k, const R& v, token* tokens, std::int64_t n_tokens,
                   const_keep_view keep, std::int64_t m, std::span<std::byte> scratch,
                   std::int64_t limit = compact_scratch_limit) {
  const std::int64_t heads = k.n_heads, row_bytes = k.head_dim * std::int64_t(size_of(k.type)), n = k.n_slots;
  const auto chunks = detail::compact_chunks::of(m, k.n_heads, row_bytes, limit);
  INFKV_REQUIRE(2 * heads * chunks.slots * (row_bytes / 2) < (std::int64_t(1) << 32), "k.head_dim", k.head_dim,
                "one slot's K and V rows of ", heads, " heads must span fewer than 2^32 16-bit words");
  std::byte* buf = scratch.data();
  std::uint64_t all = reinterpret_cast<std::uintptr_t>(buf);
  for (const R* t : {&k, &v}) {
    if (t->empty()) continue;
    const std::int64_t es = std::int64_t(size_of(t->type));
    if constexpr (requires { t->store; })
      all |= std::uint64_t(reinterpret_cast<std::uintptr_t>(t->store.data)) | std::uint64_t(t->store.page_stride * es) |
             std::uint64_t(t->store.slot_stride * es) | std::uint64_t(t->store.head_stride * es);
    else
      all |= std::uint64_t(reinterpret_cast<std::uintptr_t>(t->data)) | std::uint64_t(t->slot_stride * es) |
             std::uint64_t(t->head_stride * es);
  }
  const int word = detail::word_bytes(row_bytes, {all});
  const std::int64_t entries = tokens == nullptr ? 0 : (n_tokens == n ? 1 : heads) * m;
  const std::int64_t phases =
      std::max({std::int64_t(1), (m + chunks.slots - 1) / chunks.slots, (entries + chunks.tokens - 1) / chunks.tokens});
  auto* tbuf = reinterpret_cast<token*>(buf + chunks.token_offset(std::int32_t(heads), row_bytes));
  for (std::int64_t c = 0; c < phases; ++c) {
    const std::int64_t a = std::min(m, c * chunks.slots), ta = std::min(entries, c * chunks.tokens);
    const detail::compact_phase ph{a,   std::min(m, a + chunks.slots), ta, std::min(entries, ta + chunks.tokens), buf,
                                   tbuf};
    for (const bool gather : {true, false}) {
      const bool check = c == 0 && gather;
      if (word == 16)
        detail::compact_launch<detail::w16>(launch, k, v, tokens, n, keep, m, ph, row_bytes, gather, check, st);
      else if (word == 8)
        detail::compact_launch<std::uint64_t>(launch, k, v, tokens, n, keep, m, ph, row_bytes, gather, check, st);
      else if (word == 4)
        detail::compact_launch<std::uint32_t>(launch, k, v, tokens, n, keep, m, ph, row_bytes, gather, check, st);
      else
        detail::compact_launch<std::uint16_t>(launch, k, v, tokens, n, keep, m, ph, row_bytes, gather, check, st);
    }
  }
}

/// Keeps the slots of `keep` (`m` per unit) in H2O's state, compacted to the front as the cache
/// is (cpu::h2o_state::evict): the state's rows are [heads][ld] tensors of one f32 per slot.
template <class L>
void h2o_evict_steps(const L& launch, status_word* st, h2o_state_view& s, const_keep_view keep, std::int64_t m,
                     std::span<std::byte> scratch) {
  const auto rows = [&](float* p) { return tensor_view{p, dtype::f32, s.n_slots, s.heads, 1, 1, s.ld}; };
  compact_steps(launch, st, rows(s.acc), rows(s.life), nullptr, 0, keep, m, scratch);
  compact_steps(launch, st, rows(s.score), tensor_view{}, nullptr, 0, keep, m, scratch);
  s.n_slots = m;
}

/// Rotates every head of slot j of the (post-RoPE) keys by delta[j] positions (compact position
/// mode; cpu::rerotate's semantics): one thread per (slot, frequency pair), heads in a loop.
template <class L, row_source R>
void rerotate_steps(const L& launch, const status_word* st, const R& keys, const std::int64_t* delta, const rope& r) {
  validate(keys, "keys");
  const std::int32_t dims = r.checked_dims(keys.head_dim);
  const std::int32_t half = dims / 2;
  const rope rot = r;
  launch.for_each(keys.n_slots * half, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t j = x / half, dp = delta[j];
    const auto i = std::int32_t(x % half);
    if (dp == 0 || *st != status_ok) return;  // after a fault (a compaction that did not move): nothing
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
