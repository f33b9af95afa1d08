// infkv CUDA backend: what every step shares: recording faults in the status word (status.hpp),
// element loads and stores of f32 / f16 / bf16 rows, order-preserving score bits, and the scratch
// layouts, one function each, used by the steps and by the sizing alike. See steps.hpp for the
// launcher model.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

#include <infkv/detail/carver.hpp>
#include <infkv/error.hpp>
#include <infkv/keep_set.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/pipeline.hpp>
#include <infkv/policies/h2o.hpp>
#include <infkv/rope.hpp>
#include <infkv/select.hpp>

#include "../status.hpp"

namespace infkv::cuda {

/// Whether a GEMM operand is used as stored or transposed (BLAS's column-major convention).
enum class blas_op : std::uint8_t { n, t };

namespace detail {

/// Records `code` in the status word (the smallest code wins).
INFKV_HOST_DEVICE inline void record(status_word* st, status_word code) {
#if defined(__CUDA_ARCH__)
  atomicMin(st, code);
#else
  if (code < *st) *st = code;
#endif
}

/// A count that steps add to concurrently: integer atomics, so the sum is the same in any order.
using counter = unsigned long long;

/// Adds `v` to `*c` (atomicAdd on a device; the host launcher runs one body at a time).
INFKV_HOST_DEVICE inline void add_count(counter* c, counter v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(c, v);
#else
  *c += v;
#endif
}

INFKV_HOST_DEVICE inline bool finite(float x) { return x - x == 0.f; }

/// Element e of a row of type t, as f32 (f16 by the GPU's conversion instruction on a device:
/// exact either way).
INFKV_HOST_DEVICE inline float load(dtype t, const void* row, std::int64_t e) {
  if (t == dtype::f32) return static_cast<const float*>(row)[e];
  const std::uint16_t h = static_cast<const std::uint16_t*>(row)[e];
#if defined(__CUDA_ARCH__)
  return t == dtype::f16 ? __half2float(__ushort_as_half(h)) : bf16_to_f32(h);
#else
  return t == dtype::f16 ? f16_to_f32(h) : bf16_to_f32(h);
#endif
}
INFKV_HOST_DEVICE inline void store(dtype t, void* row, std::int64_t e, float x) {
  if (t == dtype::f32)
    static_cast<float*>(row)[e] = x;
  else
    static_cast<std::uint16_t*>(row)[e] = t == dtype::f16 ? f32_to_f16(x) : f32_to_bf16(x);
}

/// Dot product of two rows of d elements (f32 accumulation, in element order).
INFKV_HOST_DEVICE inline float dot(dtype ta, const void* a, dtype tb, const void* b, std::int64_t d) {
  float s = 0.f;
  for (std::int64_t e = 0; e < d; ++e) s += load(ta, a, e) * load(tb, b, e);
  return s;
}

/// Copies 16 bytes between 16-byte aligned addresses (one vector load and store on a GPU).
INFKV_HOST_DEVICE inline void copy16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__)
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#else
  std::memcpy(dst, src, 16);
#endif
}

/// Elements [e0, e0 + count) of a row of type T as f32, count = min(per16, d - e0) where per16
/// elements fill 16 bytes: one 16-byte load when the address is aligned and the chunk whole,
/// element loads otherwise. Returns count.
template <dtype T>
INFKV_HOST_DEVICE int load_chunk(const void* row, std::int64_t e0, std::int64_t d, float* x) {
  constexpr int per16 = T == dtype::f32 ? 4 : 8;
  const int count = d - e0 < per16 ? int(d - e0) : per16;
  const auto* p = static_cast<const std::byte*>(row) + e0 * std::int64_t(size_of(T));
  if (count == per16 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
    alignas(16) std::byte raw[16];
    copy16(raw, p);
    for (int i = 0; i < per16; ++i) x[i] = load(T, raw, i);
  } else {
    for (int i = 0; i < count; ++i) x[i] = load(T, p, i);
  }
  return count;
}

