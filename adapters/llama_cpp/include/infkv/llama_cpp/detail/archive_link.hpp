// infkv llama.cpp adapter: a session's archive and its route to llama.cpp's rows. llama.h reads
// and writes a cache's K and V only as one sequence's serialised state (kv_state.hpp), so every
// transfer goes through a scratch sequence: the cells to read are shared into it and its state
// read; rows to restore are written into a state and restored into it, then shared into the
// session's sequence. The scratch sequence is empty again after every call.
//
// A model with sliding-window layers (llama.cpp's iSWA cache: the global layers' cache and the
// sliding layers') is archived layer by layer as the policies score it: the global layers' rows
// are llama.cpp's own, read from the first cache's part of the state; the sliding layers' are the
// session's copies (the second cache holds only the cells within the window of a sequence's
// newest position, so it cannot give every archived token's rows). A recall writes the global
// layers' rows back into llama.cpp and the sliding layers' into the copies only: the session
// recalls on such a model only tokens older than the window (recall_options::below), which a
// sliding layer never attends to again, so llama.cpp's cache is what a full cache would hold for
// them in every layer.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <llama.h>

#include <infkv/cpu/archive.hpp>
#include <infkv/cpu/recall.hpp>
#include <infkv/error.hpp>
#include <infkv/keep_set.hpp>

#include "../model_info.hpp"
#include "../session_options.hpp"
#include "kv_state.hpp"

namespace infkv::llama_cpp::detail {

/// The context, its memory and calls, the session's sequence and the scratch one.
struct cache_route {
  llama_context* ctx = nullptr;
  llama_memory_t mem = nullptr;
  const memory_calls* calls = nullptr;
  llama_seq_id seq = 0, scratch = -1;

  /// Shares `seq`'s cells in `runs` into the scratch sequence, reads their state into `buf` and
  /// empties the scratch sequence again; the bytes llama.cpp wrote (buf.size() when all).
  std::size_t read_state(std::span<const position_run> runs, std::vector<std::uint8_t>& buf) const {
    for (const auto& run : runs) calls->seq_cp(mem, seq, scratch, llama_pos(run.begin), llama_pos(run.end));
    buf.resize(llama_state_seq_get_size(ctx, scratch));
    const std::size_t got = calls->state_get(ctx, buf.data(), buf.size(), scratch);
    clear_scratch();
    return got;
  }

