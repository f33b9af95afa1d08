// infkv CUDA backend: every algorithm of the backend as a sequence of data-parallel steps, each
// a `__host__ __device__` body run once per index by a launcher. The CUDA library runs them
// with a kernel per step on a stream (`cuda::backend`, compiled by nvcc); the tests run the very
// same steps with a host launcher (a loop over odd block shapes, under ASan / UBSan) and compare
// with the CPU backend, so indexing, bounds and per-thread logic are tested without a GPU.
//
// Every body writes only its own outputs and sums in a fixed order: results are deterministic
// (no float atomics; integer atomics count). Sorting and scanning are the launcher's other
// primitives (CUB's radix sort and scan on a GPU, a stable sort and std::exclusive_scan on the
// host). Device code never throws: a bad value (a NaN key, a negative position, a NaN score, an
// inconsistent keep set) is recorded in the caller's status word (the smallest code wins), and
// cuda::check raises it by name when the caller asks.
//
// Window attention's logits go through the launcher's third primitive, a strided batched GEMM
// with cuBLAS's arguments and semantics (column-major, f32 accumulation): cuBLAS on a GPU, a
// stand-in on the host that calls a CPU BLAS with the very same arguments, so that the
// arguments themselves (transposes, leading dimensions, strides) are tested without a GPU.
//
// A launcher L provides:
//   l.for_each(n, f)                    f(i) for every i in [0, n)
//   l.temp(std::span<std::byte>)        the sort and the scan, with that scratch as their temp:
//     .sort_pairs(kin, kout, vin, vout, n, bits)
//                                       stable sort of (uint64 key, int64 value) pairs by the
//                                       low `bits` bits of the key
//     .exclusive_scan(in, out, n)       out[i] = in[0] + ... + in[i - 1] (int64; out[0] = 0),
//                                       in and out not overlapping
//   L::temp_bytes(n)                    the temp either needs for n items (the larger)
//   L::prepare_gemm()                   readies the GEMM library (when planning only)
//   L::gemm_scratch_bytes()             scratch one GEMM call needs
//   l.gemm_scratch(std::span<std::byte>)
//                                       an object whose gemm_strided_batched(transa,
//                                       transb, m, n, k, alpha, A, Atype, lda, strideA,
//                                       B, Btype, ldb, strideB, beta, C, Ctype, ldc,
//                                       strideC, batch) is cublasGemmStridedBatchedEx's
//                                       (Ctype f32, f32 compute; strides in elements)
//   l.for_blocks(blocks, threads, shared_bytes, f), L::block_context
//                                       block-level steps (block_steps.hpp): f(ctx) per thread
//                                       of every block, with shared memory and barriers
//
// Per eviction the time order is the one sort; the selection finds each unit's threshold from a
// first-digit histogram built by many blocks, a radix select over the boundary digit's candidates
// in one block per unit, and emits the kept slots from many blocks again (top_split); AdaKV's
// allocation by a radix select over all rows in launches of many blocks.
// This file holds the scoring steps; select_steps.hpp (included at its end) the selection steps.
#pragma once

#include "common.hpp"
#include "source_steps.hpp"

namespace infkv::cuda {

/// The backend's primitives (pipeline.hpp) as steps run by launcher L. A backend itself: the host
/// launcher makes it the executable specification the tests compare with the CPU backend.
template <class L>
struct basic_backend {
  L launch{};
  /// Where the steps record faults (device memory of the caller; see cuda::backend::status).
  status_word* status = nullptr;
  /// Bytes of f32 logits per GEMM tile of the window attention and Expected Attention (smaller in
  /// tests: several tiles).
  std::int64_t window_tile_limit = detail::window_tile_limit;
  /// The selection's blocks: candidate keys held in shared memory (64 KiB), threads (smaller in
  /// tests: every pass through global memory, and faster host emulation).
  std::int64_t select_buffer = 8192;
  int select_threads = 256;
  /// Slots per block of the selection's launches of many blocks (smaller in tests: many parts).
  std::int64_t select_slice = 4096;
  std::int64_t select_parts(std::int64_t n) const {
    INFKV_REQUIRE(select_slice >= 1 && select_slice <= 4096, "backend.select_slice", select_slice,
                  "must be in [1, 4096] (a block of the selection holds a slice's keys in shared memory)");
    return std::max<std::int64_t>((n + select_slice - 1) / select_slice, 1);
  }
  /// Bits of the largest position the caller's tokens hold (a promise: a position at or above
  /// 2^position_bits is recorded as bad_position): the time order sorts that many bits, a radix
  /// pass per 8. 31 (the default) holds any of llama.cpp's 32-bit positions; 63 every position
  /// (max_position).
  int position_bits = 31;

