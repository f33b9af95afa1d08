// infkv CPU backend: the archive's steps on the host (the format and the store are the core's,
// infkv/archive.hpp): archiving what a keep set evicts, restoring a page's rows, bounding each
// page's logits for a set of queries. Recall over them: cpu/recall.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <infkv/archive.hpp>
#include <infkv/pipeline.hpp>

#include "backend.hpp"
#include "rope.hpp"

namespace infkv::cpu {

namespace detail {

/// Row r of a page: its layer offset and head offset within the page.
inline std::pair<std::int32_t, std::int32_t> page_row(const archive_shape& s, std::int32_t r) {
  return {r / s.heads_per_page(), r % s.heads_per_page()};
}

/// Quantizes the rows of (head h) at `slots[0, n)` of keys and values into one page row.
template <row_source R>
void quantize_row(const page_layout& L, std::uint8_t* dst, const R& keys, const R& values, std::int32_t h,
                  const std::int64_t* slots, std::int32_t n, float* buf) {
  const std::int32_t d = L.head_dim;
  for (std::int32_t t = 0; t < n; ++t) to_f32(keys.type, keys.row(slots[t], h), buf + std::int64_t(t) * d, d);
  auto* kp = reinterpret_cast<quant_params*>(dst + L.k_params);
  auto* kc = dst + L.k_codes;
  for (std::int32_t c = 0; c < d; ++c) {  // keys: per channel over the page's tokens
    float lo = buf[c], hi = buf[c];
    for (std::int32_t t = 1; t < n; ++t)
      lo = std::min(lo, buf[std::int64_t(t) * d + c]), hi = std::max(hi, buf[std::int64_t(t) * d + c]);
    const quant_params q = make_quant_params(lo, hi, L.k_bits);
    std::memcpy(kp + c, &q, sizeof q);
    const float l = f16_to_f32(q.lo), s = f16_to_f32(q.step);
    for (std::int32_t t = 0; t < n; ++t)
      set_code(kc, std::int64_t(t) * d + c, L.k_bits, quant_code(buf[std::int64_t(t) * d + c], l, s, L.k_bits));
  }
  auto* vp = reinterpret_cast<quant_params*>(dst + L.v_params);
  auto* vc = dst + L.v_codes;
  const std::int32_t g = L.v_group, groups = L.groups();
  for (std::int32_t t = 0; t < n; ++t) {  // values: per token over groups of channels
    to_f32(values.type, values.row(slots[t], h), buf, d);
    for (std::int32_t gi = 0; gi < groups; ++gi) {
      const float* x = buf + gi * g;
      const auto [mn, mx] = std::minmax_element(x, x + g);
      const quant_params q = make_quant_params(*mn, *mx, L.v_bits);
      std::memcpy(vp + std::int64_t(t) * groups + gi, &q, sizeof q);
      const float l = f16_to_f32(q.lo), s = f16_to_f32(q.step);
      for (std::int32_t c = 0; c < g; ++c)
        set_code(vc, std::int64_t(t) * d + gi * g + c, L.v_bits, quant_code(x[c], l, s, L.v_bits));
    }
  }
}

/// Throws unless every element of (slot, head h) of `rows` is finite and within f16's range.
template <row_source R>
void check_archivable(const R& rows, const char* name, std::int64_t slot, std::int32_t h, std::int32_t layer,
                      float* buf) {
  to_f32(rows.type, rows.row(slot, h), buf, rows.head_dim);
  for (std::int32_t c = 0; c < rows.head_dim; ++c)
    if (!(std::fabs(buf[c]) <= archive_max_abs))
      infkv::fail("infkv: layers[", layer, "].", name, " at slot ", slot, ", head ", h, ", channel ", c, " = ", buf[c],
                  ": an archived element must be finite with |x| <= 65504 (f16's range)");
}

}  // namespace detail

/// Scratch of archive_evicted for caches of `n_slots` slots, in bytes.
inline std::size_t archive_scratch_bytes(const archive& a, std::int64_t n_slots) {
  return infkv::detail::bytes_of([&](infkv::detail::carver& c) {
    c.take<std::int64_t>(n_slots), c.take<std::int64_t>(n_slots),
        c.take<float>(std::int64_t(a.options().page_tokens) * a.shape().head_dim);
  });
}

/// Archives what `keep` evicts from `layers` (one per archive layer for per_token, else the one
/// layer `layer`), all sharing `layers[0].tokens`: per decision unit, the evicted slots in time
/// order, cut into pages of page_tokens. Checks everything first (the shapes, every evicted
/// element finite and within f16's range, room under when_full::error): a failing call leaves
/// the archive unchanged. Returns the pages added. Uses only `scratch`
/// (archive_scratch_bytes); allocates nothing.
template <row_source R>
std::int64_t archive_evicted(archive& a, std::span<const layer_inputs<R>> layers, const_keep_view keep,
                             std::span<std::byte> scratch, std::int32_t layer = 0) {
  const archive_shape& s = a.shape();
  const std::int32_t n_layers = s.layers_per_page();
  INFKV_REQUIRE(std::int64_t(layers.size()) == n_layers, "layers.size()", layers.size(), "the archive takes ", n_layers,
                " layer(s) per eviction (", to_string(s.g), ")");
  INFKV_REQUIRE(s.g == granularity::per_token ? layer == 0 : layer >= 0 && layer < s.n_layers, "layer", layer,
                "must be in [0, ", s.g == granularity::per_token ? 1 : s.n_layers, ")");
  validate(keep);
  const auto tokens = layers[0].tokens;
  const std::int64_t n = std::int64_t(tokens.size());
  validate_tokens(tokens, keep.n_slots);
  INFKV_REQUIRE(keep.n_units == s.units(), "keep.n_units", keep.n_units, "the archive's ", to_string(s.g),
                " pages take ", s.units(), " unit(s)");
  INFKV_REQUIRE(scratch.size() >= archive_scratch_bytes(a, n), "scratch.size()", scratch.size(),
                "must be at least archive_scratch_bytes(archive, ", n, ") = ", archive_scratch_bytes(a, n));
  for (std::int32_t l = 0; l < n_layers; ++l) {
    const auto& in = layers[std::size_t(l)];
    const std::string at = "layers[" + std::to_string(l) + "]";
    validate(in.keys, (at + ".keys").c_str());
    validate(in.values, (at + ".values").c_str());
    INFKV_REQUIRE(in.keys.n_slots == n && in.values.n_slots == n, at + ".keys.n_slots", in.keys.n_slots,
                  "keys and values must hold the tokens' ", n, " slots; values.n_slots = ", in.values.n_slots);
    INFKV_REQUIRE(in.keys.n_heads == s.kv_heads && in.values.n_heads == s.kv_heads && in.keys.head_dim == s.head_dim &&
                      in.values.head_dim == s.head_dim,
                  at + ".keys.n_heads", in.keys.n_heads, "the archive holds ", s.kv_heads, " heads of ", s.head_dim,
                  " (keys.head_dim ", in.keys.head_dim, ", values ", in.values.n_heads, " x ", in.values.head_dim, ")");
    if (l > 0)
      INFKV_REQUIRE(in.tokens.data() == tokens.data() ||
                        std::ranges::equal(in.tokens, tokens,
                                           [](auto x, auto y) {
                                             return x.pos == y.pos && x.segment == y.segment && x.kind == y.kind;
                                           }),
                    at + ".tokens", "differ", "every layer of a per-token eviction shares layers[0]'s tokens");
  }
  infkv::detail::carver c{scratch.data()};
  std::int64_t* const order = c.take<std::int64_t>(n);
  std::int64_t* const evicted = c.take<std::int64_t>(n);
  float* const buf = c.take<float>(std::int64_t(a.options().page_tokens) * s.head_dim);
  time_order_into(tokens, order);
  const std::int32_t P = a.options().page_tokens;

  // the evicted slots of unit u in time order, into `evicted`; returns their count
  const auto evicted_of = [&](std::int64_t u) {
    const auto kept = unit_span(keep, u);
    std::int64_t m = 0;
    for (std::int64_t i = 0; i < n; ++i)
      if (!std::binary_search(kept.begin(), kept.end(), order[i])) evicted[m++] = order[i];
    return m;
  };
  const auto heads_of = [&](std::int64_t u) {
    return std::pair<std::int32_t, std::int32_t>{s.g == granularity::per_head ? std::int32_t(u) : 0,
                                                 s.g == granularity::per_head ? std::int32_t(u) + 1 : s.kv_heads};
  };
  std::int64_t pages = 0;
  for (std::int64_t u = 0; u < keep.n_units; ++u) {  // check first: nothing changes when this throws
    const std::int64_t m = evicted_of(u);
    pages += (m + P - 1) / P;
    const auto [h0, h1] = heads_of(u);
    for (std::int32_t l = 0; l < n_layers; ++l)
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int32_t h = h0; h < h1; ++h) {
          detail::check_archivable(layers[std::size_t(l)].keys, "keys", evicted[i], h, layer + l, buf);
          detail::check_archivable(layers[std::size_t(l)].values, "values", evicted[i], h, layer + l, buf);
        }
  }
  if (a.options().full == when_full::error)
    INFKV_REQUIRE(pages <= a.capacity_pages() - a.held_pages(), "archive", "full", "has room for ",
                  a.capacity_pages() - a.held_pages(), " pages; this eviction archives ", pages,
                  " (when_full is error)");
  token page_tokens[4096];
  for (std::int64_t u = 0; u < keep.n_units; ++u) {
    const std::int64_t m = evicted_of(u);
    const auto [h0, h1] = heads_of(u);
    for (std::int64_t first = 0; first < m; first += P) {
      const auto cnt = std::int32_t(std::min<std::int64_t>(P, m - first));
      for (std::int32_t t = 0; t < cnt; ++t) page_tokens[t] = tokens[std::size_t(evicted[first + t])];
      const std::int32_t p = a.add(layer, std::int32_t(u), {page_tokens, std::size_t(cnt)});
      for (std::int32_t l = 0; l < n_layers; ++l)
        for (std::int32_t h = h0; h < h1; ++h)
          detail::quantize_row(a.layout(), a.row(p, l * s.heads_per_page() + (h - h0)), layers[std::size_t(l)].keys,
                               layers[std::size_t(l)].values, h, evicted + first, cnt, buf);
    }
  }
  return pages;
}

