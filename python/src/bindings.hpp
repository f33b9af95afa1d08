// infkv's Python module: what its binding files share: the policies it takes (any_policy), the
// array types, views of tensors without copying, the Tokens and Layer objects, and the plan and
// run helpers. One file per topic binds them: policies.cpp, pipeline.cpp, cache.cpp, archive.cpp, batch.cpp; module.cpp
// makes the module.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <infkv/cpu.hpp>
#include <infkv/version.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace infkv_py {

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

/// Every policy of the library (infkv::policy_variant), and a union chosen at run time.
using any_policy = infkv::policy_variant<py_union>;
/// A [kv_heads, slots] float32 array of accumulated scores (H2O's state).
using scores_array = nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using ro_array = nb::ndarray<nb::ro>;
using rw_array = nb::ndarray<>;
using positions_array = nb::ndarray<nb::ro, std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// Where a 3-D tensor keeps slots and heads: (slots, heads, head_dim) or (heads, slots, head_dim).
enum class layout : std::uint8_t { nhd, hnd };

inline const char* dtype_name(nb::dlpack::dtype t) {
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
  infkv::fail_arg(name + ".dtype", dtype_name(t), "must be float32, float16 or bfloat16");
}

template <class A>
void require_cpu(const A& a, const std::string& name) {
  if (a.device_type() == nb::device::cpu::value) return;
  infkv::fail_arg(name + ".device",
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

inline layout layout_of(const std::string& s) {
  if (s == "nhd") return layout::nhd;
  if (s == "hnd") return layout::hnd;
  infkv::fail_arg("layout", "'" + s + "'", "must be 'nhd' (slots, heads, head_dim) or 'hnd' (heads, slots, head_dim)");
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

inline tokens make_tokens(
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

inline infkv::policy_spec spec_of(const any_policy& p) {
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
inline std::vector<infkv::layer_inputs<>> inputs_of(nb::handle h) {
  if (nb::isinstance<layer>(h)) return {nb::cast<const layer&>(h).inputs()};
  std::vector<infkv::layer_inputs<>> out;
  for (nb::handle x : h) {
    if (!nb::isinstance<layer>(x))
      infkv::fail_arg("layers", nb::str(nb::handle(x.type())).c_str(), "must hold infkv.Layer values");
    out.push_back(nb::cast<const layer&>(x).inputs());
  }
  return out;
}

inline infkv::layer_shape shape_arg(nb::handle h) {
  if (nb::isinstance<infkv::layer_shape>(h)) return nb::cast<infkv::layer_shape>(h);
  if (nb::isinstance<layer>(h)) return infkv::shape_of(nb::cast<const layer&>(h).inputs());
  infkv::fail_arg("shape", nb::str(nb::handle(h.type())).c_str(), "must be an infkv.LayerShape or infkv.Layer");
}

inline infkv::keep_set run(const py_plan& p, nb::handle layers_h) {
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

inline nb::ndarray<nb::numpy, float> run_scores(const py_plan& p, const layer& l) {
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

inline std::string repr_budget(const infkv::budget& b) {
  return infkv::cat("budget(capacity=", b.capacity, ", ratio=", b.ratio, ", sinks=", b.sinks, ", recent=", b.recent,
                    ")");
}

/// Binds the budgets, RoPE, bias, AdaKV, capture needs, every policy, H2O's state, union_of.
void bind_policies(nb::module_& m);
/// Binds Tokens, LayerShape, Layer, plan_options, Plan, make_plan / run / run_scores / select, KeepSet.
void bind_pipeline(nb::module_& m);
/// Binds compact, compact_positions and rerotate.
void bind_cache(nb::module_& m);
/// Binds Archive and Recaller.
void bind_archive(nb::module_& m);
/// Binds PagedCache, BatchLayer, BatchPlan, make_batch_plan / run_batch and compact_paged.
void bind_batch(nb::module_& m);

}  // namespace infkv_py
