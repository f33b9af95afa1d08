// infkv CUDA backend: each score source as steps (basic_backend::score and scratch_bytes reach
// them through infkv::visit_source): its scratch on the plan's carver beside the steps that write
// its raw rows. The multi-step sources' own algorithms are in score_steps.hpp and window_steps.hpp.
#pragma once

#include "common.hpp"
#include "window_steps.hpp"

namespace infkv::cuda {

namespace detail {

/// Each score source as steps: its scratch (`carve`, on the carver the plan sizes) beside its
/// steps (`score`, writing the source's raw rows to `out`), for a basic_backend `be`. The backend
/// reaches them through infkv::visit_source.
template <score_source S>
struct source_steps;

template <>
struct source_steps<score_source::recency> {  // rank in time order
  template <class B>
  static void carve(const B&, carver&, const score_spec&, const layer_shape&) {}
  template <class B, row_source R>
  static void score(const B& be, const score_spec&, const layer_inputs<R>&, const std::int64_t* order, score_view out,
                    std::span<std::byte>) {
    be.launch.for_each(out.cols, [=] INFKV_HOST_DEVICE(std::int64_t i) { out(0, order[i]) = float(i); });
  }
};

template <>
struct source_steps<score_source::key_diversity> {
  template <class B>
  static void carve(const B&, carver& c, const score_spec&, const layer_shape& shape) {
    check_keydiff_shape(shape.head_dim);  // when planning: a run never meets a shape it cannot take
    keydiff_scratch::carve(c, shape.kv_heads, shape.n_slots, shape.head_dim);
  }
  template <class B, row_source R>
  static void score(const B& be, const score_spec&, const layer_inputs<R>& in, const std::int64_t*, score_view out,
                    std::span<std::byte> scratch) {
    keydiff_steps(be.launch, be.checked_status(), in.keys, out, scratch);
  }
};

template <>
struct source_steps<score_source::window_attention> {
  template <class B>
  static void carve(const B& be, carver& c, const score_spec& spec, const layer_shape& shape) {
    using L = decltype(be.launch);
    L::prepare_gemm();  // when planning: never inside a run, which may be captured into a graph
    window_scratch::carve(c, std::int64_t(shape.q_heads) * std::min(spec.queries, shape.n_queries), shape.n_slots,
                          shape.head_dim, 4, L::gemm_scratch_bytes(), be.window_tile_limit);
  }
  template <class B, row_source R>
  static void score(const B& be, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t*, score_view out,
                    std::span<std::byte> scratch) {
    window_attention_steps(be.launch, be.checked_status(), in, spec.queries, spec.pools_per_query_head(), out, scratch,
                           0, be.window_tile_limit);
  }
};

template <>
struct source_steps<score_source::last_query> {  // every KV head's mass, then the mean over the heads
  template <class B>
  static void carve(const B& be, carver& c, const score_spec& spec, const layer_shape& shape) {
    c.take<float>(shape.kv_heads * shape.n_slots);
    source_steps<score_source::window_attention>::carve(be, c, spec, shape);
  }
  template <class B, row_source R>
  static void score(const B& be, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t*, score_view out,
                    std::span<std::byte> scratch) {
    const std::int64_t hkv = in.keys.n_heads, n = out.cols;
    carver c{scratch.data(), 0};  // window_attention's scratch follows
    const score_view heads{c.take<float>(hkv * n), hkv, n, n};
    window_attention_steps(be.launch, be.checked_status(), in, spec.queries, false, heads, scratch, c.size(),
                           be.window_tile_limit);
    be.launch.for_each(n, [=] INFKV_HOST_DEVICE(std::int64_t j) {
      float s = 0.f;
      for (std::int64_t h = 0; h < hkv; ++h) s += heads(h, j);
      out(0, j) = s / float(hkv);
    });
  }
};

template <>
struct source_steps<score_source::accumulated> {  // the state's scores, kept by the engine
  template <class B>
  static void carve(const B&, carver&, const score_spec&, const layer_shape&) {}
  template <class B, row_source R>
  static void score(const B& be, const score_spec&, const layer_inputs<R>& in, const std::int64_t*, score_view out,
                    std::span<std::byte>) {
    const const_score_view acc = in.accumulated;
    const std::int64_t n = out.cols;
    be.launch.for_each(out.rows * n, [=] INFKV_HOST_DEVICE(std::int64_t i) { out(i / n, i % n) = acc(i / n, i % n); });
  }
};

template <>
struct source_steps<score_source::expected_attention> {
  template <class B>
  static void carve(const B& be, carver& c, const score_spec& spec, const layer_shape& shape) {
    using L = decltype(be.launch);
    L::prepare_gemm();
    const std::int64_t m = std::min(spec.queries, shape.n_queries), n = shape.n_slots;
    expected_scratch::carve(c, shape.q_heads, shape.kv_heads, m, shape.head_dim, n, spec.expect.covariance,
                            spec.expect.matrix(m, shape.head_dim, n), L::gemm_scratch_bytes(), be.window_tile_limit);
  }
  template <class B, row_source R>
  static void score(const B& be, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t* order,
                    score_view out, std::span<std::byte> scratch) {
    expected_attention_steps(be.launch, be.checked_status(), last_queries(in, spec.queries), spec.expect, order, out,
                             scratch, 0, be.window_tile_limit);
  }
};

}  // namespace detail

}  // namespace infkv::cuda