  /// Bytes of the largest scratch of any primitive for layers of `shape`.
  std::size_t scratch_bytes(const score_spec& spec, const layer_shape& shape, const plan_options& opt = {}) const {
    const std::int64_t n = shape.n_slots, hkv = shape.kv_heads, units = opt.g == granularity::per_head ? hkv : 1;
    check_sort_bits(units, n);
    const std::int64_t rows = std::max<std::int64_t>(shape.q_heads, hkv);  // score rows at most
    std::size_t need = 0;
    const auto consider = [&](auto&& carve) {
      detail::carver c{nullptr, 0};
      carve(c);
      need = std::max(need, c.size());
    };
    consider([&](detail::carver& c) {
      visit_source(spec.source,
                   [&](auto src) { detail::source_steps<decltype(src)::value>::carve(*this, c, spec, shape); });
    });
    consider([&](detail::carver& c) { c.take<float>(rows * n); });  // pool
    consider([&](detail::carver& c) { detail::tail_scratch::carve(c, rows, n); });
    consider([&](detail::carver& c) { detail::bias_scratch::carve(c, rows, n); });
    consider([&](detail::carver& c) {
      detail::order_scratch::carve(c, n);
      c.take<std::byte>(std::int64_t(L::temp_bytes(n)));
    });
    consider([&](detail::carver& c) { detail::select_scratch::carve(c, n, units, select_parts(n)); });
    consider([&](detail::carver& c) { detail::allocate_scratch::carve(c, units * n, units); });
    return need;
  }

  /// Units x slots must fit the keys: unit (AdaKV: row) bits + 32 score bits + rank bits <= 64;
  /// and the selection's 32-bit tie ranks keep 2^32 - 1 for protected slots, so n < 2^32.
  static void check_sort_bits(std::int64_t units, std::int64_t n) {
    INFKV_REQUIRE(detail::bits_for(units) + 32 + detail::bits_for(n) <= 64 && n < (std::int64_t(1) << 32),
                  "shape.n_slots", n, "too many slots for one selection on the CUDA backend with ", units,
                  " units (units x slots must fit in 2^32, and slots below 2^32)");
  }

  /// The status word (the caller's, kept across calls until the caller resets it).
  status_word* checked_status() const {
    INFKV_REQUIRE(status != nullptr, "backend.status", "null",
                  "the steps record faults in a device status word of the caller (cuda::backend::status)");
    return status;
  }

  /// Time order (position, then slot): the positions sorted by their low position_bits bits.
  void time_order(std::span<const token> tokens, std::int64_t* order, std::span<std::byte> scratch) const {
    INFKV_REQUIRE(position_bits >= 1 && position_bits <= 63, "backend.position_bits", position_bits,
                  "must be in [1, 63] (63 holds every position up to 2^62)");
    const auto n = std::int64_t(tokens.size());
    status_word* st = checked_status();
    if (n == 0) return;
    detail::carver c{scratch.data(), 0};
    const auto w = detail::order_scratch::carve(c, n);
    const token* t = tokens.data();
    std::uint64_t* keys = w.keys;
    std::int64_t* vals = w.vals;
    const int bits = position_bits;
    const std::int64_t most = bits == 63 ? max_position : (std::int64_t(1) << bits) - 1;
    launch.for_each(n, [=] INFKV_HOST_DEVICE(std::int64_t i) {
      if (t[i].pos < 0 || t[i].pos > max_position)
        detail::record(st, encode(fault::bad_position, 0, 0, i));
      else if (t[i].pos > most)
        detail::record(st, encode(fault::bad_position, 2, bits, i));
      keys[i] = std::uint64_t(t[i].pos), vals[i] = i;
    });
    launch.temp(scratch.subspan(c.size())).sort_pairs(keys, w.kout, vals, order, n, bits);
  }

