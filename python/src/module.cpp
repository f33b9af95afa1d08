// infkv's Python module (nanobind): the C++ API's policies, budgets, plans and CPU kernels over
// tensors taken without copying (DLPack: NumPy arrays, torch tensors). infkv::invalid_argument
// arrives as ValueError, infkv::engine_error as infkv.EngineError (a RuntimeError), with the
// same messages.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <infkv/cpu.hpp>
#include <infkv/policies/expected_attention.hpp>
#include <infkv/policies/inf_mllm.hpp>
#include <infkv/policies/keydiff.hpp>
#include <infkv/policies/snapkv.hpp>
#include <infkv/policies/streaming_llm.hpp>
#include <infkv/policies/tova.hpp>
#include <infkv/version.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

/// The union of two policies chosen at run time: their specs, united by infkv::unite (union_of's).
struct py_union {
  infkv::policy_spec first, second;
  double share = 0.5;
  std::string text;  // the repr

  void validate() const { (void)spec(); }
  infkv::policy_spec spec() const {
    INFKV_REQUIRE(std::isfinite(share) && share >= 0.0 && share <= 1.0, "union_of.share", share, "must be in [0, 1]");
    return infkv::unite(first, second, share);
  }
};

using any_policy = std::variant<infkv::streaming_llm, infkv::snapkv, infkv::tova, infkv::keydiff, infkv::inf_mllm,
                                infkv::expected_attention, infkv::h2o, py_union>;
/// A [kv_heads, slots] float32 array of accumulated scores (H2O's state).
using scores_array = nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ro_array = nb::ndarray<nb::ro>;
using rw_array = nb::ndarray<>;
using positions_array = nb::ndarray<nb::ro, std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// Where a 3-D tensor keeps slots and heads: (slots, heads, head_dim) or (heads, slots, head_dim).
enum class layout : std::uint8_t { nhd, hnd };

const char* dtype_name(nb::dlpack::dtype t) {
  using c = nb::dlpack::dtype_code;
  if (t.lanes != 1) return "a vector type";
  if (t.code == std::uint8_t(c::Float)) return t.bits == 64 ? "float64" : t.bits == 32 ? "float32" : "float16";
  if (t.code == std::uint8_t(c::Bfloat)) return "bfloat16";
  if (t.code == std::uint8_t(c::Int)) return t.bits == 64 ? "int64" : t.bits == 32 ? "int32" : "an integer type";
  if (t.code == std::uint8_t(c::UInt)) return "an unsigned type";
  if (t.code == std::uint8_t(c::Bool)) return "bool";
  return "a complex type";
}

template <class A>
infkv::dtype element_type(const A& a, const std::string& name) {
  using c = nb::dlpack::dtype_code;
  const auto t = a.dtype();
  if (t.lanes == 1 && t.code == std::uint8_t(c::Float) && t.bits == 32) return infkv::dtype::f32;
  if (t.lanes == 1 && t.code == std::uint8_t(c::Float) && t.bits == 16) return infkv::dtype::f16;
  if (t.lanes == 1 && t.code == std::uint8_t(c::Bfloat) && t.bits == 16) return infkv::dtype::bf16;
  infkv::detail::fail_arg(name + ".dtype", dtype_name(t), "must be float32, float16 or bfloat16");
}

template <class A>
void require_cpu(const A& a, const std::string& name) {
  if (a.device_type() == nb::device::cpu::value) return;
  infkv::detail::fail_arg(name + ".device",
                          a.device_type() == nb::device::cuda::value ? "cuda" : std::to_string(a.device_type()),
                          "this module runs the CPU backend: move the tensor to the CPU (.cpu())");
}

/// A strided view of a 3-D tensor: any slot and head strides, head_dim contiguous.
template <class View, class A>
View view_of(const A& a, const std::string& name, layout l) {
  INFKV_REQUIRE(a.ndim() == 3, name + ".ndim", a.ndim(), "must be 3 (",
                l == layout::nhd ? "slots, heads, head_dim" : "heads, slots, head_dim",
                "; layout = ", l == layout::nhd ? "nhd" : "hnd", ")");
  require_cpu(a, name);
  const infkv::dtype t = element_type(a, name);
  INFKV_REQUIRE(a.stride(2) == 1 || a.shape(2) <= 1, name + ".stride(2)", a.stride(2),
                "head_dim must be contiguous (stride 1); call .contiguous() first");
  const std::size_t ns = l == layout::nhd ? 0 : 1, nh = 1 - ns;
  INFKV_REQUIRE(a.shape(nh) <= std::size_t(INT32_MAX) && a.shape(2) <= std::size_t(INT32_MAX), name + ".shape",
                a.shape(nh), "heads and head_dim must fit in int32");
  View v;
  v.data = a.data();  // a read-only array gives only a read-only view (const_tensor_view)
  v.type = t;
  v.n_slots = std::int64_t(a.shape(ns));
  v.n_heads = std::int32_t(a.shape(nh));
  v.head_dim = std::int32_t(a.shape(2));
  v.slot_stride = a.stride(ns);
  v.head_stride = a.stride(nh);
  return v;
}