  /// Empties the scratch sequence; throws when the memory refuses.
  void clear_scratch() const {
    if (!calls->seq_rm(mem, scratch, -1, -1))
      infkv::raise<engine_error>("infkv: llama_memory_seq_rm(seq = ", scratch,
                                 ", -1, -1) = false: the archive's scratch sequence could not be emptied");
  }
};

/// The session's slots at positions from `from` on, as (position, slot) ascending.
inline std::vector<std::pair<std::int64_t, std::int64_t>> slots_by_position(
    std::span<const token> tokens, std::int64_t from = std::numeric_limits<std::int64_t>::min()) {
  std::vector<std::pair<std::int64_t, std::int64_t>> by_pos;
  for (std::size_t s = 0; s < tokens.size(); ++s)
    if (tokens[s].pos >= from) by_pos.push_back({tokens[s].pos, std::int64_t(s)});
  std::sort(by_pos.begin(), by_pos.end());
  return by_pos;
}

/// Each cell's slot of the state part `st` (in `buf`), from `by_pos` (slots_by_position); -1
/// where no slot lies at the cell's position.
inline std::vector<std::int64_t> cell_slots(std::span<const std::uint8_t> buf, const kv_state& st,
                                            std::span<const std::pair<std::int64_t, std::int64_t>> by_pos) {
  std::vector<std::int64_t> slot(static_cast<std::size_t>(st.cells));
  for (std::int64_t c = 0; c < st.cells; ++c) {
    const std::int64_t pos = st.pos(buf, c);
    const auto it = std::lower_bound(by_pos.begin(), by_pos.end(), std::pair<std::int64_t, std::int64_t>{pos, -1});
    slot[std::size_t(c)] = it != by_pos.end() && it->first == pos ? it->second : -1;
  }
  return slot;
}

/// The global layers of a model with sliding-window layers, in the model's order (llama.h does
/// not say which layers slide): `first` (the first part of the state in `buf`) holds the global
/// layers' rows in the model's order, so each of the `n_layers` model layers in turn is the next
/// of them when its key rows in `copies` (the session's inputs; cell c of `first` is slot
/// slot[c]) are that layer's rows for every cell, within the rounding of the coarser of the two
/// types (bf16's 2^-8 of the largest element), and a sliding layer otherwise. Throws
/// engine_error when fewer than the part's layers match.
inline std::vector<std::int32_t> global_layers_of(std::span<const std::uint8_t> buf, const kv_state& first,
                                                  std::span<const std::int64_t> slot,
                                                  std::span<const layer_inputs<const_paged_rows>> copies,
                                                  std::int32_t n_layers, std::int32_t kv_heads, std::int32_t head_dim) {
  const std::int32_t n_global = std::int32_t(first.layers.size());
  const std::int64_t E = std::int64_t(kv_heads) * head_dim, m = std::int64_t(slot.size());
  INFKV_REQUIRE(std::int32_t(copies.size()) == n_layers, "copies.size()", copies.size(), "must be the model's ",
                n_layers, " layers");
  INFKV_REQUIRE(first.cells == m, "slot.size()", m, "must be the state's ", first.cells, " cells");
  std::vector<float> want(static_cast<std::size_t>(E)), got(static_cast<std::size_t>(E));
  const auto same = [&](std::int32_t l, std::int32_t j) {
    const auto& sl = first.layers[std::size_t(j)];
    const auto& c = copies[std::size_t(l)].keys;
    if (c.empty() || c.n_heads != kv_heads || c.head_dim != head_dim) return false;
    float diff = 0.f, mag = 0.f;
    for (std::int64_t i = 0; i < m; ++i) {
      if (slot[std::size_t(i)] < 0 || slot[std::size_t(i)] >= c.n_slots) return false;
      to_f32(sl.k_type, buf.data() + first.k_row(j, i), want.data(), E);
      for (std::int32_t h = 0; h < kv_heads; ++h)
        to_f32(c.type, c.row(slot[std::size_t(i)], h), got.data() + h * head_dim, head_dim);
      for (std::int64_t e = 0; e < E; ++e)
        diff = std::max(diff, std::abs(got[std::size_t(e)] - want[std::size_t(e)])),
        mag = std::max(mag, std::abs(want[std::size_t(e)]));
    }
    return mag > 0.f && diff <= mag * 0x1p-8f;
  };
  std::vector<std::int32_t> global;
  for (std::int32_t l = 0; l < n_layers; ++l)
    if (std::int32_t(global.size()) < n_global && same(l, std::int32_t(global.size()))) global.push_back(l);
  if (std::int32_t(global.size()) != n_global)
    infkv::raise<engine_error>("infkv: found ", global.size(), " of the ", n_global,
                               " global layers of llama.cpp's first cache among the session's key copies: which "
                               "layers slide cannot be told");
  return global;
}

/// The archive (per_token pages of every layer), written through: every slot the stream wrote
/// is archived, in pages of consecutive positions, before the first eviction that could remove
/// it; a recall copies rows back and the pages stay. Positions below `archived_to()` are archived.
class archive_link {
 public:
  archive_link(const llama_model* model, const archive_options& o)
      : store_(shape_of(model), o), two_caches_(llama_model_n_swa(model) > 0) {}

  infkv::archive& store() { return store_; }
  const infkv::archive& store() const { return store_; }
  /// Bytes held: the archive and the transfer buffers.
  std::int64_t bytes() const {
    return std::int64_t(store_.memory() + state_.capacity() + template_.capacity() + scratch_.capacity() +
                        (staged_.capacity() + vrows_.capacity() + krows_.capacity()) * sizeof(float));
  }
  /// The first position not archived yet.
  std::int64_t archived_to() const { return archived_to_; }

