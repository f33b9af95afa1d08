// infkv CUDA backend: the archive's steps (the format is the core's, infkv/archive.hpp; the host
// steps are cpu/archive.hpp): quantizing one page's rows into the archive's page layout,
// dequantizing a page's rows, and bounding pages' logits for a set of queries. Run by a
// launcher, as the other steps are: every thread writes only its own outputs (a code byte is
// assembled by one thread from all the codes it packs), so the bytes equal the CPU's exactly.
#pragma once

#include <infkv/archive.hpp>

#include "../archive.hpp"
#include "common.hpp"

namespace infkv::cuda {

namespace detail {
/// Row r's element c of token t of a page's keys (`values`: values), as f32.
INFKV_HOST_DEVICE inline float page_elem(const page_rows& x, bool values, std::int32_t r, std::int32_t t,
                                         std::int32_t c) {
  return load(x.type, values ? x.values[r] : x.keys[r], std::int64_t(t) * x.row_stride + c);
}
/// Records not_archivable unless v is finite with |v| <= 65504 (its group's f16 parameters hold it).
INFKV_HOST_DEVICE inline void check_archivable(status_word* st, float v, std::int32_t r, std::int32_t c,
                                               std::int32_t t) {
  if (!(finite(v) && v <= archive_max_abs && v >= -archive_max_abs)) record(st, encode(fault::not_archivable, r, c, t));
}
}  // namespace detail

/// Quantizes `in` into `page` (layout.bytes bytes, the archive's page layout: cpu::archive_evicted
/// writes the same bytes). An element that is not finite or beyond f16's range records
/// fault::not_archivable (a = row, e = channel, b = token); the page is then unspecified.
template <class L>
void quantize_page_steps(const L& launch, status_word* status, const page_layout& layout, const page_rows& in,
                         std::uint8_t* page) {
  INFKV_REQUIRE(in.n_tokens >= 1 && in.n_tokens <= layout.tokens, "page_rows.n_tokens", in.n_tokens,
                "must be in [1, page_tokens = ", layout.tokens, "]");
  const page_layout Lo = layout;
  const page_rows x = in;
  const std::int32_t d = Lo.head_dim, n = x.n_tokens;
  // 1. key parameters per (row, channel), value parameters per (row, token, group)
  launch.for_each(std::int64_t(Lo.rows) * d, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto r = std::int32_t(i / d), c = std::int32_t(i % d);
    float lo = detail::page_elem(x, false, r, 0, c), hi = lo;
    for (std::int32_t t = 0; t < n; ++t) {
      const float v = detail::page_elem(x, false, r, t, c);
      detail::check_archivable(status, v, r, c, t);
      lo = v < lo ? v : lo, hi = v > hi ? v : hi;
    }
    quant_params q;
    if (!infkv::detail::quant_params_of(lo, hi, Lo.k_bits, q)) return;  // recorded above
    std::memcpy(page + std::size_t(r) * Lo.row_bytes + Lo.k_params + std::size_t(c) * sizeof q, &q, sizeof q);
  });
  const std::int32_t g = Lo.v_group, groups = Lo.groups();
  launch.for_each(std::int64_t(Lo.rows) * n * groups, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto r = std::int32_t(i / (std::int64_t(n) * groups)), t = std::int32_t(i / groups % n),
               gi = std::int32_t(i % groups);
    float lo = detail::page_elem(x, true, r, t, gi * g), hi = lo;
    for (std::int32_t c = gi * g; c < (gi + 1) * g; ++c) {
      const float v = detail::page_elem(x, true, r, t, c);
      detail::check_archivable(status, v, r, c, t);
      lo = v < lo ? v : lo, hi = v > hi ? v : hi;
    }
    quant_params q;
    if (!infkv::detail::quant_params_of(lo, hi, Lo.v_bits, q)) return;
    std::memcpy(page + std::size_t(r) * Lo.row_bytes + Lo.v_params + (std::size_t(t) * groups + gi) * sizeof q, &q,
                sizeof q);
  });
  // 2. the codes, one thread per code byte (its codes from the parameters step 1 wrote)
  for (const bool values : {false, true}) {
    const std::int32_t bits = values ? Lo.v_bits : Lo.k_bits, per = 8 / bits;
    const std::int64_t used = (std::int64_t(n) * d * bits + 7) / 8;  // bytes holding this page's codes
    launch.for_each(std::int64_t(Lo.rows) * used, [=] INFKV_HOST_DEVICE(std::int64_t i) {
      if (*status != status_ok) return;
      const auto r = std::int32_t(i / used);
      const std::int64_t byte = i % used;
      std::uint8_t* row = page + std::size_t(r) * Lo.row_bytes;
      const std::uint8_t* params = row + (values ? Lo.v_params : Lo.k_params);
      std::uint32_t out = 0;
      for (std::int32_t j = 0; j < per; ++j) {
        const std::int64_t code = byte * per + j;
        if (code >= std::int64_t(n) * d) break;
        const auto t = std::int32_t(code / d), c = std::int32_t(code % d);
        const quant_params q =
            params_at(params, values ? std::size_t(t) * groups + std::size_t(c / g) : std::size_t(c));
        out |= quant_code(detail::page_elem(x, values, r, t, c), f16_to_f32(q.lo), f16_to_f32(q.step), bits)
               << (j * bits);
      }
      row[(values ? Lo.v_codes : Lo.k_codes) + std::size_t(byte)] = std::uint8_t(out);
    });
  }
}

