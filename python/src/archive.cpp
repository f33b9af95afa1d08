// infkv's Python module: the archive (what evictions remove, quantized, in bounded host memory)
// and recall over it, on the CPU backend.
#include <memory>
#include <optional>
#include <vector>

#include "bindings.hpp"

namespace infkv_py {

namespace {

infkv::when_full when_full_of(const std::string& s) {
  if (s == "drop_oldest") return infkv::when_full::drop_oldest;
  if (s == "error") return infkv::when_full::error;
  infkv::fail_arg("when_full", "'" + s + "'", "must be 'drop_oldest' or 'error'");
}

/// A keep set from one 1-D int64 array of kept slots per unit.
infkv::keep_set keep_of(nb::handle keep, std::int64_t n_slots) {
  if (nb::isinstance<infkv::keep_set>(keep)) return nb::cast<infkv::keep_set>(keep);
  infkv::keep_set k(n_slots);
  for (nb::handle u : keep) {
    const auto a = nb::cast<positions_array>(u);
    k.add_unit({a.data(), a.shape(0)});
  }
  return k;
}

/// The queries of every archive layer, [queries, q_heads, head_dim] each.
std::vector<infkv::const_tensor_view> queries_of(const std::vector<ro_array>& q) {
  std::vector<infkv::const_tensor_view> out;
  for (std::size_t l = 0; l < q.size(); ++l)
    out.push_back(view_of<infkv::const_tensor_view>(q[l], ("queries[" + std::to_string(l) + "]").c_str(), layout::nhd));
  return out;
}

}  // namespace

void bind_archive(nb::module_& m) {
  nb::class_<infkv::archive>(
      m, "Archive",
      "What evictions remove, kept quantized in bounded host memory: pages of up to page_tokens evicted slots of "
      "one decision unit, keys per channel and values per token at key_bits / value_bits (2, 4 or 8), the "
      "slots' tokens. At most capacity_bytes; when full, 'drop_oldest' drops the earliest page, 'error' raises.")
      .def(
          "__init__",
          [](infkv::archive* a, std::int32_t n_layers, std::int32_t kv_heads, std::int32_t head_dim,
             std::size_t capacity_bytes, infkv::granularity g, std::int32_t page_tokens, std::int32_t key_bits,
             std::int32_t value_bits, std::int32_t value_group, const std::string& full) {
            infkv::archive_options o;
            o.page_tokens = page_tokens, o.key_bits = key_bits, o.value_bits = value_bits;
            o.value_group = value_group, o.capacity_bytes = capacity_bytes, o.full = when_full_of(full);
            new (a) infkv::archive(infkv::archive_shape{n_layers, kv_heads, head_dim, g}, o);
          },
          nb::kw_only(), "n_layers"_a, "kv_heads"_a, "head_dim"_a, "capacity_bytes"_a,
          "granularity"_a = infkv::granularity::per_layer, "page_tokens"_a = 32, "key_bits"_a = 4, "value_bits"_a = 4,
          "value_group"_a = 0, "when_full"_a = "drop_oldest")
      .def_prop_ro("capacity_pages", &infkv::archive::capacity_pages)
      .def_prop_ro("held_pages", &infkv::archive::held_pages)
      .def_prop_ro("held_tokens", &infkv::archive::held_tokens)
      .def_prop_ro("held_bytes", &infkv::archive::held_bytes)
      .def_prop_ro("memory", &infkv::archive::memory, "Bytes the archive holds in all (allocated at construction).")
      .def_prop_ro("stats",
                   [](const infkv::archive& a) {
                     const auto& s = a.stats();
                     nb::dict d;
                     d["archived_pages"] = s.archived_pages, d["archived_tokens"] = s.archived_tokens;
                     d["dropped_pages"] = s.dropped_pages, d["dropped_tokens"] = s.dropped_tokens;
                     d["released_pages"] = s.released_pages, d["released_tokens"] = s.released_tokens;
                     return d;
                   })
      .def("held", &infkv::archive::held, "The held pages, oldest first.")
      .def(
          "page",
          [](const infkv::archive& a, std::int32_t p) {
            const auto& i = a.info(p);
            const auto t = a.tokens(p);
            nb::dict d;
            d["layer"] = i.layer, d["unit"] = i.unit, d["n_tokens"] = i.n_tokens;
            d["tokens"] = tokens{{t.begin(), t.end()}};
            return d;
          },
          "page"_a, "A held page: its layer, unit, token count and Tokens.")
      .def(
          "archive",
          [](infkv::archive& a, nb::handle layers_h, nb::handle keep_h, std::int32_t layer) {
            const auto in = inputs_of(layers_h);
            INFKV_REQUIRE(!in.empty(), "layers", "empty", "needs at least one Layer");
            const infkv::keep_set keep = keep_of(keep_h, std::int64_t(in[0].tokens.size()));
            infkv::cpu::workspace ws(infkv::cpu::archive_scratch_bytes(a, std::int64_t(in[0].tokens.size())));
            nb::gil_scoped_release unlocked;
            return infkv::cpu::archive_evicted(a, std::span<const infkv::layer_inputs<>>(in), keep, ws.span(), layer);
          },
          "layers"_a, "keep"_a, nb::kw_only(), "layer"_a = 0,
          "Archives what `keep` (a KeepSet, or one array of kept slots per unit) evicts from `layers` (one Layer "
          "with keys and values, or every layer's for per_token); returns the pages added. A failing call changes "
          "nothing.")
      .def(
          "restore",
          [](const infkv::archive& a, std::int32_t p) {
            const auto& s = a.shape();
            const auto& i = a.info(p);
            const std::size_t L = std::size_t(s.layers_per_page()), n = std::size_t(i.n_tokens),
                              H = std::size_t(s.kv_heads), d = std::size_t(s.head_dim);
            std::vector<float> k(L * n * H * d, 0.f), v(k.size(), 0.f);
            std::vector<infkv::kv_view> out;
            for (std::size_t l = 0; l < L; ++l)
              out.push_back(infkv::contiguous_nhd(k.data() + l * n * H * d, v.data() + l * n * H * d, infkv::dtype::f32,
                                                  std::int64_t(n), std::int32_t(H), std::int32_t(d)));
            infkv::cpu::restore(a, p, out, 0);
            return nb::make_tuple(to_numpy(std::move(k), {L, n, H, d}), to_numpy(std::move(v), {L, n, H, d}));
          },
          "page"_a,
          "A page's dequantized (keys, values), float32 [layers of the page, tokens, kv_heads, head_dim] (a per_head "
          "page fills its head only).")
      .def("release", &infkv::archive::release, "page"_a, "Removes a held page (taken back into the cache).")
      .def("clear", &infkv::archive::clear)
      .def(
          "bounds",
          [](const infkv::archive& a, const std::vector<ro_array>& queries, float scale) {
            const auto q = queries_of(queries);
            std::vector<float> out(std::size_t(a.capacity_pages()));
            infkv::cpu::page_bounds(a, q, scale, out);
            return to_numpy(std::move(out));
          },
          "queries"_a, "scale"_a,
          "Per page slot (-inf where none is held) the upper bound on its logits for `queries` (one [n, q_heads, "
          "head_dim] array per archive layer).");

  nb::class_<infkv::cpu::recaller>(
      m, "Recaller",
      "Recall over an Archive for one policy (a source that reads queries) and the cache's budget: ranks pages by "
      "their bounds, scores the best `candidates` and their `neighbours` on each side beside the cache with the "
      "policy's pipeline and decides which tokens come back (at most budget_tokens) and which cached slots they "
      "displace (never sinks or recent). `below`: only pages whose every token lies below this position come back; "
      "`layers`: the layers whose scores rank and place (ascending; empty: every layer); `distance`: rank every "
      "page as if its first token stood this many positions before the newest cached token (position-agnostic; "
      "needs each Layer's `rotary`; None: where it would land).")
      .def(
          "__init__",
          [](infkv::cpu::recaller* r, const infkv::archive& a, const any_policy& pol, const infkv::budget& b,
             std::int64_t budget_tokens, std::int32_t candidates, std::int64_t max_cache_slots, std::int32_t q_heads,
             std::int64_t max_queries, bool recency_bias, std::int32_t neighbours, int threads,
             std::optional<std::int64_t> below, std::vector<std::int32_t> layers,
             std::optional<std::int64_t> distance) {
            (void)infkv::cpu::workers({.threads = threads}, 1);  // checks the thread count
            const infkv::cpu::recall_options o{.budget_tokens = budget_tokens,
                                               .candidates = candidates,
                                               .recency_bias = recency_bias,
                                               .neighbours = neighbours,
                                               .below = below,
                                               .layers = std::move(layers),
                                               .distance = distance};
            std::visit(
                [&](const auto& p) {
                  new (r) infkv::cpu::recaller(a, p, b, o, max_cache_slots, q_heads, max_queries,
                                               infkv::cpu::backend{{.threads = threads}});
                },
                pol);
          },
          "archive"_a, "policy"_a, "budget"_a, nb::kw_only(), "budget_tokens"_a, "candidates"_a = 32,
          "max_cache_slots"_a, "q_heads"_a, "max_queries"_a, "recency_bias"_a = true, "neighbours"_a = 1,
          "threads"_a = 1, "below"_a = nb::none(), "layers"_a = std::vector<std::int32_t>{}, "distance"_a = nb::none())
      .def(
          "recall",
          [](infkv::cpu::recaller& r, const infkv::archive& a, nb::handle layers_h,
             const std::vector<ro_array>& queries, positions_array query_pos, float scale, std::int32_t layer,
             std::optional<positions_array> rotary_pos) {
            const auto in = inputs_of(layers_h);
            const auto q = queries_of(queries);
            infkv::cpu::recall_result res;
            {
              nb::gil_scoped_release unlocked;
              res = r.recall(a, std::span<const infkv::layer_inputs<>>(in), q,
                             std::span<const std::int64_t>(query_pos.data(), query_pos.shape(0)), scale, layer,
                             rotary_pos ? std::span<const std::int64_t>(rotary_pos->data(), rotary_pos->shape(0))
                                        : std::span<const std::int64_t>{});
            }
            std::vector<std::int32_t> recalled;
            for (const auto& t : res.recalled) recalled.push_back(t.page), recalled.push_back(t.index);
            const std::size_t m = res.recalled.size();
            return nb::make_tuple(to_numpy(std::vector<std::int32_t>(res.pages.begin(), res.pages.end())),
                                  to_numpy(std::move(recalled), {m, std::size_t(2)}),
                                  to_numpy(std::vector<std::int64_t>(res.displaced.begin(), res.displaced.end())));
          },
          "archive"_a, "layers"_a, "queries"_a, "query_pos"_a, "scale"_a, nb::kw_only(), "layer"_a = 0,
          "rotary_pos"_a.none() = nb::none(),
          "(pages, recalled, displaced) for `queries` (one [n, q_heads, head_dim] array per archive layer, "
          "positions `query_pos`) against the cache `layers` (one Layer with keys, and values where the policy "
          "weights by them; every layer's for per_token): the pages chosen, the archived tokens that come back "
          "(int32 [m, 2]: page, index among the page's tokens; those the cache does not hold) and the m cached "
          "slots they displace. The pages stay archived. `rotary_pos` (compact positions): the cache's tokens and "
          "query_pos carry the stream's positions, the cache's keys and the queries are rotated at these (one per "
          "cached slot); candidates' keys are turned to where they would land, with each Layer's `rotary`.");
}

}  // namespace infkv_py