  /// Archives the rows of the session's cached `tokens` whose `origins` (the stream's positions:
  /// the tokens' own in keep mode) are archived_to() or later (all of them are cached: nothing
  /// leaves before it is archived; they are the newest), in time order, cut into pages of
  /// page_tokens: llama.cpp's rows, and on a model with sliding-window layers those layers' rows
  /// from `copies` (the session's inputs of every layer, one slot per token). The archive holds
  /// each token at its origin, its keys turned there (with each layer's `copies[l].rotary`)
  /// when compaction moved it.
  void archive_new(const cache_route& r, std::span<const token> tokens, std::span<const std::int64_t> origins,
                   std::span<const layer_inputs<const_paged_rows>> copies) {
    std::int64_t from = std::numeric_limits<std::int64_t>::max();  // the first position to archive
    for (std::size_t s = 0; s < tokens.size(); ++s)
      if (origins[s] >= archived_to_) from = std::min(from, tokens[s].pos);
    const auto by_pos = slots_by_position(tokens, from);  // the slots to archive
    if (by_pos.empty()) return;
    const std::int64_t m = std::int64_t(by_pos.size()), end = by_pos.back().first + 1, E = row_elems();
    const position_run run{from, end};
    const kv_state st = read_cells(r, {&run, 1}, state_);
    if (st.cells != m)
      infkv::raise<engine_error>("infkv: llama.cpp holds ", st.cells, " cells at positions [", run.begin, ", ", run.end,
                                 "), the session ", m, " slots (slots sharing a position?): nothing was archived");
    std::vector<token> toks(static_cast<std::size_t>(m));
    std::vector<std::int64_t> turn(static_cast<std::size_t>(m));            // each cell's turn to its origin
    const std::vector<std::int64_t> slot = cell_slots(state_, st, by_pos);  // each cell's slot in the session
    for (std::int64_t c = 0; c < m; ++c) {
      if (slot[std::size_t(c)] < 0)
        infkv::raise<engine_error>("infkv: llama.cpp's cell at position ", st.pos(state_, c),
                                   " is not a slot of the session: nothing was archived");
      const auto sl = std::size_t(slot[std::size_t(c)]);
      if (origins[sl] < archived_to_)
        infkv::raise<engine_error>("infkv: the session's slot at position ", tokens[sl].pos, " (origin ", origins[sl],
                                   ") is archived already, yet newer than the first slot to archive: nothing was "
                                   "archived");
      toks[std::size_t(c)] = tokens[sl], toks[std::size_t(c)].pos = origins[sl];
      turn[std::size_t(c)] = origins[sl] - tokens[sl].pos;
    }
    if (two_caches_ && global_.empty()) map_layers(st, slot, copies);
    const std::int32_t L = layers(), H = store_.shape().kv_heads, d = store_.shape().head_dim;
    // V rows out of a transposed state, and the sliding layers' K and V rows
    vrows_.assign(st.v_trans || two_caches_ ? std::size_t(L * m * E) : 0, 0.f);
    krows_.assign(two_caches_ ? std::size_t(L * m * E) : 0, 0.f);
    std::vector<layer_inputs<const_tensor_view>> in(static_cast<std::size_t>(L));
    for (std::int32_t l = 0; l < L; ++l) {
      auto& li = in[std::size_t(l)];
      li.tokens = toks;
      const std::int32_t j = state_layer(l);
      if (j < 0) {  // a sliding layer: the session's copies (values zero where the session keeps none)
        const auto& c = copies[std::size_t(l)];
        float* k = krows_.data() + std::size_t(l * m * E);
        float* v = vrows_.data() + std::size_t(l * m * E);
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int32_t h = 0; h < H; ++h) {
            to_f32(c.keys.type, c.keys.row(slot[std::size_t(i)], h), k + i * E + h * d, d);
            if (!c.values.empty()) to_f32(c.values.type, c.values.row(slot[std::size_t(i)], h), v + i * E + h * d, d);
          }
        li.keys = nhd(static_cast<const void*>(k), dtype::f32, m, H, d);
        li.values = nhd(static_cast<const void*>(v), dtype::f32, m, H, d);
        continue;
      }
      const auto& sl = st.layers[std::size_t(j)];
      li.keys = nhd(static_cast<const void*>(state_.data() + sl.k_at), sl.k_type, m, H, d);
      if (std::ranges::any_of(turn, [](std::int64_t t) { return t != 0; })) {
        INFKV_REQUIRE(
            copies[std::size_t(l)].rotary.has_value(), "layer " + std::to_string(l) + " rotary", "unset",
            "compacted positions are turned back to the stream's for the archive: the layer's RoPE is needed");
        cpu::rerotate(nhd(static_cast<void*>(state_.data() + sl.k_at), sl.k_type, m, H, d), turn,
                      *copies[std::size_t(l)].rotary);
      }
      if (!st.v_trans) {
        li.values = nhd(static_cast<const void*>(state_.data() + sl.v_at), sl.v_type, m, H, d);
        continue;
      }
      float* v = vrows_.data() + std::size_t(l * m * E);
      for (std::int64_t c = 0; c < m; ++c)
        for (std::int64_t e = 0; e < E; ++e) to_f32(sl.v_type, state_.data() + st.v_elem(j, c, e), v + c * E + e, 1);
      li.values = nhd(static_cast<const void*>(v), dtype::f32, m, H, d);
    }
    keep_set none(m);
    none.add_unit({});
    scratch_.resize(cpu::archive_scratch_bytes(store_, m));
    cpu::archive_evicted(store_, std::span<const layer_inputs<const_tensor_view>>(in), none, scratch_, 0);
    for (const token& t : toks) archived_to_ = std::max(archived_to_, t.pos + 1);
  }

