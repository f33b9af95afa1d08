// infkv CPU backend: recall over an archive (cpu/archive.hpp): rank the pages by their bounds,
// score the best candidates exactly with a policy's own pipeline beside the cache, and decide by
// the displacement rule (recall_rule.hpp) which pages come back and which cached slots they
// displace.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <infkv/archive.hpp>
#include <infkv/pipeline.hpp>

#include "archive.hpp"
#include "backend.hpp"
#include "recall_rule.hpp"
#include "rope.hpp"
#include "workspace.hpp"

namespace infkv::cpu {

/// Recall over an archive: ranks the held pages by their bounds (page_bounds), scores the best
/// `candidates` exactly beside the cache with a policy's own pipeline (the dequantized keys and
/// values of their tokens the cache does not hold appended to the cache's, the given queries as
/// the window), and decides by decide_recall what comes back. A page's token is held by the
/// cache when the cache has a token of equal position, segment and modality: an archive may hold
/// everything the stream wrote (write-through, as the llama.cpp session keeps it) or only what
/// left the cache. Every buffer (the policy's workspace included) is sized at
/// construction for caches of up to `max_cache_slots` slots and `max_queries` queries: recall
/// allocates nothing (but re-rotation's tables with `rotary_pos`). per_token and
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
    INFKV_REQUIRE(o.neighbours >= 0, "recall_options.neighbours", o.neighbours, "must be >= 0");
    INFKV_REQUIRE(!o.distance || *o.distance >= 0, "recall_options.distance", o.distance.value_or(0),
                  "must be >= 0 (positions before the newest cached token)");
    INFKV_REQUIRE(o.layers.empty() || shape_.g == granularity::per_token, "recall_options.layers.size()",
                  o.layers.size(), "selects the layers of a per_token archive; a per_layer recall takes one layer");
    for (std::size_t i = 0; i < o.layers.size(); ++i)
      INFKV_REQUIRE(o.layers[i] >= 0 && o.layers[i] < shape_.n_layers && (i == 0 || o.layers[i] > o.layers[i - 1]),
                    "recall_options.layers[" + std::to_string(i) + "]", o.layers[i], "must be ascending in [0, ",
                    shape_.n_layers, ")");
    opt_.candidates = std::min(o.candidates, a.capacity_pages());
    max_cands_ = std::int32_t(std::min<std::int64_t>(
        std::int64_t(opt_.candidates) * (1 + 2 * std::int64_t(o.neighbours)), a.capacity_pages()));
    page_tokens_ = a.options().page_tokens;  // "at most": no more pages than the archive holds
    INFKV_REQUIRE(max_cache_slots >= 1, "max_cache_slots", max_cache_slots, "must be >= 1");
    INFKV_REQUIRE(q_heads >= 1 && q_heads % shape_.kv_heads == 0, "q_heads", q_heads,
                  "must be a positive multiple of the archive's ", shape_.kv_heads, " KV heads");
    INFKV_REQUIRE(max_queries >= 1, "max_queries", max_queries, "must be >= 1");
    const std::int64_t n = max_cache_slots + std::int64_t(max_cands_) * a.options().page_tokens;
    const std::int32_t L = shape_.layers_per_page();
    const std::size_t rows = std::size_t(n) * std::size_t(shape_.kv_heads) * std::size_t(shape_.head_dim);
    keys_.assign(rows * std::size_t(L), 0.f);
    values_.assign(rows * std::size_t(L), 0.f);
    tokens_.resize(std::size_t(n));
    bounds_.resize(std::size_t(a.capacity_pages()));
    held_.resize(std::size_t(a.capacity_pages()));
    by_pos_.resize(std::size_t(a.capacity_pages()));
    at_.resize(std::size_t(a.capacity_pages()));
    mark_.resize(std::size_t(a.capacity_pages()));
    cands_.resize(std::size_t(max_cands_));
    work_.resize(std::size_t(2 * n + 2 * max_cands_));
    chosen_.resize(std::size_t(max_cands_));
    pages_.resize(std::size_t(max_cands_));
    displaced_.resize(std::size_t(max_cache_slots));
    index_.resize(std::size_t(n - max_cache_slots));
    turn_.resize(std::size_t(n - max_cache_slots));
    page_turn_.resize(std::size_t(a.capacity_pages()));
    ropes_.resize(std::size_t(shape_.n_layers));
    recalled_.resize(std::size_t(n - max_cache_slots));
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
  /// budget_tokens.
  ///
  /// `rotary_pos` (compact position mode): when given, the cache's tokens and `query_pos` carry
  /// the stream's own positions (the archive's), while the cache's keys and the queries are
  /// rotated at other positions, slot j's at rotary_pos[j] (compacted, increasing with the
  /// stream's positions). Each candidate token's keys, archived rotated at its own position, are
  /// then turned (each layer with its `rotary`) to where it would land: one past the rotary
  /// position of the newest cached token before it, plus its index among the candidate tokens
  /// between the two; the scores compare what attention would see after the recall. With
  /// recall_options::distance every candidate is turned to that one distance instead, in either
  /// mode (keep mode then needs the layers' `rotary` too).
  template <row_source R>
  recall_result recall(const archive& a, std::span<const layer_inputs<R>> cache,
                       std::span<const const_tensor_view> queries, std::span<const std::int64_t> query_pos, float scale,
                       std::int32_t layer = 0, std::span<const std::int64_t> rotary_pos = {}) {
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
    INFKV_REQUIRE(rotary_pos.empty() || std::int64_t(rotary_pos.size()) == n_cache, "rotary_pos.size()",
                  rotary_pos.size(), "must be 0 or the cache's ", n_cache, " slots");
    INFKV_REQUIRE(std::int64_t(queries.size()) == shape_.n_layers, "queries.size()", queries.size(),
                  "must equal the archive's ", shape_.n_layers, " layers");
    for (std::size_t l = 0; l < queries.size(); ++l)
      INFKV_REQUIRE(queries[l].n_heads == q_heads_ && queries[l].n_slots >= 1 && queries[l].n_slots <= max_queries_,
                    "queries[" + std::to_string(l) + "].n_slots", queries[l].n_slots, "must be in [1, ", max_queries_,
                    "] queries of ", q_heads_, " heads; n_heads = ", queries[l].n_heads);

    // 1. the cache's tokens by (position, segment, modality), to tell which archived tokens it holds
    std::int64_t* const held_at = work_.data();  // the cache's slots by (position, segment, modality)
    for (std::int64_t j = 0; j < n_cache; ++j) held_at[j] = j;
    const auto ident = [](const token& t) { return std::tuple(t.pos, t.segment, t.kind); };
    std::sort(held_at, held_at + n_cache, [&](std::int64_t x, std::int64_t y) {
      return ident(ctoks[std::size_t(x)]) < ident(ctoks[std::size_t(y)]);
    });
    const auto first_not_before = [&](const token& t) {  // in held_at: the first cached token not before t
      return std::lower_bound(held_at, held_at + n_cache, t,
                              [&](std::int64_t x, const token& v) { return ident(ctoks[std::size_t(x)]) < ident(v); });
    };
    const auto cached = [&](const token& t) {
      const auto it = first_not_before(t);
      return it != held_at + n_cache && ident(ctoks[std::size_t(*it)]) == ident(t);
    };
    // 2. bounds (at the attention scale the scores use), and the best candidates among this layer's pages
    //    holding a token the cache does not
    // with rotary_pos: where the newest cached token before `t` is rotated (-1: none), and each
    // page's turn to where its first token the cache does not hold would land
    const auto lands_after = [&](const token& t) -> std::int64_t {
      const auto it = first_not_before(t);
      return it == held_at ? -1 : rotary_pos[std::size_t(*(it - 1))];
    };
    // with recall_options::distance: every page's first token turned to one position, that
    // distance before the newest cached token's rotary position
    const bool turned = !rotary_pos.empty() || opt_.distance.has_value();
    const std::int64_t common = opt_.distance ? (rotary_pos.empty() ? std::ranges::max(ctoks, {}, &token::pos).pos
                                                                    : std::ranges::max(rotary_pos)) -
                                                    *opt_.distance
                                              : 0;
    if (turned) {
      for (std::int32_t p = 0; p < a.capacity_pages(); ++p) {
        page_turn_[std::size_t(p)] = 0;
        if (!a.holds(p)) continue;
        if (opt_.distance) {
          page_turn_[std::size_t(p)] = common - a.tokens(p)[0].pos;
          continue;
        }
        for (const token& t : a.tokens(p))
          if (!cached(t)) {
            page_turn_[std::size_t(p)] = lands_after(t) + 1 - t.pos;
            break;
          }
      }
      for (std::int32_t l = 0; l < shape_.n_layers; ++l)
        ropes_[std::size_t(l)] = shape_.g == granularity::per_token ? cache[std::size_t(l)].rotary
                                 : l == layer                       ? cache[0].rotary
                                                                    : std::nullopt;
    }
    page_bounds(a, queries, detail::effective_scale(scale, shape_.head_dim), bounds_, layer, opt_.layers,
                turned ? std::span<const std::int64_t>(page_turn_) : std::span<const std::int64_t>{}, ropes_);
    std::int64_t nh = 0, nl = 0;
    for (std::int32_t p = 0; p < a.capacity_pages(); ++p)
      if (a.holds(p) && a.info(p).layer == layer) {
        ++nl;
        if (!std::ranges::all_of(a.tokens(p), cached) &&
            (!opt_.below || std::ranges::all_of(a.tokens(p), [&](const token& t) { return t.pos < *opt_.below; })))
          held_[std::size_t(nh++)] = p;
      }
    INFKV_REQUIRE(nl > 0, "archive", "empty", "holds no page of layer ", layer);
    if (nh == 0) return {};  // the cache holds every archived token
    const auto better = [&](std::int32_t x, std::int32_t y) {
      const float bx = bounds_[std::size_t(x)], by = bounds_[std::size_t(y)];
      if (bx != by) return bx > by;
      const auto px = a.tokens(x)[0].pos, py = a.tokens(y)[0].pos;
      return px != py ? px > py : x < y;
    };
    // the pages in time order: a page's neighbours are the pages beside it there
    const auto first = [&](std::int32_t x, std::int32_t y) {
      const auto px = a.tokens(x)[0].pos, py = a.tokens(y)[0].pos;
      return px != py ? px < py : x < y;
    };
    std::copy(held_.begin(), held_.begin() + nh, by_pos_.begin());
    std::sort(by_pos_.begin(), by_pos_.begin() + nh, first);
    for (std::int64_t i = 0; i < nh; ++i)
      at_[std::size_t(by_pos_[std::size_t(i)])] = std::int32_t(i), mark_[std::size_t(i)] = 0;
    const std::int64_t nk = std::min<std::int64_t>(opt_.candidates, nh), w = opt_.neighbours;
    std::partial_sort(held_.begin(), held_.begin() + nk, held_.begin() + nh, better);
    for (std::int64_t c = 0; c < nk; ++c) {
      const std::int64_t i = at_[std::size_t(held_[std::size_t(c)])];
      for (std::int64_t j = std::max<std::int64_t>(0, i - w); j <= std::min(nh - 1, i + w); ++j)
        mark_[std::size_t(j)] = 1;
    }

    // 3. the scored slots: the cache's, then the candidates' tokens the cache does not hold, in time order
    std::copy(ctoks.begin(), ctoks.end(), tokens_.begin());
    std::int64_t n = n_cache, nc = 0;
    for (std::int64_t i = 0; i < nh; ++i) {
      if (!mark_[std::size_t(i)]) continue;
      const std::int32_t p = by_pos_[std::size_t(i)];
      const auto pt = a.tokens(p);
      const std::int64_t begin = n;
      for (std::size_t t = 0; t < pt.size(); ++t)
        if (!cached(pt[t])) tokens_[std::size_t(n)] = pt[t], index_[std::size_t(n - n_cache)] = std::int32_t(t), ++n;
      cands_[std::size_t(nc++)] = {p, begin, n, i > 0 && mark_[std::size_t(i - 1)] != 0};
    }
    const std::int32_t H = shape_.kv_heads, d = shape_.head_dim;
    const std::int64_t layer_floats = n * H * d;
    if (opt_.distance) {  // each candidate token's turn: its page's
      for (std::int64_t c = 0; c < nc; ++c)
        for (std::int64_t j = cands_[std::size_t(c)].begin; j < cands_[std::size_t(c)].end; ++j)
          turn_[std::size_t(j - n_cache)] = page_turn_[std::size_t(cands_[std::size_t(c)].page)];
    } else if (!rotary_pos.empty()) {  // each candidate token's turn: from its own position to where it lands
      std::int64_t gap = -2, k = 0;
      for (std::int64_t j = n_cache; j < n; ++j) {
        const token& t = tokens_[std::size_t(j)];
        const std::int64_t after = lands_after(t);
        k = after == gap ? k + 1 : 0, gap = after;
        turn_[std::size_t(j - n_cache)] = after + 1 + k - t.pos;
      }
    }
    const bool need_values = spec.needs().values;
    const std::int32_t nl_scored = opt_.layers.empty() ? L : std::int32_t(opt_.layers.size());
    for (std::int32_t i = 0; i < nl_scored; ++i) {
      const std::int32_t l = opt_.layers.empty() ? i : opt_.layers[std::size_t(i)];
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
      float* const K = keys_.data() + i * layer_floats;
      float* const V = values_.data() + i * layer_floats;
      for (std::int64_t j = 0; j < n_cache; ++j)
        for (std::int32_t h = 0; h < H; ++h) {
          to_f32(in.keys.type, in.keys.row(j, h), K + (j * H + h) * d, d);
          if (need_values) to_f32(in.values.type, in.values.row(j, h), V + (j * H + h) * d, d);
        }
      for (std::int64_t c = 0; c < nc; ++c) {
        const auto& x = cands_[std::size_t(c)];
        for (std::int64_t j = x.begin; j < x.end; ++j) {
          const std::int32_t t = index_[std::size_t(j - n_cache)];
          for (std::int32_t h = 0; h < H; ++h) {
            dequantize(a, x.page, l * H + h, t, false, K + (j * H + h) * d);
            if (need_values) dequantize(a, x.page, l * H + h, t, true, V + (j * H + h) * d);
          }
        }
      }
      if (turned && n > n_cache) {
        INFKV_REQUIRE(in.rotary.has_value(), at + ".rotary", "unset",
                      opt_.distance ? "recall_options.distance turns candidates' keys to one distance"
                                    : "rotary_pos turns candidates' keys to where they land",
                      ": the layer's RoPE is needed");
        rerotate(nhd(static_cast<void*>(K + n_cache * H * d), dtype::f32, n - n_cache, H, d),
                 std::span<const std::int64_t>(turn_.data(), std::size_t(n - n_cache)), *in.rotary, be_.ex);
      }
      auto& li = inputs_[std::size_t(i)];
      li = layer_inputs<const_tensor_view>{};
      li.keys = nhd(static_cast<const void*>(K), dtype::f32, n, H, d);
      if (need_values) li.values = nhd(static_cast<const void*>(V), dtype::f32, n, H, d);
      li.queries = queries[std::size_t(layer + l)];
      li.query_pos = query_pos;
      li.tokens = std::span<const token>(tokens_.data(), std::size_t(n));
      li.scale = scale;
      li.rotary = in.rotary;
    }

    // 4. the policy's own scores over both, then the displacement rule
    plan_options po;
    po.g = shape_.g, po.n_layers = nl_scored;
    const plan pl = make_plan(be_, spec, b, shape_of(inputs_[0]), po);
    const score_view s = run_decision_scores(
        pl, be_, std::span<const layer_inputs<const_tensor_view>>(inputs_.data(), std::size_t(nl_scored)), ws_->span());
    const auto [nch, nd] = decide_recall(std::span<const float>(&s(0, 0), std::size_t(n)),
                                         std::span<const token>(tokens_.data(), std::size_t(n)), n_cache,
                                         std::span<const recall_candidate>(cands_.data(), std::size_t(nc)),
                                         pl.effective, opt_.budget_tokens, opt_.neighbours, work_, chosen_, displaced_);
    std::int64_t tokens = 0;
    for (std::int64_t i = 0; i < nch; ++i) {
      const auto& x = cands_[std::size_t(chosen_[std::size_t(i)])];
      pages_[std::size_t(i)] = x.page;
      for (std::int64_t j = x.begin; j < x.end; ++j)
        recalled_[std::size_t(tokens++)] = {x.page, index_[std::size_t(j - n_cache)]};
    }
    return {std::span<const std::int32_t>(pages_.data(), std::size_t(nch)),
            std::span<const archived_token>(recalled_.data(), std::size_t(tokens)),
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
  std::int32_t max_cands_ = 0;  // candidate pages at most: the best and their neighbours
  std::vector<std::int32_t> held_, pages_;
  std::vector<std::int32_t> by_pos_, at_;  // a layer's pages in time order, each page's index there
  std::vector<std::uint8_t> mark_;         // the candidates among them
  std::vector<recall_candidate> cands_;
  std::vector<std::int32_t> index_;         // a candidate slot's index among its page's tokens
  std::vector<std::int64_t> turn_;          // ... and its turn to where it lands (rotary_pos)
  std::vector<std::int64_t> page_turn_;     // rotary_pos: each page's turn, for its bound
  std::vector<std::optional<rope>> ropes_;  // ... each archive layer's RoPE
  std::vector<archived_token> recalled_;
  std::vector<std::int64_t> work_, chosen_, displaced_;
  std::vector<layer_inputs<const_tensor_view>> inputs_;
  std::unique_ptr<workspace> ws_;
};

}  // namespace infkv::cpu