  template <row_source R>
  void score(const score_spec& spec, const layer_inputs<R>& in, const std::int64_t* order, score_view out,
             std::span<std::byte> scratch) const {
    visit_source(spec.source, [&](auto src) {
      detail::source_steps<decltype(src)::value>::score(*this, spec, in, order, out, scratch);
    });
  }

  /// Scores times the value norms of their KV head: row r belongs to head r / (rows / heads).
  template <row_source R>
  void value_norm(score_view s, const R& values, std::span<std::byte> /*scratch: none needed*/) const {
    validate(values, "values");
    INFKV_REQUIRE(s.cols == values.n_slots && s.rows % values.n_heads == 0, "values.n_slots", values.n_slots,
                  "value norms weight ", s.rows, " score rows of ", s.cols,
                  " slots; values.n_heads = ", values.n_heads);
    const std::int64_t n = s.cols, per = s.rows / values.n_heads, dv = values.head_dim;
    status_word* st = checked_status();
    launch.for_each(values.n_heads * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const auto h = std::int32_t(x / n);
      const std::int64_t j = x % n;
      const auto norm = float(
          sqrt(detail::squared_norm<double>(values.type, values.row(j, h), dv, st, fault::value_not_finite, h, j)));
      for (std::int64_t r = h * per; r < (h + 1) * per; ++r) s(r, j) *= norm;
    });
  }