/// Sum of the squares of a row's d elements, accumulated in Acc in element order (16-byte loads:
/// load_chunk); a non-finite element records `kind` (a = head, e = element, b = slot).
template <dtype T, class Acc>
INFKV_HOST_DEVICE Acc squared_norm_of(const void* row, std::int64_t d, status_word* st, fault kind, std::int64_t head,
                                      std::int64_t slot) {
  Acc s = 0;
  float x[8];
  for (std::int64_t e0 = 0; e0 < d;) {
    const int count = load_chunk<T>(row, e0, d, x);
    for (int i = 0; i < count; ++i) {
      if (!finite(x[i])) record(st, encode(kind, head, e0 + i, slot));
      s += Acc(x[i]) * Acc(x[i]);
    }
    e0 += count;
  }
  return s;
}
template <class Acc>
INFKV_HOST_DEVICE Acc squared_norm(dtype t, const void* row, std::int64_t d, status_word* st, fault kind,
                                   std::int64_t head, std::int64_t slot) {
  if (t == dtype::f32) return squared_norm_of<dtype::f32, Acc>(row, d, st, kind, head, slot);
  if (t == dtype::f16) return squared_norm_of<dtype::f16, Acc>(row, d, st, kind, head, slot);
  return squared_norm_of<dtype::bf16, Acc>(row, d, st, kind, head, slot);
}

/// Unsigned bits in the order of the float's value (-0 and +0 equal; NaN excluded by the caller),
/// inverted so that ascending bits are descending scores.
INFKV_HOST_DEVICE inline std::uint32_t descending_bits(float x) {
  if (x == 0.f) x = 0.f;
  std::uint32_t u;
  memcpy(&u, &x, 4);
  const std::uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ordered;
}

/// Bits needed to number `count` things (0 for one).
inline int bits_for(std::int64_t count) { return count <= 1 ? 0 : int(std::bit_width(std::uint64_t(count - 1))); }

/// Scratch layouts are carved with the core's one carver (64-byte pieces; null base: sizing).
using infkv::detail::carver;

/// Keys per chunk of the chunked reductions (a thread sums one chunk, another the chunks).
inline constexpr std::int64_t chunk = 256;
inline std::int64_t chunks(std::int64_t n) { return (n + chunk - 1) / chunk; }
/// Slots per block of fill_tail's sums (256 threads of 16).
inline constexpr std::int64_t tail_piece = 4096;
inline std::int64_t tail_pieces(std::int64_t n) { return (n + tail_piece - 1) / tail_piece; }
/// Keys per tile of the window softmax statistics.
inline constexpr std::int64_t key_tile = 256;
inline std::int64_t tiles(std::int64_t n) { return (n + key_tile - 1) / key_tile; }

// Scratch layouts, one function each, used by the steps and by scratch_bytes alike.

