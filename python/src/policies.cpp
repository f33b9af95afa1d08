// infkv's Python module: the policies and what they are made of: budgets, RoPE, the attention bias, AdaKV,
// capture needs, every policy (H2O with its state, union_of), and the questions asked of a policy.
#include "bindings.hpp"

namespace infkv_py {

void bind_policies(nb::module_& m) {
  nb::class_<infkv::budget>(m, "budget",
                            "Slots one decision unit keeps: capacity or ratio, plus protected sinks and recent.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](infkv::budget* b, std::int64_t capacity, double ratio, std::int64_t sinks, std::int64_t recent) {
            new (b) infkv::budget{capacity, ratio, sinks, recent};
            b->validate();
          },
          nb::kw_only(), "capacity"_a = 0, "ratio"_a = 0.0, "sinks"_a = 0, "recent"_a = 0)
      .def_rw("capacity", &infkv::budget::capacity)
      .def_rw("ratio", &infkv::budget::ratio)
      .def_rw("sinks", &infkv::budget::sinks)
      .def_rw("recent", &infkv::budget::recent)
      .def("validate", &infkv::budget::validate)
      .def("keep_count", &infkv::budget::keep_count, "n_slots"_a)
      .def("__repr__", &repr_budget);

  nb::class_<infkv::rope>(m, "rope", "RoPE parameters: pair i turns by freq_scale * theta^(-2i/dims) per position.")
      .def(
          "__init__",
          [](infkv::rope* r, double theta, std::int32_t dims, infkv::rope_style style, double freq_scale) {
            new (r) infkv::rope{theta, dims, style, freq_scale};
            r->validate();
          },
          nb::kw_only(), "theta"_a = 10000.0, "dims"_a = 0, "style"_a = infkv::rope_style::normal, "freq_scale"_a = 1.0)
      .def_rw("theta", &infkv::rope::theta)
      .def_rw("dims", &infkv::rope::dims)
      .def_rw("style", &infkv::rope::style)
      .def_rw("freq_scale", &infkv::rope::freq_scale);

  nb::class_<infkv::attention_bias>(m, "attention_bias",
                                    "Inf-MLLM's attention bias toward newer tokens (beta = 0: none).")
      .def(
          "__init__",
          [](infkv::attention_bias* b, double beta, infkv::decay shape, infkv::age_unit unit, double rate) {
            new (b) infkv::attention_bias{beta, shape, unit, rate};
            b->validate();
          },
          nb::kw_only(), "beta"_a = 0.0, "shape"_a = infkv::decay::linear, "unit"_a = infkv::age_unit::positions,
          "rate"_a = 4.0)
      .def_rw("beta", &infkv::attention_bias::beta)
      .def_rw("shape", &infkv::attention_bias::shape)
      .def_rw("unit", &infkv::attention_bias::unit)
      .def_rw("rate", &infkv::attention_bias::rate);

  nb::class_<infkv::adakv>(m, "adakv", "AdaKV: a layer's budget shared between its heads by score.")
      .def(
          "__init__",
          [](infkv::adakv* a, double alpha) {
            new (a) infkv::adakv{alpha};
            a->validate();
          },
          nb::kw_only(), "alpha"_a = 0.2)
      .def_rw("alpha", &infkv::adakv::alpha);

  nb::class_<infkv::capture_needs>(m, "capture_needs", "What a policy reads from an engine, per layer.")
      .def_ro("keys", &infkv::capture_needs::keys)
      .def_ro("values", &infkv::capture_needs::values)
      .def_ro("queries", &infkv::capture_needs::queries)
      .def_ro("attention", &infkv::capture_needs::attention)
      .def_ro("rope", &infkv::capture_needs::rope)
      .def("observes", &infkv::capture_needs::observes);

