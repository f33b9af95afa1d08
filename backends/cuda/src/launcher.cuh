// infkv CUDA backend: the device launcher that runs the steps of cuda/steps.hpp, one kernel per
// step, its sort and scan (CUB's radix sort and exclusive sum, compiled in sort.cu only) and its
// GEMM (cuBLAS's strided batched GEMM, called in blas.cu only).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include <infkv/cuda/detail/common.hpp>
#include <infkv/error.hpp>

namespace infkv::cuda::detail {

/// Raises engine_error naming the call when a CUDA status is not success.
inline void check_cuda(cudaError_t e, const char* call) {
  if (e != cudaSuccess) [[unlikely]]
    infkv::raise<engine_error>("infkv: ", call, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

/// CUB's DeviceRadixSort::SortPairs on (uint64 key, int64 value) pairs, low `bits` bits of the
/// key; `temp` null: sets `bytes` to the scratch needed.
cudaError_t radix_sort_pairs(void* temp, std::size_t& bytes, const std::uint64_t* kin, std::uint64_t* kout,
                             const std::int64_t* vin, std::int64_t* vout, std::int64_t n, int bits,
                             cudaStream_t stream);

/// CUB's DeviceScan::ExclusiveSum of n int64; `temp` null: sets `bytes` to the scratch needed.
cudaError_t exclusive_sum(void* temp, std::size_t& bytes, const std::int64_t* in, std::int64_t* out, std::int64_t n,
                          cudaStream_t stream);

/// Creates the cuBLAS handle of the current device unless it exists (once per device, kept for
/// the process's life). Called when planning: never inside a run that may be captured.
void blas_prepare();
/// cuBLAS workspace bytes for the current device (32 MiB on compute capability 9 and later, else
/// 4 MiB: cuBLAS's recommendation); nothing is created.
std::size_t blas_workspace_bytes();
/// cublasGemmStridedBatchedEx (CUBLAS_COMPUTE_32F) on `stream` with `workspace` (256-byte
/// aligned) as cuBLAS's workspace, through the current device's handle (blas_prepare first:
/// raises invalid_argument otherwise).
void gemm_strided_batched(cudaStream_t stream, std::span<std::byte> workspace, blas_op transa, blas_op transb,
                          std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const void* a, dtype atype,
                          std::int64_t lda, std::int64_t stride_a, const void* b, dtype btype, std::int64_t ldb,
                          std::int64_t stride_b, float beta, void* c, dtype ctype, std::int64_t ldc,
                          std::int64_t stride_c, std::int64_t batch);

template <class F>
__global__ void __launch_bounds__(256) for_each_kernel(std::int64_t n, F f) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) f(i);
}

/// What a block-level body sees on a GPU (cuda/detail/block_steps.hpp).
struct device_block {
  std::int64_t block;
  int thread, threads;
  std::byte* shared;
  INFKV_HOST_DEVICE void sync() const {
#if defined(__CUDA_ARCH__)
    __syncthreads();
#endif
  }
  INFKV_HOST_DEVICE void warp_sync() const {
#if defined(__CUDA_ARCH__)
    __syncwarp();
#endif
  }
};

template <class F>
__global__ void __launch_bounds__(256) block_kernel(F f) {
  extern __shared__ __align__(128) std::byte block_shared[];
  f(device_block{std::int64_t(blockIdx.x), int(threadIdx.x), int(blockDim.x), block_shared});
}

struct device_launcher {
  cudaStream_t stream = nullptr;
  using block_context = device_block;