/// Dequantizes every row of `page` (n_tokens tokens): keys[(r * n_tokens + t) * head_dim + c]
/// and the values alike, f32, exactly as cpu::dequantize.
template <class L>
void dequantize_page_steps(const L& launch, const page_layout& layout, const std::uint8_t* page, std::int32_t n_tokens,
                           float* keys, float* values) {
  INFKV_REQUIRE(n_tokens >= 1 && n_tokens <= layout.tokens, "n_tokens", n_tokens,
                "must be in [1, page_tokens = ", layout.tokens, "]");
  const page_layout Lo = layout;
  const std::int32_t d = Lo.head_dim, n = n_tokens, groups = Lo.groups();
  launch.for_each(std::int64_t(Lo.rows) * n * d, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const auto r = std::int32_t(i / (std::int64_t(n) * d)), t = std::int32_t(i / d % n), c = std::int32_t(i % d);
    const std::uint8_t* row = page + std::size_t(r) * Lo.row_bytes;
    const std::int64_t code = std::int64_t(t) * d + c;
    keys[i] = dequantized(params_at(row + Lo.k_params, std::size_t(c)), code_at(row + Lo.k_codes, code, Lo.k_bits));
    values[i] = dequantized(params_at(row + Lo.v_params, std::size_t(t) * groups + std::size_t(c / Lo.v_group)),
                            code_at(row + Lo.v_codes, code, Lo.v_bits));
  });
}

/// Per page p of `n_pages` (pages[p]: its bytes; first_layer[p]: its first layer; head[p]: the
/// KV head of a per_head page, ignored otherwise), the upper bound on its logits for `queries`
/// (one view per archive layer; query heads a multiple of the KV heads), as cpu::page_bounds: per
/// layer of the page the largest over its heads, their query heads and the queries of scale *
/// sum_d max(q_d lo_d, q_d hi_d) (f32, in channel order), summed over the page's layers in
/// double. `scratch`: n_pages * layers_per_page floats.
template <class L>
void page_bounds_steps(const L& launch, const archive_shape& shape, const page_layout& layout,
                       const std::uint8_t* const* pages, const std::int32_t* first_layer, const std::int32_t* head,
                       std::int64_t n_pages, const const_tensor_view* queries, float scale, float* scratch,
                       float* out) {
  const page_layout Lo = layout;
  const archive_shape s = shape;
  const std::int32_t lp = s.layers_per_page(), hp = s.heads_per_page(), d = s.head_dim, rmax = (1 << Lo.k_bits) - 1;
  launch.for_each(n_pages * lp, [=] INFKV_HOST_DEVICE(std::int64_t i) {
    const std::int64_t p = i / lp;
    const auto l = std::int32_t(i % lp);
    const const_tensor_view Q = queries[first_layer[p] + l];
    const std::int32_t group = Q.n_heads / s.kv_heads;
    float best = -INFINITY;
    for (std::int32_t h0 = 0; h0 < hp; ++h0) {
      const std::int32_t h = s.g == granularity::per_head ? head[p] : h0;
      const std::uint8_t* kp = pages[p] + std::size_t(l * hp + h0) * Lo.row_bytes + Lo.k_params;
      for (std::int64_t q = 0; q < Q.n_slots; ++q)
        for (std::int32_t gi = 0; gi < group; ++gi) {
          const void* qrow = Q.row(q, h * group + gi);
          float sum = 0.f;
          for (std::int32_t c = 0; c < d; ++c) {
            const quant_params k = params_at(kp, std::size_t(c));
            const float lo = f16_to_f32(k.lo), hi = dequantized(k, std::uint32_t(rmax));
            const float x = detail::load(Q.type, qrow, c);
            sum += fmaxf(x * lo, x * hi);
          }
          best = fmaxf(best, scale * sum);
        }
    }
    scratch[i] = best;
  });
  launch.for_each(n_pages, [=] INFKV_HOST_DEVICE(std::int64_t p) {
    double total = 0.0;
    for (std::int32_t l = 0; l < lp; ++l) total += double(scratch[p * lp + l]);
    out[p] = float(total);
  });
}

}  // namespace infkv::cuda
