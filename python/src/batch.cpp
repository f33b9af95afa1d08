// infkv's Python module: batches of sequences (infkv/batch.hpp) as a serving engine holds them:
// one plan and one run over sequences of different lengths (keys per sequence, or one paged cache
// for the batch), and the compaction of a paged batch with its page table rewritten in place.
#include <infkv/batch.hpp>

#include "bindings.hpp"

namespace infkv_py {

namespace {

using index_array = nb::ndarray<nb::ro, std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using table_array = nb::ndarray<std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

std::vector<std::int64_t> vector_of(const index_array& a) { return {a.data(), a.data() + a.shape(0)}; }

/// A paged cache shared by a batch: K (and V) pages [n_pages, page_size, heads, head_dim] ('nhd')
/// or [n_pages, heads, page_size, head_dim] ('hnd'), and the CSR page table (int32 arrays the
/// caller owns; compact_paged rewrites them in place).
struct paged_cache {
  rw_array keys;
  std::optional<rw_array> values;
  table_array indptr, indices, last_page_len;
  layout lay = layout::nhd;

  infkv::page_storage storage(const rw_array& a, const std::string& name, const rw_array& like) const {
    INFKV_REQUIRE(a.ndim() == 4, name + ".ndim", a.ndim(), "must be 4 (pages, ",
                  lay == layout::nhd ? "page_size, heads" : "heads, page_size", ", head_dim)");
    require_cpu(a, name);
    INFKV_REQUIRE(a.dtype() == like.dtype() && a.ndim() == like.ndim() && a.shape(0) == like.shape(0) &&
                      a.shape(1) == like.shape(1) && a.shape(2) == like.shape(2) && a.shape(3) == like.shape(3),
                  name + ".shape", a.shape(0), "values must have the keys' shape and dtype");
    INFKV_REQUIRE(a.stride(3) == 1 || a.shape(3) <= 1, name + ".stride(3)", a.stride(3),
                  "head_dim must be contiguous (stride 1)");
    const std::size_t slot = lay == layout::nhd ? 1 : 2, head = 3 - slot;
    return {a.data(), a.stride(0), a.stride(slot), a.stride(head)};
  }

  infkv::paged_view view() const {
    const std::size_t slot = lay == layout::nhd ? 1 : 2, head = 3 - slot;
    infkv::paged_view p;
    p.k = storage(keys, "keys", keys);
    if (values) p.v = storage(*values, "values", keys);
    p.type = element_type(keys, "keys");
    INFKV_REQUIRE(keys.shape(0) <= std::size_t(INT32_MAX) && keys.shape(slot) <= std::size_t(INT32_MAX) &&
                      keys.shape(head) <= std::size_t(INT32_MAX) && keys.shape(3) <= std::size_t(INT32_MAX),
                  "keys.shape", keys.shape(0), "pages, page_size, heads and head_dim must fit in int32");
    p.n_heads = std::int32_t(keys.shape(head));
    p.head_dim = std::int32_t(keys.shape(3));
    p.page_size = std::int32_t(keys.shape(slot));
    p.n_pages = std::int32_t(keys.shape(0));
    INFKV_REQUIRE(indptr.shape(0) >= 1, "indptr.shape[0]", indptr.shape(0), "must be n_seqs + 1 >= 1");
    p.n_seqs = std::int32_t(indptr.shape(0) - 1);
    INFKV_REQUIRE(last_page_len.shape(0) == std::size_t(p.n_seqs), "last_page_len.shape[0]", last_page_len.shape(0),
                  "must be n_seqs (", p.n_seqs, ")");
    p.indptr = indptr.data();
    p.indices = indices.data();
    p.last_page_len = last_page_len.data();
    INFKV_REQUIRE(indptr.data()[p.n_seqs] >= 0 && std::size_t(indptr.data()[p.n_seqs]) <= indices.shape(0),
                  "indptr[n_seqs]", indptr.data()[p.n_seqs], "must be at most indices.shape[0] (", indices.shape(0),
                  ")");
    infkv::validate(p, "cache");
    return p;
  }
};

/// One layer of a batch's inputs: the batch's tokens, keys per sequence (a list of 3-D arrays) or
/// a paged cache, the window queries of every sequence concatenated, H2O's accumulated scores
/// [kv_heads, batch slots].
struct batch_layer {
  nb::object tokens_obj;
  std::vector<ro_array> keys, values;
  std::optional<nb::object> paged;  // a paged_cache
  std::optional<ro_array> queries;
  std::optional<positions_array> query_pos;
  std::optional<scores_array> accumulated;
  float scale = 0.f;
  std::optional<infkv::rope> rotary;
  layout lay = layout::nhd;