/// Dequantizes the keys (`values` false) or values of page row r's token t into `out[head_dim]`.
inline void dequantize(const archive& a, std::int32_t page, std::int32_t r, std::int32_t t, bool values, float* out) {
  const page_layout& L = a.layout();
  INFKV_REQUIRE(r >= 0 && r < L.rows, "row", r, "must be in [0, ", L.rows, ")");
  INFKV_REQUIRE(t >= 0 && t < a.info(page).n_tokens, "token", t, "must be in [0, ", a.info(page).n_tokens, ")");
  const std::uint8_t* row = a.row(page, r);
  const std::int32_t d = L.head_dim;
  for (std::int32_t c = 0; c < d; ++c)
    out[c] = values ? dequantized(params_at(row + L.v_params, std::size_t(t) * L.groups() + std::size_t(c / L.v_group)),
                                  code_at(row + L.v_codes, std::int64_t(t) * d + c, L.v_bits))
                    : dequantized(params_at(row + L.k_params, std::size_t(c)),
                                  code_at(row + L.k_codes, std::int64_t(t) * d + c, L.k_bits));
}

/// Writes a page's dequantized rows into `out` (the page's layers: every archive layer for
/// per_token, else the one layer the page came from) at slots [first_slot, first_slot +
/// n_tokens), converted to the views' type; a per_head page writes its head only.
inline void restore(const archive& a, std::int32_t page, std::span<const kv_view> out, std::int64_t first_slot) {
  const archive_shape& s = a.shape();
  const page_info& pi = a.info(page);
  INFKV_REQUIRE(std::int64_t(out.size()) == s.layers_per_page(), "out.size()", out.size(), "a ", to_string(s.g),
                " page restores ", s.layers_per_page(), " layer(s)");
  float buf[4096];
  INFKV_REQUIRE(s.head_dim <= 4096, "archive.head_dim", s.head_dim, "restore handles head_dim <= 4096");
  for (std::size_t l = 0; l < out.size(); ++l) {
    const std::string at = "out[" + std::to_string(l) + "]";
    for (const auto& [v, name] : {std::pair{out[l].k, ".k"}, {out[l].v, ".v"}}) {
      validate(v, (at + name).c_str());
      INFKV_REQUIRE(v.n_heads == s.kv_heads && v.head_dim == s.head_dim, at + name + ".n_heads", v.n_heads,
                    "the archive holds ", s.kv_heads, " heads of ", s.head_dim, "; head_dim = ", v.head_dim);
      INFKV_REQUIRE(first_slot >= 0 && first_slot + pi.n_tokens <= v.n_slots, "first_slot", first_slot, "+ the page's ",
                    pi.n_tokens, " tokens must fit in ", at, name, ".n_slots = ", v.n_slots);
    }
  }
  for (std::int32_t r = 0; r < a.layout().rows; ++r) {
    const auto [l, hoff] = detail::page_row(s, r);
    const std::int32_t h = s.g == granularity::per_head ? pi.unit : hoff;
    for (std::int32_t t = 0; t < pi.n_tokens; ++t)
      for (const bool values : {false, true}) {
        dequantize(a, page, r, t, values, buf);
        const tensor_view& v = values ? out[std::size_t(l)].v : out[std::size_t(l)].k;
        from_f32(v.type, buf, v.row(first_slot + t, h), s.head_dim);
      }
  }
}

