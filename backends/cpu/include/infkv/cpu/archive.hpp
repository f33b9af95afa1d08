// infkv CPU backend: the archive's steps on the host (the format and the store are the core's,
// infkv/archive.hpp): archiving what a keep set evicts, restoring a page's rows, bounding each
// page's logits for a set of queries, and recall: rank pages by their bounds, score the best
// candidates exactly with a policy's own pipeline beside the cache, and decide which pages come
// back and which cached slots they displace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <infkv/archive.hpp>
#include <infkv/pipeline.hpp>

#include "backend.hpp"
#include "workspace.hpp"

namespace infkv::cpu {

namespace detail {

/// The largest magnitude an archived element may have: its group's f16 parameters hold it.
inline constexpr float archive_max_abs = 65504.f;

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
  if (!values) {
    const auto* kp = reinterpret_cast<const quant_params*>(row + L.k_params);
    for (std::int32_t c = 0; c < d; ++c) {
      quant_params q;
      std::memcpy(&q, kp + c, sizeof q);
      out[c] =
          f16_to_f32(q.lo) + float(code_at(row + L.k_codes, std::int64_t(t) * d + c, L.k_bits)) * f16_to_f32(q.step);
    }
    return;
  }
  const auto* vp = reinterpret_cast<const quant_params*>(row + L.v_params);
  for (std::int32_t c = 0; c < d; ++c) {
    quant_params q;
    std::memcpy(&q, vp + std::int64_t(t) * L.groups() + c / L.v_group, sizeof q);
    out[c] = f16_to_f32(q.lo) + float(code_at(row + L.v_codes, std::int64_t(t) * d + c, L.v_bits)) * f16_to_f32(q.step);
  }
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
/// heads a multiple of the KV heads.
inline void page_bounds(const archive& a, std::span<const const_tensor_view> queries, float scale,
                        std::span<float> out) {
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
  const page_layout& L = a.layout();
  const std::int32_t d = s.head_dim, rmax = (1 << L.k_bits) - 1;
  float q[4096], lo[4096], hi[4096];
  INFKV_REQUIRE(d <= 4096, "archive.head_dim", d, "page_bounds handles head_dim <= 4096");
  for (std::int32_t p = 0; p < a.capacity_pages(); ++p) {
    out[std::size_t(p)] = -std::numeric_limits<float>::infinity();
    if (!a.holds(p)) continue;
    const page_info& pi = a.info(p);
    double total = 0.0;
    for (std::int32_t lp = 0; lp < s.layers_per_page(); ++lp) {
      const std::int32_t layer = pi.layer + lp;
      const const_tensor_view& Q = queries[std::size_t(layer)];
      const std::int32_t group = Q.n_heads / s.kv_heads;
      float best = -std::numeric_limits<float>::infinity();
      for (std::int32_t hp = 0; hp < s.heads_per_page(); ++hp) {
        const std::int32_t h = s.g == granularity::per_head ? pi.unit : hp;
        const auto* kp = reinterpret_cast<const quant_params*>(a.row(p, lp * s.heads_per_page() + hp) + L.k_params);
        for (std::int32_t c = 0; c < d; ++c) {
          quant_params qp;
          std::memcpy(&qp, kp + c, sizeof qp);
          lo[c] = f16_to_f32(qp.lo), hi[c] = lo[c] + float(rmax) * f16_to_f32(qp.step);
        }
        for (std::int64_t i = 0; i < Q.n_slots; ++i)
          for (std::int32_t g = 0; g < group; ++g) {
            to_f32(Q.type, Q.row(i, h * group + g), q, d);
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

// ---- recall ----------------------------------------------------------------------------------

/// A candidate page's slots [begin, end) among the scored slots (after the cache's).
struct recall_candidate {
  std::int32_t page = 0;
  std::int64_t begin = 0, end = 0;
};

/// The displacement rule, on one decision row `scores` over the cache's `n_cache` slots and the
/// candidates' slots after them (tokens alike). The cache's first `protect.sinks` and last
/// `protect.recent` slots in time order are never displaced; the others are displaced worst
/// first (the reverse of keep_before: lowest score, then oldest position, then highest slot).
/// Candidates are taken by their mean score, highest first (ties: the newer first position, then
/// the lower page id); a candidate of n slots comes back when it fits in `budget_tokens` and in
/// the displaceable slots left and the sum of its scores exceeds the sum of the n worst slots
/// left (strictly; sums in double), which it then displaces. Writes the chosen candidates'
/// indices to `chosen` and the displaced slots, increasing, to `displaced`; returns their counts.
/// `work` holds 2 * n_cache + candidates entries. Allocates nothing.
inline std::pair<std::int64_t, std::int64_t> decide_recall(std::span<const float> scores, std::span<const token> tokens,
                                                           std::int64_t n_cache,
                                                           std::span<const recall_candidate> cands,
                                                           const budget& protect, std::int64_t budget_tokens,
                                                           std::span<std::int64_t> work, std::span<std::int64_t> chosen,
                                                           std::span<std::int64_t> displaced) {
  const std::int64_t n = std::int64_t(scores.size()), nc = std::int64_t(cands.size());
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n, "tokens.size()", tokens.size(), "must equal scores.size() (", n, ")");
  INFKV_REQUIRE(n_cache >= 0 && n_cache <= n, "n_cache", n_cache, "must be in [0, ", n, "]");
  INFKV_REQUIRE(budget_tokens >= 0, "budget_tokens", budget_tokens, "must be >= 0");
  INFKV_REQUIRE(std::int64_t(work.size()) >= 2 * n_cache + nc, "work.size()", work.size(),
                "must be >= ", 2 * n_cache + nc);
  INFKV_REQUIRE(std::int64_t(chosen.size()) >= nc, "chosen.size()", chosen.size(), "must be >= ", nc);
  for (std::int64_t i = 0; i < n; ++i)
    INFKV_REQUIRE(!std::isnan(scores[std::size_t(i)]), "scores[" + std::to_string(i) + "]", "nan", "must not be NaN");
  std::int64_t prev = n_cache;
  for (std::int64_t c = 0; c < nc; ++c) {
    const auto& x = cands[std::size_t(c)];
    INFKV_REQUIRE(x.begin == prev && x.end > x.begin && x.end <= n, "cands[" + std::to_string(c) + "].begin", x.begin,
                  "candidates tile the slots after the cache in order: expected begin ", prev, " < end <= ", n,
                  "; end = ", x.end);
    prev = x.end;
  }
  std::int64_t* const order = work.data();
  std::int64_t* const worst = order + n_cache;
  std::int64_t* const corder = worst + n_cache;
  time_order_into(tokens.first(std::size_t(n_cache)), order);
  std::int64_t nd = 0;
  const std::int64_t sinks = std::min(protect.sinks, n_cache), recent = std::min(protect.recent, n_cache - sinks);
  for (std::int64_t i = sinks; i < n_cache - recent; ++i) worst[nd++] = order[i];
  const auto sc = [&](std::int64_t j) { return scores[std::size_t(j)]; };
  const auto pos = [&](std::int64_t j) { return tokens[std::size_t(j)].pos; };
  std::sort(worst, worst + nd,
            [&](std::int64_t a, std::int64_t b) { return keep_before(sc(b), pos(b), b, sc(a), pos(a), a); });
  const auto sum = [&](std::int64_t b, std::int64_t e, auto at) {
    double t = 0.0;
    for (std::int64_t j = b; j < e; ++j) t += double(sc(at(j)));
    return t;
  };
  const auto mean = [&](std::int64_t c) {
    const auto& x = cands[std::size_t(c)];
    return sum(x.begin, x.end, [](std::int64_t j) { return j; }) / double(x.end - x.begin);
  };
  for (std::int64_t c = 0; c < nc; ++c) corder[c] = c;
  std::sort(corder, corder + nc, [&](std::int64_t a, std::int64_t b) {
    const double ma = mean(a), mb = mean(b);
    if (ma != mb) return ma > mb;
    const auto pa = pos(cands[std::size_t(a)].begin), pb = pos(cands[std::size_t(b)].begin);
    if (pa != pb) return pa > pb;
    return cands[std::size_t(a)].page < cands[std::size_t(b)].page;
  });
  std::int64_t used = 0, k = 0, nch = 0;
  for (std::int64_t i = 0; i < nc; ++i) {
    const auto& x = cands[std::size_t(corder[i])];
    const std::int64_t m = x.end - x.begin;
    if (used + m > budget_tokens || k + m > nd) continue;
    if (sum(x.begin, x.end, [](std::int64_t j) { return j; }) >
        sum(k, k + m, [&](std::int64_t j) { return worst[j]; })) {
      chosen[std::size_t(nch++)] = corder[i];
      k += m, used += m;
    }
  }
  INFKV_REQUIRE(std::int64_t(displaced.size()) >= k, "displaced.size()", displaced.size(), "must be >= ", k);
  std::copy(worst, worst + k, displaced.begin());
  std::sort(displaced.begin(), displaced.begin() + k);
  return {nch, k};
}

/// What a recall decided: the pages to bring back (decision order) and the cache slots they
/// displace (increasing); spans into the recaller, valid until its next call.
struct recall_result {
  std::span<const std::int32_t> pages;
  std::span<const std::int64_t> displaced;
  std::int64_t tokens = 0;  ///< slots the pages hold (= displaced.size())
};

struct recall_options {
  std::int64_t budget_tokens = 0;  ///< most slots one recall brings back (>= 1)
  std::int32_t candidates = 32;    ///< at most this many pages scored exactly, the best by their bounds (>= 1)
  /// Score with the policy's attention bias. false: without it (beta 0), since archived pages are
  /// old by definition and a recency bias ranks every one of them below the cache.
  bool recency_bias = true;
};

/// Recall over an archive: ranks the held pages by their bounds (page_bounds), scores the best
/// `candidates` exactly beside the cache with a policy's own pipeline (their dequantized keys and
/// values appended to the cache's, the given queries as the window), and decides by
/// decide_recall what comes back. Every buffer (the policy's workspace included) is sized at
/// construction for caches of up to `max_cache_slots` slots and `max_queries` queries: recall
/// allocates nothing. per_token and
/// per_layer archives (a per_head archive's pages hold different positions per head, which one
/// shared scoring pass cannot place).
class recaller {
 public:
  template <policy P>
  recaller(const archive& a, const P& policy, const budget& b, const recall_options& o, std::int64_t max_cache_slots,
           std::int32_t q_heads, std::int64_t max_queries, const backend& be = {})
      : shape_(a.shape()),
        spec_((policy.validate(), policy.spec())),
        budget_(b),
        opt_(o),
        be_(be),
        max_cache_(max_cache_slots),
        q_heads_(q_heads),
        max_queries_(max_queries) {
    if (!o.recency_bias) {
      spec_.score.bias.beta = 0.0;
      if (spec_.second) spec_.second->bias.beta = 0.0;
    }
    for (std::int32_t i = 0; i < spec_.parts(); ++i)
      INFKV_REQUIRE(spec_.part(i).reads_queries(), "policy", spec_.name,
                    "recall scores candidates against the queries: use a policy whose score reads them (snapkv, "
                    "inf_mllm, tova, expected_attention)");
    INFKV_REQUIRE(shape_.g != granularity::per_head, "archive.shape().g", "per_head",
                  "recall places candidates beside the cache in one scoring pass; a per_head archive's heads hold "
                  "different positions: archive per_layer or per_token");
    INFKV_REQUIRE(o.budget_tokens >= 1, "recall_options.budget_tokens", o.budget_tokens, "must be >= 1");
    INFKV_REQUIRE(o.candidates >= 1, "recall_options.candidates", o.candidates, "must be >= 1");
    opt_.candidates = std::min(o.candidates, a.capacity_pages());
    page_tokens_ = a.options().page_tokens;  // "at most": no more pages than the archive holds
    INFKV_REQUIRE(max_cache_slots >= 1, "max_cache_slots", max_cache_slots, "must be >= 1");
    INFKV_REQUIRE(q_heads >= 1 && q_heads % shape_.kv_heads == 0, "q_heads", q_heads,
                  "must be a positive multiple of the archive's ", shape_.kv_heads, " KV heads");
    INFKV_REQUIRE(max_queries >= 1, "max_queries", max_queries, "must be >= 1");
    const std::int64_t n = max_cache_slots + std::int64_t(opt_.candidates) * a.options().page_tokens;
    const std::int32_t L = shape_.layers_per_page();
    const std::size_t rows = std::size_t(n) * std::size_t(shape_.kv_heads) * std::size_t(shape_.head_dim);
    keys_.assign(rows * std::size_t(L), 0.f);
    values_.assign(rows * std::size_t(L), 0.f);
    tokens_.resize(std::size_t(n));
    bounds_.resize(std::size_t(a.capacity_pages()));
    held_.resize(std::size_t(a.capacity_pages()));
    cands_.resize(std::size_t(opt_.candidates));
    work_.resize(std::size_t(2 * n + opt_.candidates));
    chosen_.resize(std::size_t(opt_.candidates));
    pages_.resize(std::size_t(opt_.candidates));
    displaced_.resize(std::size_t(max_cache_slots));
    inputs_.resize(std::size_t(L));
    plan_options po;
    po.g = shape_.g, po.n_layers = L;
    const layer_shape most{n, shape_.kv_heads, q_heads, shape_.head_dim, max_queries};
    ws_ = std::make_unique<workspace>(make_plan(be_, spec_, budget_, most, po).workspace_bytes);
  }

  /// Recalls for `queries` (per archive layer; their positions `query_pos`, after the cache's)
  /// into the cache `cache` (its layers as the pipeline takes them: every layer for per_token,
  /// the archive's layer `layer` for per_layer), scoring with the recaller's policy (a source
  /// that reads queries) under its budget (the cache's). Checks: a non-empty archive of the cache's shape, a
  /// budget whose room for recall (its keep count less the protected slots) holds
  /// budget_tokens, no candidate text token at a cached text token's position.
  template <row_source R>
  recall_result recall(const archive& a, std::span<const layer_inputs<R>> cache,
                       std::span<const const_tensor_view> queries, std::span<const std::int64_t> query_pos, float scale,
                       std::int32_t layer = 0) {
    const policy_spec& spec = spec_;
    const budget& b = budget_;
    INFKV_REQUIRE(a.shape().n_layers == shape_.n_layers && a.shape().kv_heads == shape_.kv_heads &&
                      a.shape().head_dim == shape_.head_dim && a.shape().g == shape_.g &&
                      a.capacity_pages() == std::int32_t(bounds_.size()) && a.options().page_tokens == page_tokens_,
                  "archive.shape()", "differs", "the recaller was made for an archive of ", shape_.n_layers,
                  " layers, ", shape_.kv_heads, " heads of ", shape_.head_dim, " (", to_string(shape_.g), "), ",
                  bounds_.size(), " pages of ", page_tokens_, " tokens");
    INFKV_REQUIRE(a.held_pages() > 0, "archive", "empty", "recall needs archived pages; the archive holds none");
    const std::int32_t L = shape_.layers_per_page();
    INFKV_REQUIRE(std::int64_t(cache.size()) == L, "cache.size()", cache.size(), "a ", to_string(shape_.g),
                  " recall takes ", L, " layer(s)");
    INFKV_REQUIRE(shape_.g == granularity::per_token ? layer == 0 : layer >= 0 && layer < shape_.n_layers, "layer",
                  layer, "must be in [0, ", shape_.g == granularity::per_token ? 1 : shape_.n_layers, ")");
    const auto ctoks = cache[0].tokens;
    const std::int64_t n_cache = std::int64_t(ctoks.size());
    INFKV_REQUIRE(n_cache >= 1 && n_cache <= max_cache_, "cache[0].tokens.size()", n_cache,
                  "must be in [1, max_cache_slots = ", max_cache_, "]");
    const budget eff = spec.protect(b);
    const std::int64_t room = eff.keep_count(n_cache) - std::min(n_cache, eff.sinks + eff.recent);
    INFKV_REQUIRE(opt_.budget_tokens <= room, "recall_options.budget_tokens", opt_.budget_tokens,
                  "exceeds what the cache's budget lets recall displace: ", room, " of ", n_cache,
                  " slots (keep count less sinks ", eff.sinks, " and recent ", eff.recent, ")");
    INFKV_REQUIRE(std::int64_t(queries.size()) == shape_.n_layers, "queries.size()", queries.size(),
                  "must equal the archive's ", shape_.n_layers, " layers");
    for (std::size_t l = 0; l < queries.size(); ++l)
      INFKV_REQUIRE(queries[l].n_heads == q_heads_ && queries[l].n_slots >= 1 && queries[l].n_slots <= max_queries_,
                    "queries[" + std::to_string(l) + "].n_slots", queries[l].n_slots, "must be in [1, ", max_queries_,
                    "] queries of ", q_heads_, " heads; n_heads = ", queries[l].n_heads);

    // 1. bounds (at the attention scale the scores use), and the best candidates of this layer's pages
    page_bounds(a, queries, detail::effective_scale(scale, shape_.head_dim), bounds_);
    std::int64_t nh = 0;
    for (std::int32_t p = 0; p < a.capacity_pages(); ++p)
      if (a.holds(p) && a.info(p).layer == layer) held_[std::size_t(nh++)] = p;
    INFKV_REQUIRE(nh > 0, "archive", "empty", "holds no page of layer ", layer);
    const auto better = [&](std::int32_t x, std::int32_t y) {
      const float bx = bounds_[std::size_t(x)], by = bounds_[std::size_t(y)];
      if (bx != by) return bx > by;
      const auto px = a.tokens(x)[0].pos, py = a.tokens(y)[0].pos;
      return px != py ? px > py : x < y;
    };
    const std::int64_t nc = std::min<std::int64_t>(opt_.candidates, nh);
    std::partial_sort(held_.begin(), held_.begin() + nc, held_.begin() + nh, better);
    std::sort(held_.begin(), held_.begin() + nc, [&](std::int32_t x, std::int32_t y) {  // candidates in time order
      const auto px = a.tokens(x)[0].pos, py = a.tokens(y)[0].pos;
      return px != py ? px < py : x < y;
    });

    // 2. the scored slots: the cache's, then the candidates'
    std::copy(ctoks.begin(), ctoks.end(), tokens_.begin());
    std::int64_t n = n_cache;
    for (std::int64_t c = 0; c < nc; ++c) {
      const std::int32_t p = held_[std::size_t(c)];
      const auto pt = a.tokens(p);
      for (const token& t : pt)
        if (t.kind == modality::text)
          for (const token& ct : ctoks)
            INFKV_REQUIRE(!(ct.kind == modality::text && ct.pos == t.pos), "archive page", p,
                          "holds a text token at position ", t.pos,
                          ", which the cache holds too: an archive must hold only what left the cache");
      cands_[std::size_t(c)] = {p, n, n + std::int64_t(pt.size())};
      std::copy(pt.begin(), pt.end(), tokens_.begin() + n);
      n += std::int64_t(pt.size());
    }
    const std::int32_t H = shape_.kv_heads, d = shape_.head_dim;
    const std::int64_t layer_floats = n * H * d;
    const bool need_values = spec.needs().values;
    for (std::int32_t l = 0; l < L; ++l) {
      const auto& in = cache[std::size_t(l)];
      const std::string at = "cache[" + std::to_string(l) + "]";
      validate(in.keys, (at + ".keys").c_str());
      INFKV_REQUIRE(in.keys.n_slots == n_cache && in.keys.n_heads == H && in.keys.head_dim == d, at + ".keys.n_slots",
                    in.keys.n_slots, "must hold the cache's ", n_cache, " slots of ", H, " heads of ", d);
      if (need_values) {
        validate(in.values, (at + ".values").c_str());
        INFKV_REQUIRE(in.values.n_slots == n_cache && in.values.n_heads == H && in.values.head_dim == d,
                      at + ".values.n_slots", in.values.n_slots, "must match the keys");
      }
      float* const K = keys_.data() + l * layer_floats;
      float* const V = values_.data() + l * layer_floats;
      for (std::int64_t j = 0; j < n_cache; ++j)
        for (std::int32_t h = 0; h < H; ++h) {
          to_f32(in.keys.type, in.keys.row(j, h), K + (j * H + h) * d, d);
          if (need_values) to_f32(in.values.type, in.values.row(j, h), V + (j * H + h) * d, d);
        }
      for (std::int64_t c = 0; c < nc; ++c) {
        const auto& x = cands_[std::size_t(c)];
        for (std::int64_t t = 0; t < x.end - x.begin; ++t)
          for (std::int32_t h = 0; h < H; ++h) {
            dequantize(a, x.page, l * H + h, std::int32_t(t), false, K + ((x.begin + t) * H + h) * d);
            if (need_values) dequantize(a, x.page, l * H + h, std::int32_t(t), true, V + ((x.begin + t) * H + h) * d);
          }
      }
      auto& li = inputs_[std::size_t(l)];
      li = layer_inputs<const_tensor_view>{};
      li.keys = nhd(static_cast<const void*>(K), dtype::f32, n, H, d);
      if (need_values) li.values = nhd(static_cast<const void*>(V), dtype::f32, n, H, d);
      li.queries = queries[std::size_t(layer + l)];
      li.query_pos = query_pos;
      li.tokens = std::span<const token>(tokens_.data(), std::size_t(n));
      li.scale = scale;
      li.rotary = in.rotary;
    }

    // 3. the policy's own scores over both, then the displacement rule
    plan_options po;
    po.g = shape_.g, po.n_layers = L;
    const plan pl = make_plan(be_, spec, b, shape_of(inputs_[0]), po);
    const score_view s =
        run_decision_scores(pl, be_, std::span<const layer_inputs<const_tensor_view>>(inputs_), ws_->span());
    const auto [nch, nd] = decide_recall(std::span<const float>(&s(0, 0), std::size_t(n)),
                                         std::span<const token>(tokens_.data(), std::size_t(n)), n_cache,
                                         std::span<const recall_candidate>(cands_.data(), std::size_t(nc)),
                                         pl.effective, opt_.budget_tokens, work_, chosen_, displaced_);
    std::int64_t tokens = 0;
    for (std::int64_t i = 0; i < nch; ++i) {
      const auto& x = cands_[std::size_t(chosen_[std::size_t(i)])];
      pages_[std::size_t(i)] = x.page, tokens += x.end - x.begin;
    }
    return {std::span<const std::int32_t>(pages_.data(), std::size_t(nch)),
            std::span<const std::int64_t>(displaced_.data(), std::size_t(nd)), tokens};
  }

 private:
  archive_shape shape_;
  policy_spec spec_;
  budget budget_;
  recall_options opt_;
  backend be_;
  std::int64_t max_cache_ = 0;
  std::int32_t page_tokens_ = 0;
  std::int32_t q_heads_ = 0;
  std::int64_t max_queries_ = 0;
  std::vector<float> keys_, values_, bounds_;
  std::vector<token> tokens_;
  std::vector<std::int32_t> held_, pages_;
  std::vector<recall_candidate> cands_;
  std::vector<std::int64_t> work_, chosen_, displaced_;
  std::vector<layer_inputs<const_tensor_view>> inputs_;
  std::unique_ptr<workspace> ws_;
};

}  // namespace infkv::cpu