/// Window softmax statistics: per (query row, key tile) max and normaliser, per row the max and
/// the normaliser's inverse.
struct softmax_scratch {
  float *tmax, *tsum, *rmax, *rcoef;
  static softmax_scratch carve(carver& c, std::int64_t rows, std::int64_t n) {
    return {c.take<float>(rows * tiles(n)), c.take<float>(rows * tiles(n)), c.take<float>(rows), c.take<float>(rows)};
  }
};
/// Bytes of f32 logits (Expected Attention: and f32 keys) one GEMM tile of the window attention
/// or Expected Attention may hold (all KV heads together).
inline constexpr std::int64_t window_tile_limit = std::int64_t(8) << 20;
/// Keys per GEMM tile of the window attention: a multiple of key_tile (each statistics tile lies
/// in one GEMM tile), as many as `limit` bytes of logits allow for `rows` query rows (all heads),
/// at least key_tile, at most the keys rounded up to key_tile.
inline std::int64_t window_tile_keys(std::int64_t rows, std::int64_t n, std::int64_t limit) {
  const std::int64_t per_key = 4 * std::max<std::int64_t>(rows, 1);
  const std::int64_t fit = std::max<std::int64_t>(limit / per_key / key_tile, 1) * key_tile;
  return std::max<std::int64_t>(std::min(fit, tiles(n) * key_tile), key_tile);
}
/// The window attention: its softmax statistics, then (GEMM path) the window queries packed per
/// KV head ([heads][rows / heads][d] of `elem` bytes each), one tile of logits ([heads][rows /
/// heads][keys of the tile], f32) and the GEMM's own scratch (`gemm_bytes`, the launcher's).
/// Sizing passes elem = 4 (the keys' type is not known when planning): the steps' layout for
/// 2-byte elements is then smaller, never larger.
struct window_scratch {
  softmax_scratch stats;
  std::byte* queries;
  float* logits;
  std::span<std::byte> gemm;
  std::int64_t tile;  ///< keys per GEMM tile
  static window_scratch carve(carver& c, std::int64_t rows, std::int64_t n, std::int64_t d, std::int64_t elem,
                              std::size_t gemm_bytes, std::int64_t limit) {
    const softmax_scratch stats = softmax_scratch::carve(c, rows, n);
    const std::int64_t tile = window_tile_keys(rows, n, limit);
    std::byte* queries = c.take<std::byte>(rows * d * elem);
    float* logits = c.take<float>(rows * std::min(tile, n));
    std::byte* gemm = c.take<std::byte>(std::int64_t(gemm_bytes));
    return {stats, queries, logits, {gemm, gemm ? gemm_bytes : 0}, tile};
  }
};
/// KeyDiff: per (head, chunk) sums of unit keys, the anchors.
struct keydiff_scratch {
  float *part, *anchor;
  static keydiff_scratch carve(carver& c, std::int64_t heads, std::int64_t n, std::int64_t d) {
    return {c.take<float>(heads * chunks(n) * d), c.take<float>(heads * d)};
  }
};
/// fill_tail: per (row, piece of tail_piece slots) sums.
struct tail_scratch {
  double* part;
  static tail_scratch carve(carver& c, std::int64_t rows, std::int64_t n) {
    return {c.take<double>(rows * tail_pieces(n))};
  }
};
/// The attention bias: each slot's age value, per chunk the new positions (then the ranks
/// before it) and the value range, the newest value and span, per (row, chunk) sums, row factors.
struct bias_scratch {
  double* when;
  std::int64_t* counts;
  double *lo, *hi, *range, *row_part, *row_inv;
  static bias_scratch carve(carver& c, std::int64_t rows, std::int64_t n) {
    return {c.take<double>(n), c.take<std::int64_t>(chunks(n)),  c.take<double>(chunks(n)), c.take<double>(chunks(n)),
            c.take<double>(2), c.take<double>(rows * chunks(n)), c.take<double>(rows)};
  }
};
/// Expected Attention: rotation tables (each window query's, then the mean one), each query
/// head's mean before the mean rotation (double), mu' and the centred queries, the covariance
/// matrices when the matrix form is used (double, d x d per query head), the logits (double), per
/// (query head, chunk) maxima and sums, per query head the maximum and the normaliser's inverse.
struct expected_scratch {
  float* table;
  double* mu;
  float* stats;  ///< per query head mu' and (covariance) the centred queries c'_i, d floats each
  float* ops;    ///< matrix form: per query head mu' and the d rows of Sigma' (else the stats are the operand)
  double *z, *pmax, *psum, *rmax, *rinv;
  float *keys, *logits;  ///< one tile: its keys in f32 ([KV head][key][element]), the GEMM's result
  std::span<std::byte> gemm;
  std::int64_t tile;  ///< keys per GEMM tile
  /// Rows of the statistics and of the GEMM operand per query head.
  static std::int64_t stat_rows(std::int64_t m, bool cov) { return cov ? m + 1 : 1; }
  static std::int64_t op_rows(std::int64_t m, std::int64_t d, bool cov, bool matrix) {
    return matrix ? d + 1 : stat_rows(m, cov);
  }
  static expected_scratch carve(carver& c, std::int64_t hq, std::int64_t hkv, std::int64_t m, std::int64_t d,
                                std::int64_t n, bool cov, bool matrix, std::size_t gemm_bytes, std::int64_t limit) {
    const std::int64_t rq = op_rows(m, d, cov, matrix), cols = (hq / std::max<std::int64_t>(hkv, 1)) * rq;
    expected_scratch s{};
    s.table = c.take<float>((m + 1) * d);
    s.mu = c.take<double>(hq * d);
    s.stats = c.take<float>(hq * stat_rows(m, cov) * d);
    s.ops = c.take<float>(matrix ? hq * rq * d : 0);
    s.z = c.take<double>(hq * n);
    s.pmax = c.take<double>(hq * chunks(n));
    s.psum = c.take<double>(hq * chunks(n));
    s.rmax = c.take<double>(hq);
    s.rinv = c.take<double>(hq);
    s.tile = window_tile_keys(hkv * (cols + d), n, limit);
    s.keys = c.take<float>(hkv * std::min(s.tile, n) * d);
    s.logits = c.take<float>(hkv * std::min(s.tile, n) * cols);
    std::byte* gemm = c.take<std::byte>(std::int64_t(gemm_bytes));
    s.gemm = {gemm, gemm ? gemm_bytes : 0};
    return s;
  }
};
/// The time order: positions as keys, slots as values, the sorted keys; the launcher's temp follows.
struct order_scratch {
  std::uint64_t *keys, *kout;
  std::int64_t* vals;
  static order_scratch carve(carver& c, std::int64_t n) {
    return {c.take<std::uint64_t>(n), c.take<std::uint64_t>(n), c.take<std::int64_t>(n)};
  }
};
/// Digits per pass of the radix select (a 256-bin histogram per segment and pass) and keys per
/// thread of its histograms and counts.
inline constexpr int select_digit = 8;
inline constexpr std::int64_t select_bins = std::int64_t(1) << select_digit, select_tile = 32;
inline std::int64_t select_tiles(std::int64_t n) { return (n + select_tile - 1) / select_tile; }
/// Keys that are no candidate of a radix select (never a real key: real keys' top 32 bits are a
/// non-NaN score's descending bits, at most 0xff800000, or they use fewer than 64 bits).
inline constexpr std::uint64_t no_key = ~std::uint64_t{0};
/// The radix select, per segment: the rank still sought among the candidates that share the
/// digits found so far (0: done), those digits, the exclusive bound found, a histogram.
struct radix_scratch {
  std::int64_t* need;
  std::uint64_t *prefix, *bound;
  counter* hist;
  static radix_scratch carve(carver& c, std::int64_t segments) {
    return {c.take<std::int64_t>(segments), c.take<std::uint64_t>(segments), c.take<std::uint64_t>(segments),
            c.take<counter>(segments * select_bins)};
  }
};
/// Bits of the selection's first digit (top_split): a histogram of 4,096 bins per unit; its
/// second digit has 8 bits.
inline constexpr int top_digit = 12;
inline constexpr std::int64_t top_bins = std::int64_t(1) << top_digit, top_bins2 = 256;
/// The selection (top_split): per slot its tie rank (protected slots marked); per unit the first
/// digit's histogram and the second digit's, the candidate keys that
/// share the boundary digit (a region of `slice` per part of `slice` slots, grouped by their
/// second digit), the first digit, how many of its keys are kept, the bound; per (unit, part) the
/// slots it keeps for sure, where each second digit's group starts in its region (257 entries,
/// the last its candidates), and its offset in the output.
struct select_scratch {
  std::uint32_t* rank;
  counter *hist, *hist2;
  std::uint64_t* cand;
  std::int64_t *digit, *need;
  std::uint64_t* bound;
  std::int64_t *sure, *groups, *offset;
  static select_scratch carve(carver& c, std::int64_t n, std::int64_t units, std::int64_t parts) {
    select_scratch w{};
    w.rank = c.take<std::uint32_t>(n), w.hist = c.take<counter>(units * top_bins);
    w.hist2 = c.take<counter>(units * top_bins2);
    w.cand = c.take<std::uint64_t>(units * n);
    w.digit = c.take<std::int64_t>(units), w.need = c.take<std::int64_t>(units), w.bound = c.take<std::uint64_t>(units);
    w.sure = c.take<std::int64_t>(units * parts), w.groups = c.take<std::int64_t>(units * parts * (top_bins2 + 1));
    w.offset = c.take<std::int64_t>(units * parts);
    return w;
  }
};
/// AdaKV: per (row, time index) the keys, the radix select's state (one segment), per row the
/// wins, the blended share and its floor.
struct allocate_scratch {
  std::uint64_t* keys;
  radix_scratch radix;
  counter* wins;
  double* share;
  std::int64_t* floor;
  static allocate_scratch carve(carver& c, std::int64_t items, std::int64_t rows) {
    return {c.take<std::uint64_t>(items), radix_scratch::carve(c, 1), c.take<counter>(rows), c.take<double>(rows),
            c.take<std::int64_t>(rows)};
  }
};

}  // namespace detail

}  // namespace infkv::cuda