  /// One kernel of `blocks` blocks of `threads` (at most 256) threads with `shared` bytes of
  /// dynamic shared memory each (the kernel's limit raised to it above the default 48 KiB).
  template <class F>
  void for_blocks(std::int64_t blocks, int threads, std::size_t shared, F f) const {
    if (blocks <= 0) return;
    INFKV_REQUIRE(blocks < (std::int64_t(1) << 31), "blocks", blocks, "exceed one launch's grid");
    INFKV_REQUIRE(threads >= 1 && threads <= 256, "threads", threads, "must be in [1, 256] (the kernel's bounds)");
    if (shared > 48 * 1024)
      check_cuda(cudaFuncSetAttribute(block_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
                 "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    block_kernel<<<unsigned(blocks), unsigned(threads), shared, stream>>>(f);
    check_cuda(cudaGetLastError(), "kernel launch");
  }

  template <class F>
  void for_each(std::int64_t n, F f) const {
    if (n <= 0) return;
    const std::int64_t blocks = (n + 255) / 256;
    INFKV_REQUIRE(blocks < (std::int64_t(1) << 31), "threads", n, "exceed one launch's grid");
    for_each_kernel<<<unsigned(blocks), 256, 0, stream>>>(n, f);
    check_cuda(cudaGetLastError(), "kernel launch");
  }

  struct temp_space {
    void* temp;
    std::size_t bytes;
    cudaStream_t stream;
    void sort_pairs(const std::uint64_t* kin, std::uint64_t* kout, const std::int64_t* vin, std::int64_t* vout,
                    std::int64_t n, int bits) const {
      if (n <= 0) return;
      std::size_t have = bytes;  // at least one bit: an empty bit range would leave the output unwritten
      check_cuda(radix_sort_pairs(temp, have, kin, kout, vin, vout, n, bits < 1 ? 1 : bits, stream),
                 "cub::DeviceRadixSort::SortPairs");
    }
    void exclusive_scan(const std::int64_t* in, std::int64_t* out, std::int64_t n) const {
      if (n <= 0) return;
      std::size_t have = bytes;
      check_cuda(exclusive_sum(temp, have, in, out, n, stream), "cub::DeviceScan::ExclusiveSum");
    }
  };

  /// The temp of a sort of n pairs or a scan of n items, whichever is larger.
  static std::size_t temp_bytes(std::int64_t n) {
    std::size_t sort = 0, scan = 0;
    if (n > 0) {
      check_cuda(radix_sort_pairs(nullptr, sort, nullptr, nullptr, nullptr, nullptr, n, 64, nullptr),
                 "cub::DeviceRadixSort::SortPairs (size query; is a CUDA device present?)");
      check_cuda(exclusive_sum(nullptr, scan, nullptr, nullptr, n, nullptr),
                 "cub::DeviceScan::ExclusiveSum (size query; is a CUDA device present?)");
    }
    return std::max(sort, scan) + 256;  // room to align the temporaries
  }
  temp_space temp(std::span<std::byte> s) const {
    const std::span<std::byte> a = aligned(s);
    return {a.data(), a.size(), stream};
  }

  struct gemmer {
    std::span<std::byte> workspace;
    cudaStream_t stream;
    void gemm_strided_batched(blas_op transa, blas_op transb, std::int64_t m, std::int64_t n, std::int64_t k,
                              float alpha, const void* a, dtype atype, std::int64_t lda, std::int64_t stride_a,
                              const void* b, dtype btype, std::int64_t ldb, std::int64_t stride_b, float beta, void* c,
                              dtype ctype, std::int64_t ldc, std::int64_t stride_c, std::int64_t batch) const {
      detail::gemm_strided_batched(stream, workspace, transa, transb, m, n, k, alpha, a, atype, lda, stride_a, b, btype,
                                   ldb, stride_b, beta, c, ctype, ldc, stride_c, batch);
    }
  };
  static void prepare_gemm() { blas_prepare(); }
  static std::size_t gemm_scratch_bytes() { return blas_workspace_bytes() + 256; }  // room to align
  gemmer gemm_scratch(std::span<std::byte> s) const { return {aligned(s), stream}; }

  /// `s` from its first 256-byte boundary on.
  static std::span<std::byte> aligned(std::span<std::byte> s) {
    const auto at = reinterpret_cast<std::uintptr_t>(s.data());
    const std::uintptr_t to = (at + 255) / 256 * 256;
    const std::size_t skip = std::min<std::size_t>(to - at, s.size());
    return s.subspan(skip);
  }
};

}  // namespace infkv::cuda::detail