layout layout_of(const std::string& s) {
  if (s == "nhd") return layout::nhd;
  if (s == "hnd") return layout::hnd;
  infkv::detail::fail_arg("layout", "'" + s + "'",
                          "must be 'nhd' (slots, heads, head_dim) or 'hnd' (heads, slots, head_dim)");
}

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v, std::vector<std::size_t> shape = {}) {
  if (shape.empty()) shape = {v.size()};
  auto* owner = new std::vector<T>(std::move(v));
  nb::capsule del(owner, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owner->data(), shape.size(), shape.data(), del);
}

/// Cached tokens' metadata (position, segment, modality), one entry per slot.
struct tokens {
  std::vector<infkv::token> t;
};

/// One field of every token, as a NumPy array.
template <class T, class F>
nb::ndarray<nb::numpy, T> column(const tokens& t, F field) {
  std::vector<T> v(t.t.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = T(field(t.t[i]));
  return to_numpy(std::move(v));
}

tokens make_tokens(
    positions_array pos,
    std::optional<nb::ndarray<nb::ro, std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> segments,
    std::optional<nb::ndarray<nb::ro, std::uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> kinds) {
  const std::size_t n = pos.shape(0);
  if (segments)
    INFKV_REQUIRE(segments->shape(0) == n, "segments.shape[0]", segments->shape(0), "must equal positions.shape[0] (",
                  n, ")");
  if (kinds)
    INFKV_REQUIRE(kinds->shape(0) == n, "kinds.shape[0]", kinds->shape(0), "must equal positions.shape[0] (", n, ")");
  tokens out;
  out.t.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    auto& t = out.t[i];
    t.pos = pos(i);
    if (segments) t.segment = (*segments)(i);
    if (kinds) {
      INFKV_REQUIRE((*kinds)(i) <= std::uint8_t(infkv::modality::audio), "kinds[" + std::to_string(i) + "]",
                    int((*kinds)(i)), "must be a modality (0 text, 1 image, 2 video, 3 audio)");
      t.kind = infkv::modality((*kinds)(i));
    }
  }
  infkv::validate_tokens(out.t, std::int64_t(n), "positions");
  return out;
}

/// One layer's inputs, holding the arrays it views.
struct layer {
  nb::object tokens_obj;  // a `tokens`
  std::optional<ro_array> keys, values, queries;
  std::optional<positions_array> query_pos;
  std::optional<scores_array> accumulated;
  float scale = 0.f;
  std::optional<infkv::rope> rotary;
  layout lay = layout::nhd;

  const tokens& toks() const { return nb::cast<const tokens&>(tokens_obj); }

  infkv::layer_inputs<> inputs() const {
    infkv::layer_inputs<> in;
    in.tokens = toks().t;
    if (keys) in.keys = view_of<infkv::const_tensor_view>(*keys, "keys", lay);
    if (values) in.values = view_of<infkv::const_tensor_view>(*values, "values", lay);
    if (queries) {
      in.queries = view_of<infkv::const_tensor_view>(*queries, "queries", lay);
      INFKV_REQUIRE(query_pos.has_value(), "query_pos", "None", "queries need their positions");
      INFKV_REQUIRE(std::int64_t(query_pos->shape(0)) == in.queries.n_slots, "query_pos.shape[0]", query_pos->shape(0),
                    "must equal the number of queries (", in.queries.n_slots, ")");
      in.query_pos = {query_pos->data(), query_pos->shape(0)};
    }
    if (keys) infkv::validate(in.keys, "keys");
    if (values) infkv::validate(in.values, "values");
    if (queries) infkv::validate(in.queries, "queries");
    INFKV_REQUIRE(!keys || in.keys.n_slots == std::int64_t(in.tokens.size()), "tokens", in.tokens.size(),
                  "the layer has ", in.keys.n_slots, " keys: one token per cached slot");
    if (accumulated) {
      in.accumulated = {accumulated->data(), std::int64_t(accumulated->shape(0)), std::int64_t(accumulated->shape(1)),
                        std::int64_t(accumulated->shape(1))};
      INFKV_REQUIRE(in.accumulated.cols == std::int64_t(in.tokens.size()), "accumulated.shape[1]", in.accumulated.cols,
                    "must equal the number of tokens (", in.tokens.size(), ")");
      INFKV_REQUIRE(!keys || in.accumulated.rows == in.keys.n_heads, "accumulated.shape[0]", in.accumulated.rows,
                    "must equal the keys' KV heads (", in.keys.n_heads, ")");
    }
    in.scale = scale;
    in.rotary = rotary;
    return in;
  }
};

