// infkv CUDA backend: what steps that cooperate within a block share. A launcher L runs such a
// step with
//   l.for_blocks(blocks, threads, shared_bytes, f)
// which calls f(ctx) once per thread of every block, ctx an `L::block_context` with
//   ctx.block, ctx.thread, ctx.threads   the block's index, the thread's, the block's size
//   ctx.shared                           shared_bytes of the block's shared memory (128-byte
//                                        aligned, uninitialised: the host emulation fills it with
//                                        0xff bytes, NaN as floats)
//   ctx.sync()                           a barrier of the block (__syncthreads)
//   ctx.warp_sync()                      a barrier of the thread's warp (__syncwarp)
// On a GPU one kernel (device_launcher, src/launcher.cuh); in the tests a host emulation runs
// every thread of a block as a thread of its own, with real barriers and the block's shared
// memory in one buffer (tests/cuda/host_launcher.hpp), so the bodies and their barriers are run,
// under ASan / UBSan, as written. Warp-level matrix products go through warp_tile_product:
// tensor cores (WMMA) on a GPU, the same product in f32 on the host. A host context may count
// the products and the exponentials (block_expf) a step does: bench/kernel_cost.cpp's cost model.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#endif

#include "common.hpp"

namespace infkv::cuda::detail {

/// Shared memory one block may use on every GPU the library is built for (compute capability 8.6
/// and 8.9 allow 99 KiB per block with the opt-in, 8.0 163 KiB, 9.0 227 KiB).
inline constexpr std::size_t block_shared_limit = 99 * 1024;

/// Whether 2-byte element bits are finite (f16: exponent not all ones; bf16 likewise).
template <dtype T>
INFKV_HOST_DEVICE inline bool finite_bits(std::uint16_t b) {
  static_assert(T == dtype::f16 || T == dtype::bf16);
  return T == dtype::f16 ? (b & 0x7c00u) != 0x7c00u : (b & 0x7f80u) != 0x7f80u;
}

/// C = A B^T for one 16 x 16 tile, A 16 x k and B 16 x k (both row-major, element type T = f16 or
/// bf16 as bits, lda / ldb elements apart), C f32 row-major (ldc floats apart); k a multiple of
/// 16 up to 256. A warp-collective: all 32 lanes of a warp call it with the same arguments. Pointers to
/// shared memory, 32-byte aligned; lda and ldb multiples of 8, ldc of 4 (WMMA's rules). On a GPU
/// WMMA's 16 x 16 x 16 tiles (f32 accumulation on tensor cores); on the host lane 0 computes the
/// tile in f32 (products exact, sums in element order) and the warp waits for it.
template <dtype T, class Ctx>
INFKV_HOST_DEVICE void warp_tile_product(const Ctx& ctx, const std::uint16_t* a, int lda, const std::uint16_t* b,
                                         int ldb, int k, float* c, int ldc) {
  static_assert(T == dtype::f16 || T == dtype::bf16);
#if defined(__CUDA_ARCH__)
  (void)ctx;
  namespace wmma = nvcuda::wmma;
  using E = std::conditional_t<T == dtype::f16, __half, __nv_bfloat16>;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> fb;  // B^T: column j is B's row j
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
  wmma::fill_fragment(fc, 0.f);
  for (int kk = 0; kk < k; kk += 16) {
    wmma::load_matrix_sync(fa, reinterpret_cast<const E*>(a + kk), unsigned(lda));
    wmma::load_matrix_sync(fb, reinterpret_cast<const E*>(b + kk), unsigned(ldb));
    wmma::mma_sync(fc, fa, fb, fc);
  }
  wmma::store_matrix_sync(c, fc, unsigned(ldc), wmma::mem_row_major);
#else
  if constexpr (requires { ctx.count_product(k); })  // a host context that counts (the cost model)
    if (ctx.thread % 32 == 0) ctx.count_product(k);
  if (ctx.thread % 32 == 0) {
    float af[16][256], bf[16][256];  // k <= 256 (the callers' head_dim)
    for (int i = 0; i < 16; ++i)
      for (int e = 0; e < k; ++e) af[i][e] = load(T, a + i * lda, e), bf[i][e] = load(T, b + i * ldb, e);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        float s = 0.f;
        for (int e = 0; e < k; ++e) s += af[i][e] * bf[j][e];
        c[i * ldc + j] = s;
      }
  }
  ctx.warp_sync();
#endif
}