  /// Pools every row along time order, the last `spec.pool_tail` slots left out (pool_row).
  void pool(score_view s, const std::int64_t* order, const score_spec& spec, std::span<std::byte> scratch) const {
    const std::int64_t n = s.cols, len = n - std::min(spec.pool_tail, n), half = spec.kernel / 2;
    if (spec.pool == pooling::none || spec.kernel == 1 || len == 0) return;
    detail::carver c{scratch.data(), 0};
    float* tmp = c.take<float>(s.rows * len);
    launch.for_each(s.rows * len, [=] INFKV_HOST_DEVICE(std::int64_t x) { tmp[x] = s(x / len, order[x % len]); });
    const pooling kind = spec.pool;
    const std::int32_t kernel = spec.kernel;
    launch.for_each(s.rows * len, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t r = x / len, i = x % len;
      const float* t = tmp + r * len;
      float acc = kind == pooling::max ? -INFINITY : 0.f;
      for (std::int64_t j = i > half ? i - half : 0; j <= (i + half < len - 1 ? i + half : len - 1); ++j)
        acc = kind == pooling::max ? fmaxf(acc, t[j]) : acc + t[j];
      s(r, order[i]) = kind == pooling::avg ? acc / float(kernel) : acc;
    });
  }

  /// out[h] = mean of in's rows [h * G, (h + 1) * G).
  void group_mean(score_view in, score_view out) const {
    const std::int64_t g = in.rows / out.rows, n = out.cols;
    launch.for_each(out.rows * n, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t h = x / n, c = x % n;
      float s = 0.f;
      for (std::int64_t k = 0; k < g; ++k) s += in(h * g + k, c);
      out(h, c) = s / float(g);
    });
  }

  /// The last `tail` slots in time order get their row's mean over the others (fill_tail). Two
  /// launches: a block per (row, piece of tail_piece slots) sums its piece (each thread 16 slots
  /// in order, then a tree over the block in shared memory, f64), then a thread per tail slot adds
  /// its row's pieces in order and writes the mean.
  void fill_tail(score_view s, const std::int64_t* order, std::int64_t tail, std::span<std::byte> scratch) const {
    constexpr int threads = detail::tail_piece / 16;
    const std::int64_t n = s.cols, len = n - std::min(tail, n), pieces = detail::tail_pieces(len);
    if (len == 0 || len == n) return;
    detail::carver c{scratch.data(), 0};
    const auto w = detail::tail_scratch::carve(c, s.rows, len);
    double* part = w.part;
    launch.for_blocks(s.rows * pieces, threads, threads * sizeof(double),
                      [=] INFKV_HOST_DEVICE(const typename L::block_context& ctx) {
                        const std::int64_t r = ctx.block / pieces, p = ctx.block % pieces;
                        const std::int64_t lo = p * detail::tail_piece + ctx.thread * 16;
                        double sum = 0;
                        for (std::int64_t i = lo; i < std::min(len, lo + 16); ++i) sum += s(r, order[i]);
                        auto* sh = reinterpret_cast<double*>(ctx.shared);
                        sh[ctx.thread] = sum;
                        ctx.sync();
                        for (int stride = threads / 2; stride > 0; stride /= 2) {
                          if (ctx.thread < stride) sh[ctx.thread] += sh[ctx.thread + stride];
                          ctx.sync();
                        }
                        if (ctx.thread == 0) part[ctx.block] = sh[0];
                      });
    launch.for_each(s.rows * (n - len), [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t r = x / (n - len);
      double sum = 0;
      for (std::int64_t p = 0; p < pieces; ++p) sum += part[r * pieces + p];
      s(r, order[len + x % (n - len)]) = float(sum / double(len));
    });
  }

  /// The attention bias (attention_bias::apply): each row divided by its mean, plus beta f(age).
  void bias(score_view s, std::span<const token> tokens, const std::int64_t* order, const score_spec& spec,
            std::span<std::byte> scratch) const {
    const attention_bias b = spec.bias;
    const std::int64_t n = std::int64_t(tokens.size()), nc = detail::chunks(n);
    if (b.beta == 0.0 || s.cols == 0) return;
    const token* t = tokens.data();
    detail::carver c{scratch.data(), 0};
    const auto w = detail::bias_scratch::carve(c, s.rows, n);
    double *when = w.when, *lo = w.lo, *hi = w.hi, *range = w.range, *row_part = w.row_part, *row_inv = w.row_inv;
    std::int64_t* counts = w.counts;  // new positions per chunk, then the ranks before it
    const auto value = [=] INFKV_HOST_DEVICE(std::int64_t i, std::int64_t rank) {
      return b.unit == age_unit::ranks       ? double(rank)
             : b.unit == age_unit::positions ? double(t[order[i]].pos)
                                             : double(t[order[i]].segment);
    };
    const auto is_new = [=] INFKV_HOST_DEVICE(std::int64_t i) {
      return i == 0 || t[order[i]].pos != t[order[i - 1]].pos;
    };
    launch.for_each(nc, [=] INFKV_HOST_DEVICE(std::int64_t cc) {
      std::int64_t k = 0;
      for (std::int64_t i = cc * detail::chunk; i < std::min(n, (cc + 1) * detail::chunk); ++i) k += is_new(i) ? 1 : 0;
      counts[cc] = k;
    });
    launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) {
      std::int64_t before = 0;
      for (std::int64_t cc = 0; cc < nc; ++cc) {
        const std::int64_t k = counts[cc];
        counts[cc] = before, before += k;
      }
    });
    launch.for_each(nc, [=] INFKV_HOST_DEVICE(std::int64_t cc) {
      std::int64_t rank = counts[cc] - 1;
      double mn = INFINITY, mx = -INFINITY;
      for (std::int64_t i = cc * detail::chunk; i < std::min(n, (cc + 1) * detail::chunk); ++i) {
        rank += is_new(i) ? 1 : 0;
        const double v = when[order[i]] = value(i, rank);
        mn = fmin(mn, v), mx = fmax(mx, v);
      }
      lo[cc] = mn, hi[cc] = mx;
    });
    launch.for_each(1, [=] INFKV_HOST_DEVICE(std::int64_t) {
      double mn = INFINITY, mx = -INFINITY;
      for (std::int64_t cc = 0; cc < nc; ++cc) mn = fmin(mn, lo[cc]), mx = fmax(mx, hi[cc]);
      range[0] = mx, range[1] = mx - mn;
    });
    const std::int64_t cols = s.cols, rc = detail::chunks(cols);
    launch.for_each(s.rows * rc, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t r = x / rc, cc = x % rc;
      double sum = 0;
      for (std::int64_t j = cc * detail::chunk; j < std::min(cols, (cc + 1) * detail::chunk); ++j) sum += s(r, j);
      row_part[x] = sum;
    });
    launch.for_each(s.rows, [=] INFKV_HOST_DEVICE(std::int64_t r) {
      double sum = 0;
      for (std::int64_t cc = 0; cc < rc; ++cc) sum += row_part[r * rc + cc];
      const double mean = sum / double(cols);
      row_inv[r] = mean > 0 ? 1.0 / mean : 1.0;
    });
    launch.for_each(s.rows * cols, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t r = x / cols, j = x % cols;
      const double a = range[1] > 0 ? (range[0] - when[j]) / range[1] : 0.0;
      s(r, j) = float(s(r, j) * row_inv[r] + b.beta * b.recency(a));
    });
  }

  void reduce(score_view acc, score_view s, reduction r, bool first) const {
    launch.for_each(s.cols, [=] INFKV_HOST_DEVICE(std::int64_t c) {
      float a = first ? (r == reduction::max ? -INFINITY : 0.f) : acc(0, c);
      for (std::int64_t row = 0; row < s.rows; ++row) a = r == reduction::max ? fmaxf(a, s(row, c)) : a + s(row, c);
      acc(0, c) = a;
    });
  }

  void finish_reduction(score_view acc, reduction r, std::int64_t rows) const {
    if (r != reduction::mean || rows == 0) return;
    launch.for_each(acc.cols, [=] INFKV_HOST_DEVICE(std::int64_t c) { acc(0, c) /= float(rows); });
  }

  /// Radix select: per segment g of `len` keys (keys[g * len, (g + 1) * len)), those other than
  /// detail::no_key being its candidates (unique within the segment, `bits` low bits used), and
  /// w.need[g] set beforehand to the count wanted: w.bound[g] becomes the exclusive bound below
  /// which exactly that many candidates lie, the wanted-th smallest key + 1; 0 when none is wanted,
  /// detail::no_key when more than all are. MSB-first digits of 8 bits: per pass the candidates that
  /// share the digits found so far are counted by digit (a thread per tile of keys adds runs of
  /// equal digits with integer atomics), then a thread per segment finds the digit that holds the
  /// wanted rank and clears the histogram for the next pass.
  void radix_select(const std::uint64_t* keys, std::int64_t segments, std::int64_t len, int bits,
                    const detail::radix_scratch& w) const;

  /// AdaKV (as the CPU backend's allocate_into): the layer's top rows x (cap - protected) unprotected scores by
  /// (score, lower row, newer slot), found by one radix select over rows x slots, counted per row
  /// (a thread per tile), blended with an equal share and rounded by largest remainder, a thread
  /// per row ranking its remainder among the rows' (larger first, ties to the lower row).
  void allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b, std::int64_t cap,
                std::int64_t* caps, std::span<std::byte> scratch) const;

  /// Per unit u keeps caps[u] slots (or `cap`): the protected sinks and recent slots, then the
  /// best by `keep_before`, by (descending score bits, tie rank) keys; the tie rank comes from the
  /// time order (binary searches, no sort). Five launches (detail::top_split): the ranks, a
  /// first-digit histogram and a gather of the boundary digit's candidates by blocks of
  /// select_slice slots, a block per unit that finds its threshold among those candidates, and
  /// blocks of select_slice slots writing the kept slots, increasing, at their unit's offset in
  /// out.slots. s.data null keeps every slot.
  void keep_top(score_view s, std::span<const token> tokens, const std::int64_t* order, const std::int64_t* caps,
                std::int64_t cap, const budget& keep, keep_view out, std::span<std::byte> scratch) const;

  /// Row 0 of `s` gets +infinity at the `count` slots of `slots` (a union's first picks).
  void mark(score_view s, const std::int64_t* slots, std::int64_t count) const;
};

}  // namespace infkv::cuda

#include "select_steps.hpp"  // the selection steps: radix_select, allocate, keep_top, mark