infkv::policy_spec spec_of(const any_policy& p) {
  return std::visit(
      [](const auto& q) {
        q.validate();
        return q.spec();
      },
      p);
}

/// A plan for the CPU backend and the thread count it was sized for (run uses the same).
struct py_plan {
  infkv::plan p;
  int threads = 1;
  infkv::cpu::backend backend() const { return {{.threads = threads}}; }
};

/// The inputs of one Layer or of a sequence of them (the Layers stay alive in the caller's objects).
std::vector<infkv::layer_inputs<>> inputs_of(nb::handle h) {
  if (nb::isinstance<layer>(h)) return {nb::cast<const layer&>(h).inputs()};
  std::vector<infkv::layer_inputs<>> out;
  for (nb::handle x : h) {
    if (!nb::isinstance<layer>(x))
      infkv::detail::fail_arg("layers", nb::str(nb::handle(x.type())).c_str(), "must hold infkv.Layer values");
    out.push_back(nb::cast<const layer&>(x).inputs());
  }
  return out;
}

infkv::layer_shape shape_arg(nb::handle h) {
  if (nb::isinstance<infkv::layer_shape>(h)) return nb::cast<infkv::layer_shape>(h);
  if (nb::isinstance<layer>(h)) return infkv::shape_of(nb::cast<const layer&>(h).inputs());
  infkv::detail::fail_arg("shape", nb::str(nb::handle(h.type())).c_str(), "must be an infkv.LayerShape or infkv.Layer");
}

infkv::keep_set run(const py_plan& p, nb::handle layers_h) {
  const auto in = inputs_of(layers_h);
  const infkv::cpu::backend be = p.backend();
  infkv::cpu::workspace ws(p.p.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(p.p.offsets_size())), slots(std::size_t(p.p.kept_total));
  const infkv::keep_view out{slots.data(), offsets.data(), p.p.units, p.p.shape.n_slots};
  {
    nb::gil_scoped_release unlocked;
    infkv::run(p.p, be, std::span<const infkv::layer_inputs<>>(in), ws.span(), out);
  }
  return infkv::keep_set::from_view(out);
}

nb::ndarray<nb::numpy, float> run_scores(const py_plan& p, const layer& l) {
  const auto in = l.inputs();
  const infkv::cpu::backend be = p.backend();
  infkv::cpu::workspace ws(p.p.workspace_bytes);
  std::vector<float> out;
  std::int64_t rows = 0, cols = 0;
  {
    nb::gil_scoped_release unlocked;
    const infkv::score_view s = infkv::run_scores(p.p, be, in, ws.span());
    rows = s.rows, cols = s.cols;
    out.resize(std::size_t(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) std::memcpy(out.data() + r * cols, s.row(r), std::size_t(cols) * 4);
  }
  return to_numpy(std::move(out), {std::size_t(rows), std::size_t(cols)});
}

std::string repr_budget(const infkv::budget& b) {
  return infkv::detail::cat("budget(capacity=", b.capacity, ", ratio=", b.ratio, ", sinks=", b.sinks,
                            ", recent=", b.recent, ")");
}

}  // namespace