/// expf(x), counted by a host context that counts (the cost model's count of exponentials).
template <class Ctx>
INFKV_HOST_DEVICE inline float block_expf(const Ctx& ctx, float x) {
#if !defined(__CUDA_ARCH__)
  if constexpr (requires { ctx.count_exp(); }) ctx.count_exp();
#else
  (void)ctx;
#endif
  return expf(x);
}

/// Adds v to a counter in the block's shared memory (atomicAdd on a GPU; on the host the block's
/// threads run one at a time between barriers).
INFKV_HOST_DEVICE inline void shared_add(std::uint32_t* c, std::uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(c, v);
#else
  *c += v;
#endif
}

/// A value per thread scanned across the block: what the threads before it hold, and everyone's
/// sum (every thread gets both). `part` is shared memory of c.threads entries; Hillis-Steele steps,
/// two barriers each (log2 threads of them), and a barrier before it returns, after which `part`
/// may be written again.
template <class T>
struct block_scanned {
  T before, total;
};
template <class T, class Ctx>
INFKV_HOST_DEVICE block_scanned<T> block_scan(const Ctx& c, T mine, T* part) {
  part[c.thread] = mine;
  c.sync();
  for (int off = 1; off < c.threads; off *= 2) {
    const T v = c.thread >= off ? part[c.thread - off] : T(0);
    c.sync();
    part[c.thread] += v;
    c.sync();
  }
  const block_scanned<T> r{T(part[c.thread] - mine), part[c.threads - 1]};
  c.sync();
  return r;
}

/// Exclusive prefix sums of a[0, count) in shared memory, in place: each thread a run of
/// ceil(count / threads) entries, the runs' sums by block_scan. Returns the sum of all (every
/// thread); a barrier after the writes.
template <class T, class Ctx>
INFKV_HOST_DEVICE T block_exclusive_scan(const Ctx& c, T* a, std::int64_t count, T* part) {
  const std::int64_t per = (count + c.threads - 1) / c.threads, lo0 = std::int64_t(c.thread) * per;
  const std::int64_t lo = lo0 < count ? lo0 : count, hi = lo + per < count ? lo + per : count;
  T mine = 0;
  for (std::int64_t j = lo; j < hi; ++j) mine += a[j];
  const block_scanned<T> r = block_scan(c, mine, part);
  T run = r.before;
  for (std::int64_t j = lo; j < hi; ++j) {
    const T x = a[j];
    a[j] = run, run += x;
  }
  c.sync();
  return r.total;
}

/// After block_exclusive_scan over h[0, count) (`total` their sum), calls f(b, before, next) for
/// the one bin b whose keys hold rank `want` (1-based): h[b] < want <= h[b + 1] (total past the
/// last); for none when want <= 0 or want > total. Each thread tries its bins.
template <class Ctx, class F>
INFKV_HOST_DEVICE void at_wanted_bin(const Ctx& c, const std::uint32_t* h, std::int64_t count, std::int64_t total,
                                     std::int64_t want, F f) {
  for (std::int64_t b = c.thread; b < count; b += c.threads) {
    const std::int64_t before = h[b], next = b + 1 < count ? std::int64_t(h[b + 1]) : total;
    if (want > 0 && before < want && want <= next) f(b, before, next);
  }
}

/// `bytes` rounded up to a multiple of 128 (each piece of a block's shared memory starts there).
INFKV_HOST_DEVICE constexpr std::size_t shared_round(std::size_t bytes) { return (bytes + 127) / 128 * 128; }

}  // namespace infkv::cuda::detail