  /// Whether llama.cpp keeps the model's layers in two caches (sliding-window layers: iSWA).
  bool two_caches() const { return two_caches_; }
  /// With two caches: the global layers, in the model's order (known from the first archive on).
  const std::vector<std::int32_t>& global_layers() const { return global_; }

  /// Stages the rows (f32) and tokens of the archived tokens `recalled`; the pages stay.
  std::span<const token> stage(std::span<const cpu::archived_token> recalled) {
    const std::int32_t L = layers(), H = store_.shape().kv_heads, d = store_.shape().head_dim;
    const std::int64_t E = row_elems(), m = std::int64_t(recalled.size());
    staged_.assign(std::size_t(2 * L * m * E), 0.f);
    back_.resize(std::size_t(m));  // staged() reads the staged count from back_
    for (std::int64_t c = 0; c < m; ++c) {
      const auto& x = recalled[std::size_t(c)];
      back_[std::size_t(c)] = store_.tokens(x.page)[std::size_t(x.index)];
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int32_t h = 0; h < H; ++h) {
          cpu::dequantize(store_, x.page, l * H + h, x.index, false, staged(false, l) + c * E + h * d);
          cpu::dequantize(store_, x.page, l * H + h, x.index, true, staged(true, l) + c * E + h * d);
        }
    }
    return back_;
  }
  /// Layer l's staged keys (or values): [staged slots][KV heads][head_dim] f32.
  float* staged(bool values, std::int32_t l) {
    return staged_.data() + ((values ? std::int64_t(layers()) : 0) + l) * std::int64_t(back_.size()) * row_elems();
  }

  /// Reads the state of the session's cells in `runs` (the slots a recall displaces, as many as
  /// it stages) as the template write_back fills.
  void read_template(const cache_route& r, std::span<const position_run> runs) {
    const kv_state st = read_cells(r, runs, template_);
    if (st.cells != std::int64_t(back_.size()))
      infkv::raise<engine_error>("infkv: recall: llama.cpp holds ", st.cells, " cells at the ", back_.size(),
                                 " displaced slots' positions: nothing was recalled");
  }

  /// Writes the staged rows at their positions (`at`, when given: the compacted positions they
  /// land at, their keys turned there) into the template (read_template), restores it into
  /// the scratch sequence and shares its cells into the session's: every layer's rows, or on a
  /// model with sliding-window layers the global layers' (the sliding layers' cache gets no
  /// cell). When llama.cpp refuses, engine_error says the cache holds that many slots fewer
  /// (their rows stay archived).
  void write_back(const cache_route& r, std::span<const std::int64_t> at = {}) {
    const std::int32_t L = layers();
    const std::int64_t m = std::int64_t(back_.size()), E = row_elems();
    const kv_state st = parse(template_)[0];
    if (two_caches_) {  // the sliding layers' part: no cell
      template_.resize(st.end);
      for (const std::uint32_t w : {1u, 0u}) {  // n_stream, cell_count
        const auto* b = reinterpret_cast<const std::uint8_t*>(&w);
        template_.insert(template_.end(), b, b + sizeof w);
      }
    }
    for (std::int64_t c = 0; c < m; ++c) {
      const auto pos = std::int32_t(at.empty() ? back_[std::size_t(c)].pos : at[std::size_t(c)]);
      std::memcpy(template_.data() + st.pos_at[std::size_t(c)], &pos, sizeof pos);
      for (std::int32_t l = 0; l < L; ++l) {
        const std::int32_t j = state_layer(l);
        if (j < 0) continue;
        const auto& sl = st.layers[std::size_t(j)];
        from_f32(sl.k_type, staged(false, l) + c * E, template_.data() + st.k_row(j, c), E);
        const float* v = staged(true, l) + c * E;
        if (!st.v_trans)
          from_f32(sl.v_type, v, template_.data() + st.v_elem(j, c, 0), E);
        else
          for (std::int64_t e = 0; e < E; ++e) from_f32(sl.v_type, v + e, template_.data() + st.v_elem(j, c, e), 1);
      }
    }
    const std::size_t put = r.calls->state_set(r.ctx, template_.data(), template_.size(), r.scratch);
    if (put != template_.size()) {
      r.clear_scratch();
      infkv::raise<engine_error>("infkv: llama_state_seq_set_data(seq = ", r.scratch, ") = ", put, " of ",
                                 template_.size(), " bytes: the recalled rows could not be written; the cache holds ",
                                 m, " slots fewer (they stay archived)");
    }
    r.calls->seq_cp(r.mem, r.scratch, r.seq, -1, -1);
    r.clear_scratch();
  }

 private:
  static archive_shape shape_of(const llama_model* model) {
    const std::int32_t q_heads = llama_model_n_head(model);
    const auto arch = meta_string(model, "general.architecture").value_or("");
    const auto head_dim = std::int32_t(
        meta_number(model, arch + ".attention.key_length", double(llama_model_n_embd(model) / std::max(1, q_heads))));
    return {llama_model_n_layer(model), llama_model_n_head_kv(model), head_dim, granularity::per_token};
  }
  std::int32_t layers() const { return store_.shape().n_layers; }
  std::vector<kv_state> parse(std::span<const std::uint8_t> b) const {
    return parse_kv_states(b, layers(), row_elems(), two_caches_);
  }
  /// Model layer l's index among the layers of the state's first part, or -1 for a sliding layer.
  std::int32_t state_layer(std::int32_t l) const {
    if (!two_caches_) return l;
    const auto it = std::lower_bound(global_.begin(), global_.end(), l);
    return it != global_.end() && *it == l ? std::int32_t(it - global_.begin()) : -1;
  }

  /// Tells the global layers from the sliding ones (global_layers_of) at the first archive.
  void map_layers(const kv_state& st, std::span<const std::int64_t> slot,
                  std::span<const layer_inputs<const_paged_rows>> copies) {
    global_ = global_layers_of(state_, st, slot, copies, layers(), store_.shape().kv_heads, store_.shape().head_dim);
  }

  std::int64_t row_elems() const { return std::int64_t(store_.shape().kv_heads) * store_.shape().head_dim; }

  /// Reads llama.cpp's rows of the session's cells in `runs` into `buf` and parses them.
  kv_state read_cells(const cache_route& r, std::span<const position_run> runs, std::vector<std::uint8_t>& buf) {
    const std::size_t got = r.read_state(runs, buf), n = buf.size();
    if (got != n)
      infkv::raise<engine_error>("infkv: llama_state_seq_get_data(seq = ", r.scratch, ") = ", got, " of ", n,
                                 " bytes: the cache's rows could not be read for the archive");
    auto parts = parse(buf);
    return std::move(parts[0]);
  }

  infkv::archive store_;
  std::vector<std::uint8_t> state_;     // the state of the cells archived last
  std::vector<std::uint8_t> template_;  // a recall's: the displaced cells' state, filled by write_back
  std::int64_t archived_to_ = 0;        // the first position not archived yet
  std::vector<float> staged_;           // a recall's rows: [K | V][layer][slot][E]
  std::vector<token> back_;             // their tokens
  bool two_caches_ = false;             // llama.cpp's iSWA cache: the global layers' part, then the sliding ones'
  std::vector<std::int32_t> global_;    // its global layers in the model's order (known at the first archive)
  std::vector<float> vrows_;            // V rows out of a transposed state, and the sliding layers'
  std::vector<float> krows_;            // the sliding layers' K rows
  std::vector<std::byte> scratch_;      // archive_evicted's
};

}  // namespace infkv::llama_cpp::detail