/// Per page slot of the archive (capacity_pages entries; -inf where no page is held), an upper
/// bound on the page's logits for `queries`: for every layer of the page, the largest over its
/// heads, their query heads and the queries of scale * sum_d max(q_d lo_d, q_d hi_d), where
/// [lo_d, hi_d] is the range of the page's dequantized keys in channel d; summed over the page's
/// layers. `queries[l]` are archive layer l's (all layers, whatever the granularity), query
/// heads a multiple of the KV heads. `layer` >= 0 bounds only the pages of that layer (the others
/// get -inf); `only` (ascending), when given, sums only those layers' bounds. `turn` (per page
/// slot, with `ropes` per archive layer), when given, bounds the logits of page p's keys turned
/// by turn[p] positions (q . R(t) k = R(-t) q . k: the queries are turned back instead, so the
/// bound stays exact): where compact positions put a recalled page elsewhere than it was archived.
inline void page_bounds(const archive& a, std::span<const const_tensor_view> queries, float scale, std::span<float> out,
                        std::int32_t layer = -1, std::span<const std::int32_t> only = {},
                        std::span<const std::int64_t> turn = {}, std::span<const std::optional<rope>> ropes = {}) {
  const archive_shape& s = a.shape();
  INFKV_REQUIRE(std::int64_t(queries.size()) == s.n_layers, "queries.size()", queries.size(),
                "must equal the archive's ", s.n_layers, " layers");
  INFKV_REQUIRE(std::int64_t(out.size()) == a.capacity_pages(), "out.size()", out.size(),
                "must equal the archive's capacity in pages (", a.capacity_pages(), ")");
  INFKV_REQUIRE(std::isfinite(scale) && scale >= 0.f, "scale", scale, "must be finite and >= 0");
  for (std::size_t l = 0; l < queries.size(); ++l) {
    const std::string at = "queries[" + std::to_string(l) + "]";
    validate(queries[l], at.c_str());
    INFKV_REQUIRE(queries[l].head_dim == s.head_dim && queries[l].n_heads % s.kv_heads == 0, at + ".n_heads",
                  queries[l].n_heads, "must be a multiple of the archive's ", s.kv_heads, " KV heads, head_dim ",
                  s.head_dim, " (queries' ", queries[l].head_dim, ")");
  }
  INFKV_REQUIRE(turn.empty() || std::int64_t(turn.size()) == a.capacity_pages(), "turn.size()", turn.size(),
                "must be 0 or the archive's capacity in pages (", a.capacity_pages(), ")");
  INFKV_REQUIRE(turn.empty() || std::int64_t(ropes.size()) == s.n_layers, "ropes.size()", ropes.size(),
                "must equal the archive's ", s.n_layers, " layers when turn is given");
  const page_layout& L = a.layout();
  const std::int32_t d = s.head_dim, rmax = (1 << L.k_bits) - 1;
  float q[4096], lo[4096], hi[4096], tq[4096];
  INFKV_REQUIRE(d <= 4096, "archive.head_dim", d, "page_bounds handles head_dim <= 4096");
  std::vector<std::optional<detail::rope_turner>> turners(turn.empty() ? 0 : std::size_t(s.n_layers));
  for (std::size_t l = 0; l < turners.size(); ++l)
    if (ropes[l]) turners[l].emplace(*ropes[l], d);
  for (std::int32_t p = 0; p < a.capacity_pages(); ++p) {
    out[std::size_t(p)] = -std::numeric_limits<float>::infinity();
    if (!a.holds(p) || (layer >= 0 && a.info(p).layer != layer)) continue;
    const page_info& pi = a.info(p);
    double total = 0.0;
    for (std::int32_t lp = 0; lp < s.layers_per_page(); ++lp) {
      if (!only.empty() && !std::binary_search(only.begin(), only.end(), pi.layer + lp)) continue;
      const const_tensor_view& Q = queries[std::size_t(pi.layer + lp)];
      const std::int32_t group = Q.n_heads / s.kv_heads;
      // the turn back, as the queries take it
      detail::rope_turner* const tr =
          turn.empty() || !turners[std::size_t(pi.layer + lp)] ? nullptr : &*turners[std::size_t(pi.layer + lp)];
      const bool back = tr != nullptr && turn[std::size_t(p)] != 0;
      if (back) tr->set(-turn[std::size_t(p)]);
      float best = -std::numeric_limits<float>::infinity();
      for (std::int32_t hp = 0; hp < s.heads_per_page(); ++hp) {
        const std::int32_t h = s.g == granularity::per_head ? pi.unit : hp;
        const std::uint8_t* kp = a.row(p, lp * s.heads_per_page() + hp) + L.k_params;
        for (std::int32_t c = 0; c < d; ++c) {
          const quant_params qp = params_at(kp, std::size_t(c));
          lo[c] = f16_to_f32(qp.lo), hi[c] = dequantized(qp, std::uint32_t(rmax));
        }
        for (std::int64_t i = 0; i < Q.n_slots; ++i)
          for (std::int32_t g = 0; g < group; ++g) {
            to_f32(Q.type, Q.row(i, h * group + g), q, d);
            if (back) {
              std::copy(q, q + d, tq);
              tr->turn(tq, q);
            }
            float sum = 0.f;
            for (std::int32_t c = 0; c < d; ++c) sum += std::max(q[c] * lo[c], q[c] * hi[c]);
            best = std::max(best, scale * sum);
          }
      }
      total += double(best);
    }
    out[std::size_t(p)] = float(total);
  }
}

}  // namespace infkv::cpu
