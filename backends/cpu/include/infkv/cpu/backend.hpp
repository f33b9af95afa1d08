// infkv CPU backend: the pipeline's primitives on the host (pipeline.hpp runs them): time
// order, the six score sources (recency, key diversity, window attention, last-query
// attention, accumulated attention, expected attention), value norms, pooling, GQA group mean, bias, reduction, AdaKV
// allocation and top-k selection. Everything runs in the caller's workspace; with one thread nothing is allocated.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include <infkv/pipeline.hpp>

#include "attention.hpp"
#include "detail/kernels.hpp"
#include "detail/rows.hpp"
#include "executor.hpp"
#include "expected.hpp"
#include "workspace.hpp"

namespace infkv::cpu {

/// -cos(k_j, anchor) per KV head into `out` [Hkv][n_slots], anchor = mean of the unit-length
/// keys. `scratch` holds workers(ex, n_heads) x keydiff_scratch_bytes(head_dim, n_heads) bytes. Two
/// passes over the keys, each slot by slot (all of a worker's heads of one slot before the
/// next: in an NHD cache that is one contiguous stream; the second pass runs backwards, so it
/// starts on the keys the first pass left in cache); a NaN or Inf key raises naming slot and
/// head. Cost O(Hkv * n * d). Results do not depend on the thread count (parallel over heads,
/// each head summed in slot order).
inline std::size_t keydiff_scratch_bytes(std::int64_t head_dim, std::int64_t n_heads) {
  return infkv::detail::bytes_of(
      [&](infkv::detail::carver& c) { c.take<float>(8 * head_dim), c.take<float>(head_dim * n_heads); });
}
template <row_source R>
void keydiff_into(const R& keys, score_view out, std::byte* scratch, const executor& ex = {}) {
  validate(keys, "keys");
  INFKV_REQUIRE(out.rows == keys.n_heads && out.cols == keys.n_slots, "out.rows", out.rows, "must be ", keys.n_heads,
                " x ", keys.n_slots, "; out.cols = ", out.cols);
  const std::int64_t n = keys.n_slots, d = keys.head_dim, hkv = keys.n_heads;
  const std::int64_t nw = workers(ex, hkv);
  const std::size_t per_worker = keydiff_scratch_bytes(d, hkv);
  const std::int64_t row_bytes = d * std::int64_t(size_of(keys.type)), ahead = 16;  // slots prefetched ahead
  // f32 rows aligned to 4 bytes are read in place; others are converted into the row buffer.
  const auto key_row = [&](std::int64_t j, std::int32_t h, float* buf) -> const float* {
    const void* p = keys.row(j, h);
    if (keys.type == dtype::f32 && reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0)
      return static_cast<const float*>(p);
    to_f32(keys.type, p, buf, d);
    return buf;
  };
  parallel_for_workers(ex, nw, [&](std::int64_t w, std::int64_t) {
    const auto h0 = std::int32_t(hkv * w / nw), h1 = std::int32_t(hkv * (w + 1) / nw);
    infkv::detail::carver mine{scratch + std::size_t(w) * per_worker};
    float* const buf = mine.take<float>(8 * d);
    float* const anchors = mine.take<float>(d * hkv);  // [h1 - h0][d]
    std::fill(anchors, anchors + (h1 - h0) * d, 0.f);
    for (std::int64_t j0 = 0; j0 < n; j0 += 8)  // eight slots at a time: their norms are independent
      for (std::int32_t h = h0; h < h1; ++h) {
        const std::int64_t jn = std::min<std::int64_t>(8, n - j0);
        const float* k[8];
        float norm[8];
        for (std::int64_t b = ahead; b < std::min(n - j0, ahead + 8); ++b)
          detail::prefetch(keys.row(j0 + b, h), row_bytes);
        for (std::int64_t b = 0; b < jn; ++b) {
          k[b] = key_row(j0 + b, h, buf + b * d);
          norm[b] = detail::dot_of(k[b], k[b], d);
        }
        for (std::int64_t b = 0; b < jn; ++b) {
          // a NaN or Inf key makes the norm non-finite (so does a finite key whose square overflows)
          if (!std::isfinite(norm[b]) && !detail::all_finite(k[b], d)) [[unlikely]]
            detail::fail_not_finite(keys, "keys", j0 + b, 1, h);
          const float inv = norm[b] > 0.f ? 1.f / std::sqrt(norm[b]) : 0.f;
          out(h, j0 + b) = inv;  // 1 / |k_j| between the passes
          detail::axpy(inv, k[b], anchors + (h - h0) * d, d);
        }
      }
    float inv_an[64];  // per head of this worker, in blocks of 64 heads
    for (std::int32_t hb = h0; hb < h1; hb += 64) {
      const std::int32_t he = std::min(h1, hb + 64);
      for (std::int32_t h = hb; h < he; ++h) {
        const float* anchor = anchors + (h - h0) * d;
        const float an = detail::dot_of(anchor, anchor, d);
        inv_an[h - hb] = an > 0.f ? 1.f / std::sqrt(an) : 0.f;
      }
      for (std::int64_t j = n - 1; j >= 0; --j)  // keys converted again: memory stays O(d) for any n
        for (std::int32_t h = hb; h < he; ++h) {
          if (j >= ahead) detail::prefetch(keys.row(j - ahead, h), row_bytes);
          const float* k = key_row(j, h, buf);
          out(h, j) = -detail::dot_of(k, anchors + (h - h0) * d, d) * out(h, j) * inv_an[h - hb];
        }
    }
  });
}

namespace detail {

/// Each score source on the CPU: its scratch in bytes (`bytes`, for `workers` threads) beside its
/// step (`score`, writing the source's raw rows to `out`). The backend reaches them through
/// infkv::visit_source.
template <score_source S>
struct source;

template <>
struct source<score_source::recency> {  // rank in time order
  static std::size_t bytes(const score_spec&, const layer_shape&, std::int64_t) { return 0; }
  template <row_source R>
  static void score(const executor&, const score_spec&, const layer_inputs<R>&, const std::int64_t* order,
                    score_view out, std::byte*) {
    for (std::int64_t i = 0; i < out.cols; ++i) out(0, order[i]) = float(i);
  }
};

template <>
struct source<score_source::key_diversity> {
  static std::size_t bytes(const score_spec&, const layer_shape& shape, std::int64_t workers) {
    return std::size_t(workers) * keydiff_scratch_bytes(shape.head_dim, shape.kv_heads);
  }
  template <row_source R>
  static void score(const executor& ex, const score_spec&, const layer_inputs<R>& in, const std::int64_t*,
                    score_view out, std::byte* scratch) {
    keydiff_into(in.keys, out, scratch, ex);
  }
};

template <>
struct source<score_source::window_attention> {
  static std::size_t bytes(const score_spec& spec, const layer_shape& shape, std::int64_t workers) {
    return std::size_t(workers) * window_scratch_bytes(shape.q_heads / shape.kv_heads,
                                                       std::min(spec.queries, shape.n_queries), shape.head_dim,
                                                       shape.n_slots);
  }
  template <row_source R>
  static void score(const executor& ex, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t*,
                    score_view out, std::byte* scratch) {
    const auto window = last_queries(in, spec.queries);
    window_attention_into(window, out, spec.pools_per_query_head(), scratch, ex,
                          in.queries.n_slots - window.queries.n_slots);
  }
};

template <>
struct source<score_source::last_query> {  // every KV head's mass, then the mean over all heads
  static std::size_t bytes(const score_spec& spec, const layer_shape& shape, std::int64_t workers) {
    return infkv::detail::carver::round_up(std::size_t(shape.kv_heads * shape.n_slots) * sizeof(float)) +
           source<score_source::window_attention>::bytes(spec, shape, workers);
  }
  template <row_source R>
  static void score(const executor& ex, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t*,
                    score_view out, std::byte* scratch) {
    const std::int64_t n = out.cols;
    infkv::detail::carver c{scratch};
    const score_view heads{c.take<float>(in.keys.n_heads * n), in.keys.n_heads, n, n};
    const auto last = last_queries(in, spec.queries);
    window_attention_into(last, heads, false, scratch + c.size(), ex, in.queries.n_slots - last.queries.n_slots);
    reduce_into(out, heads, reduction::mean, true);
    finish_reduction(out, reduction::mean, heads.rows);
  }
};

template <>
struct source<score_source::accumulated> {  // the state's scores, kept by the engine (h2o_state)
  static std::size_t bytes(const score_spec&, const layer_shape&, std::int64_t) { return 0; }
  template <row_source R>
  static void score(const executor&, const score_spec&, const layer_inputs<R>& in, const std::int64_t*, score_view out,
                    std::byte*) {
    for (std::int64_t r = 0; r < out.rows; ++r)
      std::copy(in.accumulated.row(r), in.accumulated.row(r) + out.cols, out.row(r));
  }
};

template <>
struct source<score_source::expected_attention> {
  static std::size_t bytes(const score_spec& spec, const layer_shape& shape, std::int64_t workers) {
    const std::int64_t m = std::min(spec.queries, shape.n_queries), n = shape.n_slots;
    return expected_layout{workers,
                           shape.q_heads / shape.kv_heads,
                           m,
                           shape.head_dim,
                           n,
                           spec.expect.covariance,
                           spec.expect.matrix(m, shape.head_dim, n)}
        .bytes();
  }
  template <row_source R>
  static void score(const executor& ex, const score_spec& spec, const layer_inputs<R>& in, const std::int64_t* order,
                    score_view out, std::byte* scratch) {
    const auto window = last_queries(in, spec.queries);
    expected_attention_into(window, spec.expect, order, out, scratch, ex, in.queries.n_slots - window.queries.n_slots);
  }
};

}  // namespace detail

/// The CPU backend of the pipeline: its primitives run on `ex.threads` threads.
struct backend {
  executor ex{};

