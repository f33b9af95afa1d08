// The CUDA backend's steps run on the host: a launcher that calls each body once per index, in
// blocks of an odd size visited last block first (a body that depends on the order in which
// threads run, or reads past its index range, shows up here under ASan / UBSan), a stable sort
// standing in for CUB's radix sort, std::exclusive_scan for CUB's scan, and a GEMM standing in
// for cuBLAS's strided batched GEMM: the same arguments, checked as cuBLAS checks them, the
// referenced sub-matrices of A and B (exactly those the transposes, leading dimensions and
// strides name) converted to f32 and multiplied by OpenBLAS's column-major cblas_sgemm, one call
// per batch entry.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include <infkv/cuda/detail/archive_steps.hpp>
#include <infkv/cuda/detail/cache_steps.hpp>

namespace infkv_test {

/// cublasGemmStridedBatchedEx's semantics on the host (column-major; strides and leading
/// dimensions in elements; C is f32, computed in f32). Raises invalid_argument where cuBLAS would
/// answer CUBLAS_STATUS_INVALID_VALUE (or not support the types).
inline void host_gemm_strided_batched(infkv::cuda::blas_op transa, infkv::cuda::blas_op transb, std::int64_t m,
                                      std::int64_t n, std::int64_t k, float alpha, const void* a, infkv::dtype atype,
                                      std::int64_t lda, std::int64_t stride_a, const void* b, infkv::dtype btype,
                                      std::int64_t ldb, std::int64_t stride_b, float beta, void* c, infkv::dtype ctype,
                                      std::int64_t ldc, std::int64_t stride_c, std::int64_t batch) {
  using infkv::cuda::blas_op;
  constexpr std::int64_t most = std::numeric_limits<int>::max();
  const std::int64_t ar = transa == blas_op::n ? m : k, ac = transa == blas_op::n ? k : m;  // A as stored
  const std::int64_t br = transb == blas_op::n ? k : n, bc = transb == blas_op::n ? n : k;
  INFKV_REQUIRE(m >= 0 && n >= 0 && k >= 0 && batch >= 0 && m <= most && n <= most && k <= most && batch <= most,
                "gemm sizes", m, "m, n, k and batchCount must be in [0, 2^31)");
  INFKV_REQUIRE(lda >= std::max<std::int64_t>(1, ar) && lda <= most, "lda", lda, "must be >= max(1, ", ar, ")");
  INFKV_REQUIRE(ldb >= std::max<std::int64_t>(1, br) && ldb <= most, "ldb", ldb, "must be >= max(1, ", br, ")");
  INFKV_REQUIRE(ldc >= std::max<std::int64_t>(1, m) && ldc <= most, "ldc", ldc, "must be >= max(1, ", m, ")");
  INFKV_REQUIRE(ctype == infkv::dtype::f32, "Ctype", infkv::to_string(ctype), "must be f32");
  INFKV_REQUIRE(atype == btype, "Atype", infkv::to_string(atype), "must equal Btype (", infkv::to_string(btype), ")");
  if (m == 0 || n == 0) return;
  const auto as_f32 = [](const void* base, infkv::dtype t, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    std::vector<float> out(std::size_t(rows * cols));
    const auto* bytes = static_cast<const std::byte*>(base);
    for (std::int64_t col = 0; col < cols; ++col)
      for (std::int64_t row = 0; row < rows; ++row)
        out[std::size_t(col * rows + row)] =
            infkv::cuda::detail::load(t, bytes + (col * ld) * std::int64_t(infkv::size_of(t)), row);
    return out;
  };
  static const bool one_thread = (openblas_set_num_threads(1), true);  // the tests share two cores
  (void)one_thread;
  const std::int64_t ea = std::int64_t(infkv::size_of(atype)), eb = std::int64_t(infkv::size_of(btype));
  for (std::int64_t x = 0; x < batch; ++x) {
    float* cx = static_cast<float*>(c) + x * stride_c;
    if (k == 0) {  // C = beta C (BLAS leaves it so; no A or B element is read)
      for (std::int64_t col = 0; col < n; ++col)
        for (std::int64_t row = 0; row < m; ++row) cx[col * ldc + row] = beta == 0.f ? 0.f : beta * cx[col * ldc + row];
      continue;
    }
    const std::vector<float> af = as_f32(static_cast<const std::byte*>(a) + x * stride_a * ea, atype, ar, ac, lda);
    const std::vector<float> bf = as_f32(static_cast<const std::byte*>(b) + x * stride_b * eb, btype, br, bc, ldb);
    cblas_sgemm(CblasColMajor, transa == blas_op::n ? CblasNoTrans : CblasTrans,
                transb == blas_op::n ? CblasNoTrans : CblasTrans, int(m), int(n), int(k), alpha, af.data(), int(ar),
                bf.data(), int(br), beta, cx, int(ldc));
  }
}

struct host_launcher {
  std::int64_t block = 37;

  template <class F>
  void for_each(std::int64_t n, F f) const {
    const std::int64_t blocks = (n + block - 1) / block;
    for (std::int64_t b = blocks - 1; b >= 0; --b)
      for (std::int64_t t = 0; t < block; ++t)
        if (const std::int64_t i = b * block + t; i < n) f(i);
  }

  struct temp_space {
    void sort_pairs(const std::uint64_t* kin, std::uint64_t* kout, const std::int64_t* vin, std::int64_t* vout,
                    std::int64_t n, int bits) const {
      const std::uint64_t mask = bits >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
      std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
      std::iota(idx.begin(), idx.end(), std::int64_t{0});
      std::stable_sort(idx.begin(), idx.end(),
                       [&](std::int64_t a, std::int64_t b) { return (kin[a] & mask) < (kin[b] & mask); });
      std::vector<std::uint64_t> k(idx.size());
      std::vector<std::int64_t> v(idx.size());
      for (std::size_t i = 0; i < idx.size(); ++i) k[i] = kin[idx[i]], v[i] = vin[idx[i]];
      std::copy(k.begin(), k.end(), kout);
      std::copy(v.begin(), v.end(), vout);
    }
    void exclusive_scan(const std::int64_t* in, std::int64_t* out, std::int64_t n) const {
      std::exclusive_scan(in, in + n, out, std::int64_t{0});
    }
  };
  static std::size_t temp_bytes(std::int64_t) { return 0; }
  temp_space temp(std::span<std::byte>) const { return {}; }

  /// GEMM calls made so far (the tests check which path the window attention takes).
  static inline std::int64_t gemm_calls = 0;
  struct gemmer {
    template <class... A>
    void gemm_strided_batched(A... args) const {
      ++gemm_calls;
      host_gemm_strided_batched(args...);
    }
  };
  static void prepare_gemm() {}
  static std::size_t gemm_scratch_bytes() { return 0; }
  gemmer gemm_scratch(std::span<std::byte>) const { return {}; }
};

/// The CUDA backend's algorithm, run on the host.
using host_cuda_backend = infkv::cuda::basic_backend<host_launcher>;

}  // namespace infkv_test