  // Policies: keyword-constructed values with the C++ names and defaults, checked on construction.
  nb::class_<infkv::streaming_llm>(m, "streaming_llm", "StreamingLLM: sinks + the most recent tokens.")
      .def(nb::init<>())
      .def("__repr__", [](const infkv::streaming_llm&) { return std::string("streaming_llm()"); })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::streaming_llm::name); });
  nb::class_<infkv::tova>(m, "tova", "TOVA: the slots the last query attends to most, all heads averaged.")
      .def(nb::init<>())
      .def("__repr__", [](const infkv::tova&) { return std::string("tova()"); })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::tova::name); });
  nb::class_<infkv::snapkv>(m, "snapkv", "SnapKV: window attention, pooled along time; the window kept.")
      .def(
          "__init__",
          [](infkv::snapkv* p, std::int64_t window, std::int32_t kernel, infkv::pooling pool) {
            new (p) infkv::snapkv{window, kernel, pool};
            p->validate();
          },
          nb::kw_only(), "window"_a = 32, "kernel"_a = 5, "pool"_a = infkv::pooling::avg)
      .def_rw("window", &infkv::snapkv::window)
      .def_rw("kernel", &infkv::snapkv::kernel)
      .def_rw("pool", &infkv::snapkv::pool)
      .def("__repr__",
           [](const infkv::snapkv& p) {
             return infkv::cat("snapkv(window=", p.window, ", kernel=", p.kernel, ", pool=", to_string(p.pool), ")");
           })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::snapkv::name); });
  nb::class_<infkv::keydiff>(m, "keydiff", "KeyDiff: the keys least like the mean unit key.")
      .def(
          "__init__",
          [](infkv::keydiff* p, infkv::pooling pool, std::int32_t kernel) {
            new (p) infkv::keydiff{pool, kernel};
            p->validate();
          },
          nb::kw_only(), "pool"_a = infkv::pooling::none, "kernel"_a = 1)
      .def_rw("pool", &infkv::keydiff::pool)
      .def_rw("kernel", &infkv::keydiff::kernel)
      .def("__repr__",
           [](const infkv::keydiff& p) {
             return infkv::cat("keydiff(pool=", to_string(p.pool), ", kernel=", p.kernel, ")");
           })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::keydiff::name); });
  nb::class_<infkv::inf_mllm>(m, "inf_mllm", "Inf-MLLM: recent tokens + attention saddles, with an attention bias.")
      .def(
          "__init__",
          [](infkv::inf_mllm* p, std::int64_t window, std::int32_t kernel, infkv::pooling pool,
             infkv::attention_bias bias, bool value_norm) {
            new (p) infkv::inf_mllm{window, kernel, pool, bias, value_norm};
            p->validate();
          },
          nb::kw_only(), "window"_a = 32, "kernel"_a = 5, "pool"_a = infkv::pooling::sum,
          "bias"_a = infkv::attention_bias{}, "value_norm"_a = false)
      .def_rw("window", &infkv::inf_mllm::window)
      .def_rw("kernel", &infkv::inf_mllm::kernel)
      .def_rw("pool", &infkv::inf_mllm::pool)
      .def_rw("bias", &infkv::inf_mllm::bias)
      .def_rw("value_norm", &infkv::inf_mllm::value_norm)
      .def("__repr__",
           [](const infkv::inf_mllm& p) {
             return infkv::cat("inf_mllm(window=", p.window, ", kernel=", p.kernel, ", pool=", to_string(p.pool),
                               ", bias.beta=", p.bias.beta, ", value_norm=", p.value_norm ? "True" : "False", ")");
           })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::inf_mllm::name); });
  nb::class_<infkv::expected_attention>(m, "expected_attention",
                                        "Expected Attention: the attention future queries are expected to give.")
      .def(
          "__init__",
          [](infkv::expected_attention* p, std::int64_t window, std::optional<infkv::rope> rotary, std::int64_t future,
             std::int64_t sinks, bool covariance, bool value_norm) {
            new (p) infkv::expected_attention{window, rotary, future, sinks, covariance, value_norm};
            p->validate();
          },
          nb::kw_only(), "window"_a = 64, "rotary"_a.none() = infkv::rope{}, "future"_a = 512, "sinks"_a = 4,
          "covariance"_a = true, "value_norm"_a = true)
      .def_rw("window", &infkv::expected_attention::window)
      .def_rw("rotary", &infkv::expected_attention::rotary)
      .def_rw("future", &infkv::expected_attention::future)
      .def_rw("sinks", &infkv::expected_attention::sinks)
      .def_rw("covariance", &infkv::expected_attention::covariance)
      .def_rw("value_norm", &infkv::expected_attention::value_norm)
      .def("__repr__",
           [](const infkv::expected_attention& p) {
             return infkv::cat("expected_attention(window=", p.window,
                               ", rotary.theta=", p.rotary ? std::to_string(p.rotary->theta) : std::string("None"),
                               ", future=", p.future, ", sinks=", p.sinks,
                               ", covariance=", p.covariance ? "True" : "False",
                               ", value_norm=", p.value_norm ? "True" : "False", ")");
           })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::expected_attention::name); });

  nb::class_<infkv::h2o>(m, "h2o",
                         "H2O: heavy hitters by the attention accumulated over every decode (H2OState) + recent.")
      .def(
          "__init__",
          [](infkv::h2o* p, bool normalize_lifetime, double forgetting) {
            new (p) infkv::h2o{normalize_lifetime, forgetting};
            p->validate();
          },
          nb::kw_only(), "normalize_lifetime"_a = false, "forgetting"_a = 1.0)
      .def_rw("normalize_lifetime", &infkv::h2o::normalize_lifetime)
      .def_rw("forgetting", &infkv::h2o::forgetting)
      .def("__repr__",
           [](const infkv::h2o& p) {
             return infkv::cat("h2o(normalize_lifetime=", p.normalize_lifetime ? "True" : "False",
                               ", forgetting=", p.forgetting, ")");
           })
      .def_prop_ro_static("name", [](nb::handle) { return std::string(infkv::h2o::name); });
  nb::class_<py_union>(m, "union_of",
                       "Two policies' selections united: `share` of the room after the protected tokens by the "
                       "first's scores, the rest by the second's among the others (one decision per layer).")
      .def(
          "__init__",
          [](py_union* u, const any_policy& first, const any_policy& second, double share) {
            py_union made{spec_of(first), spec_of(second), share, ""};
            made.validate();
            const auto text = [](const any_policy& p) { return std::string(nb::repr(nb::cast(p)).c_str()); };
            made.text = infkv::cat("union_of(", text(first), ", ", text(second), ", share=", share, ")");
            new (u) py_union(std::move(made));
          },
          "first"_a, "second"_a, "share"_a = 0.5)
      .def_ro("share", &py_union::share)
      .def("__repr__", [](const py_union& u) { return u.text; })
      .def_prop_ro_static("name", [](nb::handle) { return std::string("union_of"); });

  nb::class_<infkv::cpu::h2o_state>(m, "H2OState",
                                    "H2O's accumulated attention per (KV head, slot), kept in the cache's slot order: "
                                    "append new slots, observe each decode's queries, evict as the cache is.")
      .def(
          "__init__",
          [](infkv::cpu::h2o_state* s, const infkv::h2o& policy, std::int32_t n_kv_heads) {
            new (s) infkv::cpu::h2o_state(policy, n_kv_heads);
          },
          "policy"_a, "n_kv_heads"_a)
      .def_prop_ro("n_slots", &infkv::cpu::h2o_state::n_slots)
      .def("append", &infkv::cpu::h2o_state::append, "n"_a, "New slots at the end of the cache, with no mass yet.")
      .def(
          "observe",
          [](infkv::cpu::h2o_state& s, const layer& l, int threads) {
            const auto in = l.inputs();
            nb::gil_scoped_release unlocked;
            infkv::cpu::observe(s, in, {.threads = threads});
          },
          "layer"_a, nb::kw_only(), "threads"_a = 1,
          "Adds the attention the layer's queries (one decode step) give to its keys.")
      .def(
          "evict", [](infkv::cpu::h2o_state& st, const infkv::keep_set& keep) { st.evict(keep); }, "keep"_a,
          "Keeps the slots of `keep`, compacted as the cache is.")
      .def_prop_ro(
          "scores",
          [](const infkv::cpu::h2o_state& s) {
            const auto& m = s.scores();
            return to_numpy(m.data, {std::size_t(m.rows), std::size_t(m.cols)});
          },
          nb::rv_policy::move, "The scores [kv_heads, slots] (a copy): a Layer's `accumulated` for policy h2o.");

  m.def(
      "capture_needs_of", [](const any_policy& p) { return spec_of(p).needs(); }, "policy"_a,
      "What an engine must capture, per layer, for `policy` to score.");
  m.def(
      "natural_granularity", [](const any_policy& p) { return spec_of(p).natural; }, "policy"_a,
      "The granularity `policy` decides at by default (select's granularity=None).");
  m.def(
      "protect", [](const any_policy& p, const infkv::budget& b) { return spec_of(p).protect(b); }, "policy"_a,
      "budget"_a, "The budget `policy` keeps given `budget` (its window widens recent, its sinks the first).");
}

}  // namespace infkv_py