  /// Scratch of the primitives for one score part over layers of `shape`, in bytes: the largest
  /// of the score source's, pooling's (one row), the bias's, selection's and AdaKV's.
  std::size_t scratch_bytes(const score_spec& spec, const layer_shape& shape, const plan_options& opt = {}) const {
    const std::int64_t workers = cpu::workers(ex, shape.kv_heads), n = shape.n_slots;
    const std::size_t source = visit_source(
        spec.source, [&](auto src) { return detail::source<decltype(src)::value>::bytes(spec, shape, workers); });
    const std::int64_t units = opt.g == granularity::per_head ? shape.kv_heads : 1;
    const std::int64_t words = std::max(n, opt.adakv ? adakv::scratch_size(units, n) : 0);  // int64 / double
    return std::max({source, std::size_t(n) * sizeof(float), std::size_t(words) * sizeof(std::int64_t)});
  }

  void time_order(std::span<const token> tokens, std::int64_t* order, std::span<std::byte> = {}) const {
    validate_tokens(tokens, std::int64_t(tokens.size()));
    time_order_into(tokens, order);
  }

  template <row_source R>
  void score(const score_spec& spec, const layer_inputs<R>& in, const std::int64_t* order, score_view out,
             std::span<std::byte> scratch) const {
    visit_source(spec.source, [&](auto src) {
      detail::source<decltype(src)::value>::score(ex, spec, in, order, out, scratch.data());
    });
  }