NB_MODULE(_infkv, m) {
  m.doc() = "infkv: KV-cache policies under a fixed memory budget (CPU backend)";
  m.attr("__version__") = infkv::detail::cat(INFKV_VERSION_MAJOR, ".", INFKV_VERSION_MINOR, ".", INFKV_VERSION_PATCH);

  static nb::exception<infkv::engine_error> engine_exc(m, "EngineError", PyExc_RuntimeError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const infkv::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const infkv::engine_error& e) {
      PyErr_SetString(engine_exc.ptr(), e.what());
    } catch (const infkv::error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  nb::enum_<infkv::granularity>(m, "granularity", "What one keep decision covers.")
      .value("per_head", infkv::granularity::per_head)
      .value("per_layer", infkv::granularity::per_layer)
      .value("per_token", infkv::granularity::per_token);
  nb::enum_<infkv::reduction>(m, "reduction", "How rows combine below per_head.")
      .value("sum", infkv::reduction::sum)
      .value("mean", infkv::reduction::mean)
      .value("max", infkv::reduction::max);
  nb::enum_<infkv::pooling>(m, "pooling", "Pooling along time.")
      .value("none", infkv::pooling::none)
      .value("avg", infkv::pooling::avg)
      .value("max", infkv::pooling::max)
      .value("sum", infkv::pooling::sum);
  nb::enum_<infkv::modality>(m, "modality")
      .value("text", infkv::modality::text)
      .value("image", infkv::modality::image)
      .value("video", infkv::modality::video)
      .value("audio", infkv::modality::audio);
  nb::enum_<infkv::decay>(m, "decay")
      .value("linear", infkv::decay::linear)
      .value("exponential", infkv::decay::exponential);
  nb::enum_<infkv::age_unit>(m, "age_unit")
      .value("positions", infkv::age_unit::positions)
      .value("segments", infkv::age_unit::segments)
      .value("ranks", infkv::age_unit::ranks);
  nb::enum_<infkv::rope_style>(m, "rope_style")
      .value("normal", infkv::rope_style::normal)
      .value("neox", infkv::rope_style::neox);

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
             return infkv::detail::cat("snapkv(window=", p.window, ", kernel=", p.kernel, ", pool=", to_string(p.pool),
                                       ")");
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
             return infkv::detail::cat("keydiff(pool=", to_string(p.pool), ", kernel=", p.kernel, ")");
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
             return infkv::detail::cat("inf_mllm(window=", p.window, ", kernel=", p.kernel,
                                       ", pool=", to_string(p.pool), ", bias.beta=", p.bias.beta,
                                       ", value_norm=", p.value_norm ? "True" : "False", ")");
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
             return infkv::detail::cat(
                 "expected_attention(window=", p.window,
                 ", rotary.theta=", p.rotary ? std::to_string(p.rotary->theta) : std::string("None"),
                 ", future=", p.future, ", sinks=", p.sinks, ", covariance=", p.covariance ? "True" : "False",
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
             return infkv::detail::cat("h2o(normalize_lifetime=", p.normalize_lifetime ? "True" : "False",
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
            made.text = infkv::detail::cat("union_of(", text(first), ", ", text(second), ", share=", share, ")");
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
      .def("evict", &infkv::cpu::h2o_state::evict, "keep"_a, "Keeps the slots of `keep`, compacted as the cache is.")
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
              infkv::detail::fail_arg("tokens", nb::str(nb::handle(toks.type())).c_str(), "must be infkv.Tokens");
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
      .def_prop_ro("budget", [](const py_plan& p) { return p.p.keep; })
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

  m.def(
      "compact",
      [](rw_array keys, std::optional<rw_array> values, tokens& t, const infkv::keep_set& keep,
         const std::string& lay) {
        const layout l = layout_of(lay);
        infkv::kv_view kv;
        kv.k = view_of<infkv::tensor_view>(keys, "keys", l);
        if (values) kv.v = view_of<infkv::tensor_view>(*values, "values", l);
        const std::int64_t n = kv.k.n_slots;
        INFKV_REQUIRE(std::int64_t(t.t.size()) == n, "tokens", t.t.size(), "must hold one token per slot (", n, ")");
        std::int64_t m;
        {
          nb::gil_scoped_release unlocked;
          m = infkv::cpu::compact(kv, t.t, keep);
        }
        t.t.resize(std::size_t(m));
        return m;
      },
      "keys"_a, "values"_a.none(), "tokens"_a, "keep"_a, nb::kw_only(), "layout"_a = "nhd",
      "Moves the kept slots of every head to slots [0, kept) in place (tokens alike, truncated); returns kept. "
      "Every unit must keep the same count (one unit, or one per KV head).");
  m.def(
      "compact_positions", [](tokens& t, std::int64_t first) { return to_numpy(infkv::compact_positions(t.t, first)); },
      "tokens"_a, "first"_a = 0,
      "Gives the slots positions first, first + 1, ... in time order; returns each slot's delta for rerotate.");
  m.def(
      "rerotate",
      [](rw_array keys, positions_array delta, const infkv::rope& r, const std::string& lay, int threads) {
        const auto k = view_of<infkv::tensor_view>(keys, "keys", layout_of(lay));
        nb::gil_scoped_release unlocked;
        infkv::cpu::rerotate(k, std::span<const std::int64_t>(delta.data(), delta.shape(0)), r, {.threads = threads});
      },
      "keys"_a, "delta"_a, "rope"_a, nb::kw_only(), "layout"_a = "nhd", "threads"_a = 1,
      "Turns every head of slot j by delta[j] positions, in place (keys after compaction in compact mode).");
}