  /// The views, held while a run uses them.
  struct views {
    std::vector<infkv::const_tensor_view> keys, values;
    std::vector<infkv::const_paged_rows> paged_keys, paged_values;
  };

  template <class R>
  infkv::batch_inputs<R> inputs(views& v) const {
    infkv::batch_inputs<R> in;
    in.tokens = nb::cast<const tokens&>(tokens_obj).t;
    if constexpr (std::is_same_v<R, infkv::const_paged_rows>) {
      const infkv::paged_view p = nb::cast<const paged_cache&>(*paged).view();
      for (std::int32_t s = 0; s < p.n_seqs; ++s) {
        v.paged_keys.push_back(infkv::key_rows(p, s));
        if (p.v.data) v.paged_values.push_back(infkv::value_rows(p, s));
      }
      in.keys = v.paged_keys, in.values = v.paged_values;
    } else {
      for (std::size_t s = 0; s < keys.size(); ++s)
        v.keys.push_back(view_of<infkv::const_tensor_view>(keys[s], "keys[" + std::to_string(s) + "]", lay));
      for (std::size_t s = 0; s < values.size(); ++s)
        v.values.push_back(view_of<infkv::const_tensor_view>(values[s], "values[" + std::to_string(s) + "]", lay));
      in.keys = v.keys, in.values = v.values;
    }
    if (queries) {
      in.queries = view_of<infkv::const_tensor_view>(*queries, "queries", layout::nhd);
      INFKV_REQUIRE(query_pos.has_value(), "query_pos", "None", "queries need their positions");
      in.query_pos = {query_pos->data(), query_pos->shape(0)};
    }
    if (accumulated)
      in.accumulated = {accumulated->data(), std::int64_t(accumulated->shape(0)), std::int64_t(accumulated->shape(1)),
                        std::int64_t(accumulated->shape(1))};
    in.scale = scale;
    in.rotary = rotary;
    return in;
  }
};

struct py_batch_plan {
  infkv::batch_plan p;
  int threads = 1;
  infkv::cpu::backend backend() const { return {{.threads = threads}}; }
};

template <class R>
std::vector<infkv::keep_set> run_batch_as(const py_batch_plan& p, const std::vector<const batch_layer*>& layers) {
  std::vector<batch_layer::views> views(layers.size());
  std::vector<infkv::batch_inputs<R>> in;
  for (std::size_t l = 0; l < layers.size(); ++l) in.push_back(layers[l]->template inputs<R>(views[l]));
  infkv::cpu::workspace ws(p.p.workspace_bytes);
  std::vector<std::int64_t> slots(std::size_t(p.p.kept_total())), offsets(std::size_t(p.p.offsets_size()));
  const infkv::batch_keep_view out = p.p.keep(slots.data(), offsets.data());
  {
    nb::gil_scoped_release unlocked;
    infkv::run(p.p, p.backend(), std::span<const infkv::batch_inputs<R>>(in), ws.span(), out);
  }
  std::vector<infkv::keep_set> keeps;
  for (std::int32_t s = 0; s < p.p.n_seqs(); ++s) keeps.push_back(infkv::keep_set::from_view(out.seq(s)));
  return keeps;
}

}  // namespace

void bind_batch(nb::module_& m) {
  nb::class_<paged_cache>(
      m, "PagedCache",
      "A paged KV cache shared by a batch: keys (and values) [n_pages, page_size, heads, head_dim] "
      "('nhd') or [n_pages, heads, page_size, head_dim] ('hnd'), and its CSR page table: sequence s "
      "owns pages indices[indptr[s]:indptr[s + 1]], all full but the last, which holds "
      "last_page_len[s] slots (int32 arrays, viewed: compact_paged rewrites them in place).")
      .def(
          "__init__",
          [](paged_cache* c, rw_array keys, std::optional<rw_array> values, table_array indptr, table_array indices,
             table_array last_page_len, const std::string& lay) {
            paged_cache checked{keys, values, indptr, indices, last_page_len, layout_of(lay)};
            (void)checked.view();  // checks every array before the object exists
            new (c) paged_cache(std::move(checked));
          },
          "keys"_a, "values"_a.none(), nb::kw_only(), "indptr"_a, "indices"_a, "last_page_len"_a, "layout"_a = "nhd")
      .def("seq_len", [](const paged_cache& c, std::int32_t s) {
        const infkv::paged_view p = c.view();
        INFKV_REQUIRE(s >= 0 && s < p.n_seqs, "seq", s, "must be in [0, n_seqs = ", p.n_seqs, ")");
        return p.seq_len(s);
      });

  nb::class_<batch_layer>(m, "BatchLayer",
                          "One layer of a batch's inputs: the batch's Tokens (every sequence's, one after another), "
                          "keys as a list of one array per sequence (layout as Layer's) or a PagedCache, the window "
                          "queries of every sequence one after another [queries, q_heads, head_dim] with their "
                          "positions, H2O's accumulated scores [kv_heads, batch slots]. Arrays are viewed, not copied.")
      .def(
          "__init__",
          [](batch_layer* b, nb::object toks, nb::object keys, std::optional<std::vector<ro_array>> values,
             std::optional<ro_array> queries, std::optional<positions_array> query_pos,
             std::optional<scores_array> accumulated, float scale, std::optional<infkv::rope> rotary,
             const std::string& lay) {
            if (!nb::isinstance<tokens>(toks))
              infkv::fail_arg("tokens", nb::str(nb::handle(toks.type())).c_str(), "must be infkv.Tokens");
            batch_layer l{toks,          {},      values.value_or(std::vector<ro_array>{}),
                          std::nullopt,  queries, query_pos,
                          accumulated,   scale,   rotary,
                          layout_of(lay)};
            if (nb::isinstance<paged_cache>(keys)) {
              INFKV_REQUIRE(!values, "values", "a list", "a PagedCache holds its own values");
              l.paged = keys;
            } else {
              l.keys = nb::cast<std::vector<ro_array>>(keys);
            }
            new (b) batch_layer(std::move(l));
          },
          "tokens"_a, nb::kw_only(), "keys"_a, "values"_a.none() = nb::none(), "queries"_a.none() = nb::none(),
          "query_pos"_a.none() = nb::none(), "accumulated"_a.none() = nb::none(), "scale"_a = 0.f,
          "rotary"_a.none() = nb::none(), "layout"_a = "nhd");

  nb::class_<py_batch_plan>(m, "BatchPlan", "A sized run of a policy over a batch of sequences (make_batch_plan).")
      .def_prop_ro("n_seqs", [](const py_batch_plan& p) { return p.p.n_seqs(); })
      .def_prop_ro("kept_total", [](const py_batch_plan& p) { return p.p.kept_total(); })
      .def_prop_ro("workspace_bytes", [](const py_batch_plan& p) { return p.p.workspace_bytes; })
      .def(
          "kept",
          [](const py_batch_plan& p, std::int32_t s) {
            INFKV_REQUIRE(s >= 0 && s < p.p.n_seqs(), "seq", s, "must be in [0, n_seqs = ", p.p.n_seqs(), ")");
            return p.p.seqs[std::size_t(s)].kept_total;
          },
          "seq"_a, "Slots sequence `seq` keeps (every unit together).");

  m.def(
      "make_batch_plan",
      [](const any_policy& pol, nb::object budgets, index_array slot_indptr, std::optional<index_array> query_indptr,
         std::int32_t kv_heads, std::int32_t q_heads, std::int32_t head_dim, std::optional<infkv::plan_options> opt,
         int threads) {
        std::vector<infkv::budget> b;
        if (nb::isinstance<infkv::budget>(budgets))
          b.push_back(nb::cast<infkv::budget>(budgets));
        else
          b = nb::cast<std::vector<infkv::budget>>(budgets);
        (void)infkv::cpu::workers({.threads = threads}, 1);  // checks the thread count
        const std::vector<std::int64_t> slots = vector_of(slot_indptr),
                                        queries = query_indptr ? vector_of(*query_indptr) : std::vector<std::int64_t>{};
        py_batch_plan p{{}, threads};
        p.p = infkv::make_batch_plan(p.backend(), spec_of(pol), b, {slots, queries, kv_heads, q_heads, head_dim},
                                     opt.value_or(infkv::plan_options{}));
        return p;
      },
      "policy"_a, "budgets"_a, nb::kw_only(), "slot_indptr"_a, "query_indptr"_a.none() = nb::none(), "kv_heads"_a = 1,
      "q_heads"_a = 0, "head_dim"_a = 0, "options"_a.none() = nb::none(), "threads"_a = 1,
      "Plans `policy` over a batch: sequence s holds slots slot_indptr[s]:slot_indptr[s + 1] of the batch and window "
      "queries query_indptr[s]:query_indptr[s + 1]; `budgets` is one Budget for all or one per sequence. Each "
      "sequence is checked as make_plan checks one (the message names it).");
  m.def(
      "run_batch",
      [](const py_batch_plan& p, nb::handle layers_h) {
        std::vector<const batch_layer*> layers;
        if (nb::isinstance<batch_layer>(layers_h)) {
          layers.push_back(&nb::cast<const batch_layer&>(layers_h));
        } else {
          for (nb::handle x : layers_h) {
            if (!nb::isinstance<batch_layer>(x))
              infkv::fail_arg("layers", nb::str(nb::handle(x.type())).c_str(), "must hold infkv.BatchLayer values");
            layers.push_back(&nb::cast<const batch_layer&>(x));
          }
        }
        INFKV_REQUIRE(!layers.empty(), "layers", "empty", "give one BatchLayer per layer of the decision");
        const bool paged = layers[0]->paged.has_value();
        for (std::size_t l = 1; l < layers.size(); ++l)
          INFKV_REQUIRE(layers[l]->paged.has_value() == paged, "layers[" + std::to_string(l) + "].keys",
                        paged ? "a list" : "a PagedCache", "every layer's keys must be of one kind");
        return paged ? run_batch_as<infkv::const_paged_rows>(p, layers)
                     : run_batch_as<infkv::const_tensor_view>(p, layers);
      },
      "plan"_a, "layers"_a,
      "Runs the batch plan over one BatchLayer or a list of n_layers; returns one KeepSet per sequence, each equal to "
      "that sequence's own run.");
  m.def(
      "compact_paged",
      [](paged_cache& c, tokens& t, const std::vector<infkv::keep_set>& keeps) {
        const infkv::paged_view p = c.view();
        INFKV_REQUIRE(std::int64_t(keeps.size()) == p.n_seqs, "len(keeps)", keeps.size(), "must be n_seqs (", p.n_seqs,
                      ")");
        std::vector<std::int64_t> slot_indptr{0}, unit_indptr{0}, kept_indptr{0}, slots, offsets;
        for (std::size_t s = 0; s < keeps.size(); ++s) {
          const infkv::const_keep_view k = keeps[s].view();
          slot_indptr.push_back(slot_indptr.back() + k.n_slots);
          unit_indptr.push_back(unit_indptr.back() + k.n_units);
          kept_indptr.push_back(kept_indptr.back() + k.offsets[k.n_units]);
          offsets.insert(offsets.end(), k.offsets, k.offsets + k.n_units + 1);
          slots.insert(slots.end(), k.slots, k.slots + k.offsets[k.n_units]);
        }
        const infkv::const_batch_keep_view keep{slots.data(),       offsets.data(),     slot_indptr.data(),
                                                unit_indptr.data(), kept_indptr.data(), p.n_seqs};
        std::vector<std::int32_t> freed(std::size_t(p.indptr[p.n_seqs]));
        const infkv::page_table_out out{{c.indptr.data(), c.indptr.shape(0)},
                                        {c.indices.data(), c.indices.shape(0)},
                                        {c.last_page_len.data(), c.last_page_len.shape(0)},
                                        freed};
        std::int64_t n_freed = 0;
        {
          nb::gil_scoped_release unlocked;
          n_freed = infkv::cpu::compact(p, t.t, keep, out);
        }
        t.t.resize(std::size_t(kept_indptr.back()));
        freed.resize(std::size_t(n_freed));
        return to_numpy(std::move(freed));
      },
      "cache"_a, "tokens"_a, "keeps"_a,
      "Compacts every sequence of the paged batch in place: sequence s keeps keeps[s] (one unit), moved to the front "
      "of its own pages, K and V alike; the batch's Tokens are packed alike; the page table (indptr, indices, "
      "last_page_len) is rewritten in place. Everything is checked before anything moves. Returns the freed pages.");
}

}  // namespace infkv_py
