// infkv's Python module: one layer's inputs (Tokens, Layer) and the pipeline over them: plans, runs, scores,
// select and the KeepSet.
#include "bindings.hpp"

namespace infkv_py {

void bind_pipeline(nb::module_& m) {
  nb::class_<tokens>(m, "Tokens", "Positions, segments and modalities of the cached slots, one entry per slot.")
      .def_static("from_arrays", &make_tokens, "positions"_a, "segments"_a.none() = nb::none(),
                  "kinds"_a.none() = nb::none())
      .def("__len__", [](const tokens& t) { return t.t.size(); })
      .def_prop_ro(
          "positions", [](const tokens& t) { return column<std::int64_t>(t, [](const auto& x) { return x.pos; }); },
          nb::rv_policy::move)
      .def_prop_ro(
          "segments", [](const tokens& t) { return column<std::int32_t>(t, [](const auto& x) { return x.segment; }); },
          nb::rv_policy::move)
      .def_prop_ro(
          "kinds", [](const tokens& t) { return column<std::uint8_t>(t, [](const auto& x) { return x.kind; }); },
          nb::rv_policy::move);
  m.def(
      "text_tokens",
      [](std::int64_t n, std::int64_t first, std::int32_t segment) {
        INFKV_REQUIRE(n >= 0, "n", n, "must be >= 0");
        return tokens{infkv::text_tokens(n, first, segment)};
      },
      "n"_a, "first"_a = 0, "segment"_a = 0, "Tokens of a plain text stream: positions first, first + 1, ...");

  nb::class_<infkv::layer_shape>(m, "LayerShape", "The shape of one layer as a plan sees it.")
      .def(
          "__init__",
          [](infkv::layer_shape* s, std::int64_t n_slots, std::int32_t kv_heads, std::int32_t q_heads,
             std::int32_t head_dim, std::int64_t n_queries) {
            new (s) infkv::layer_shape{n_slots, kv_heads, q_heads, head_dim, n_queries};
          },
          nb::kw_only(), "n_slots"_a, "kv_heads"_a = 1, "q_heads"_a = 0, "head_dim"_a = 0, "n_queries"_a = 0)
      .def_ro("n_slots", &infkv::layer_shape::n_slots)
      .def_ro("kv_heads", &infkv::layer_shape::kv_heads)
      .def_ro("q_heads", &infkv::layer_shape::q_heads)
      .def_ro("head_dim", &infkv::layer_shape::head_dim)
      .def_ro("n_queries", &infkv::layer_shape::n_queries);

  nb::class_<layer>(m, "Layer",
                    "One layer's inputs: post-RoPE keys / values [slots, kv_heads, head_dim] ('nhd') or "
                    "[kv_heads, slots, head_dim] ('hnd'), the last queries likewise with their positions, H2O's "
                    "accumulated scores [kv_heads, slots] (H2OState.scores). Arrays are viewed, not copied: keep "
                    "them unchanged while the layer is used.")
      .def(
          "__init__",
          [](layer* l, nb::object toks, std::optional<ro_array> keys, std::optional<ro_array> values,
             std::optional<ro_array> queries, std::optional<positions_array> query_pos,
             std::optional<scores_array> accumulated, float scale, std::optional<infkv::rope> rotary,
             const std::string& lay) {
            if (!nb::isinstance<tokens>(toks))
              infkv::fail_arg("tokens", nb::str(nb::handle(toks.type())).c_str(), "must be infkv.Tokens");
            layer checked{toks, keys, values, queries, query_pos, accumulated, scale, rotary, layout_of(lay)};
            (void)checked.inputs();  // checks every array before the object exists
            new (l) layer(std::move(checked));
          },
          "tokens"_a, nb::kw_only(), "keys"_a.none() = nb::none(), "values"_a.none() = nb::none(),
          "queries"_a.none() = nb::none(), "query_pos"_a.none() = nb::none(), "accumulated"_a.none() = nb::none(),
          "scale"_a = 0.f, "rotary"_a.none() = nb::none(), "layout"_a = "nhd")
      .def_prop_ro("shape", [](const layer& l) { return infkv::shape_of(l.inputs()); });

  nb::class_<infkv::plan_options>(m, "plan_options", "What a plan decides besides the policy and budget.")
      .def(
          "__init__",
          [](infkv::plan_options* o, infkv::granularity g, infkv::reduction r, std::int32_t n_layers,
             std::optional<infkv::adakv> a) {
            new (o) infkv::plan_options{g, r, n_layers, a};
          },
          nb::kw_only(), "granularity"_a = infkv::granularity::per_head, "reduction"_a = infkv::reduction::mean,
          "n_layers"_a = 1, "adakv"_a.none() = nb::none())
      .def_rw("granularity", &infkv::plan_options::g)
      .def_rw("reduction", &infkv::plan_options::r)
      .def_rw("n_layers", &infkv::plan_options::n_layers)
      .def_rw("adakv", &infkv::plan_options::adakv);

  nb::class_<py_plan>(m, "Plan", "A sized run of a policy on the CPU backend (make_plan).")
      .def_prop_ro("units", [](const py_plan& p) { return p.p.units; })
      .def_prop_ro("keep_per_unit", [](const py_plan& p) { return p.p.keep_per_unit; })
      .def_prop_ro("kept_total", [](const py_plan& p) { return p.p.kept_total; })
      .def_prop_ro("workspace_bytes", [](const py_plan& p) { return p.p.workspace_bytes; })
      .def_prop_ro("budget", [](const py_plan& p) { return p.p.effective; })
      .def_prop_ro("shape", [](const py_plan& p) { return p.p.shape; })
      .def_prop_ro("policy", [](const py_plan& p) { return std::string(p.p.spec.name); })
      .def_prop_ro("threads", [](const py_plan& p) { return p.threads; })
      .def("evicts", [](const py_plan& p) { return p.p.evicts(); });

  m.def(
      "make_plan",
      [](const any_policy& pol, const infkv::budget& b, nb::handle shape, std::optional<infkv::plan_options> opt,
         int threads) {
        py_plan p{{}, threads};
        (void)infkv::cpu::workers({.threads = threads}, 1);  // checks the thread count
        p.p = infkv::make_plan(p.backend(), spec_of(pol), b, shape_arg(shape), opt.value_or(infkv::plan_options{}));
        return p;
      },
      "policy"_a, "budget"_a, "shape"_a, "options"_a.none() = nb::none(), nb::kw_only(), "threads"_a = 1,
      "Plans a run of `policy` with `budget` over layers of `shape` (a LayerShape or a Layer) on `threads` CPU "
      "threads; checks every parameter against the shape.");
  m.def("run", &run, "plan"_a, "layers"_a,
        "Runs the plan (on its threads) over one Layer or a list of n_layers Layers sharing one Tokens; returns "
        "the KeepSet.");
  m.def("run_scores", &run_scores, "plan"_a, "layer"_a,
        "One layer's scores after the policy's finish (pooling, group mean, bias): float32 [rows, slots].");
  m.def(
      "reconstruction_scores",
      [](const layer& l, int threads) {
        INFKV_REQUIRE(l.keys && l.queries, "layer", l.keys ? "without queries" : "without keys",
                      "context-reconstruction scores read the keys and the reconstruction's queries");
        const auto in = l.inputs();
        (void)infkv::cpu::workers({.threads = threads}, 1);  // checks the thread count
        infkv::score_matrix s;
        {
          nb::gil_scoped_release unlocked;
          s = infkv::cpu::reconstruction(in, {.threads = threads});
        }
        return to_numpy(s.data, {std::size_t(s.rows), std::size_t(s.cols)});
      },
      "layer"_a, nb::kw_only(), "threads"_a = 1,
      "Context-reconstruction scores (KVzip) of one pass: per KV head and key, the largest softmax probability "
      "any of the layer's queries (those of the head's group) gives it, over the keys each sees; float32 "
      "[kv_heads, slots]. The layer's keys are all the queries attend to (the sinks, the chunk reconstructed, "
      "the reconstruction's own keys); take the maximum over passes for a longer context.");
  m.def(
      "select",
      [](const any_policy& pol, const infkv::budget& b, const layer& l, std::optional<infkv::granularity> g,
         infkv::reduction r, int threads) {
        const auto in = l.inputs();
        return std::visit(
            [&](const auto& p) {
              nb::gil_scoped_release unlocked;
              return infkv::cpu::select(p, b, in, g, r, {.threads = threads});
            },
            pol);
      },
      "policy"_a, "budget"_a, "layer"_a, nb::kw_only(), "granularity"_a.none() = nb::none(),
      "reduction"_a = infkv::reduction::mean, "threads"_a = 1,
      "One layer's KeepSet at `granularity` (default: the policy's natural one).");

  nb::class_<infkv::keep_set>(m, "KeepSet",
                              "Slots kept per decision unit (KV head, layer or token), each unit's in slot order.")
      .def_prop_ro("n_units", &infkv::keep_set::n_units)
      .def_prop_ro("n_slots", &infkv::keep_set::n_slots)
      .def("size", &infkv::keep_set::size, "unit"_a)
      .def(
          "unit",
          [](const infkv::keep_set& k, std::int64_t u) {
            const auto s = k.unit(u);
            return to_numpy(std::vector<std::int64_t>(s.begin(), s.end()));
          },
          "unit"_a = 0)
      .def(
          "mask",
          [](const infkv::keep_set& k, std::int64_t u) {
            (void)k.unit(u);  // checks u
            const auto m = k.mask(u);
            return to_numpy(std::vector<std::uint8_t>(m.begin(), m.end())).cast().attr("astype")("bool");
          },
          "unit"_a = 0)
      .def("uniform", &infkv::keep_set::uniform)
      .def("__len__", &infkv::keep_set::n_units);
}

}  // namespace infkv_py