  /// Scores times the value norms of their KV head (value_norm_into).
  template <row_source R>
  void value_norm(score_view s, const R& values, std::span<std::byte> = {}) const {
    value_norm_into(s, values);
  }

  void pool(score_view s, const std::int64_t* order, const score_spec& spec, std::span<std::byte> scratch) const {
    auto* tmp = reinterpret_cast<float*>(scratch.data());
    for (std::int64_t r = 0; r < s.rows; ++r)
      detail::pool_row(s.row(r), order, s.cols, spec.kernel, spec.pool, spec.pool_tail, tmp);
  }

  void fill_tail(score_view s, const std::int64_t* order, std::int64_t tail, std::span<std::byte> = {}) const {
    for (std::int64_t r = 0; r < s.rows; ++r) detail::fill_tail(s.row(r), order, s.cols, tail);
  }

  /// out[h] = mean of in's rows [h * G, (h + 1) * G), G = in.rows / out.rows.
  void group_mean(score_view in, score_view out) const {
    const std::int64_t g = in.rows / out.rows;
    for (std::int64_t h = 0; h < out.rows; ++h) {
      reduce(out.rows_from(h, 1), in.rows_from(h * g, g), reduction::sum, true);
      finish_reduction(out.rows_from(h, 1), reduction::mean, g);
    }
  }

  void bias(score_view s, std::span<const token> tokens, const std::int64_t* order, const score_spec& spec,
            std::span<std::byte> scratch) const {
    detail::apply_bias(spec.bias, s, tokens, order, reinterpret_cast<double*>(scratch.data()));
  }

  void reduce(score_view acc, score_view s, reduction r, bool first) const { detail::reduce_into(acc, s, r, first); }
  void finish_reduction(score_view acc, reduction r, std::int64_t rows) const {
    detail::finish_reduction(acc, r, rows);
  }

  void allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b, std::int64_t cap,
                std::int64_t* caps, std::span<std::byte> scratch) const {
    check_scores(s);
    detail::allocate_into(a, s, order, b, cap,
                          {reinterpret_cast<std::int64_t*>(scratch.data()), scratch.size() / sizeof(std::int64_t)},
                          caps);
  }

  /// Per unit u (row u of s), keeps caps[u] slots (or `cap` when caps is null); s.data null
  /// keeps every slot. NaN scores raise.
  void keep_top(score_view s, std::span<const token> tokens, const std::int64_t* order, const std::int64_t* caps,
                std::int64_t cap, const budget& keep, keep_view out, std::span<std::byte> scratch) const {
    auto* cand = reinterpret_cast<std::int64_t*>(scratch.data());
    out.offsets[0] = 0;
    for (std::int64_t u = 0; u < out.n_units; ++u) {
      std::int64_t* dst = out.slots + out.offsets[u];
      std::int64_t m = out.n_slots;
      if (s.data == nullptr) {
        for (std::int64_t i = 0; i < m; ++i) dst[i] = i;
      } else {
        check_scores(s.rows_from(u, 1));
        m = detail::select_row_into(s.row(u), tokens, order, caps ? caps[u] : cap, keep.sinks, keep.recent, cand, dst);
      }
      out.offsets[u + 1] = out.offsets[u] + m;
    }
  }

  /// Row 0 of `s` gets +infinity at the `count` slots of `slots` (a union's first picks).
  void mark(score_view s, const std::int64_t* slots, std::int64_t count) const {
    for (std::int64_t i = 0; i < count; ++i) s(0, slots[i]) = std::numeric_limits<float>::infinity();
  }
};

static_assert(infkv::backend<backend>);

}  // namespace infkv::cpu
