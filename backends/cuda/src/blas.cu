// infkv CUDA backend: the one cuBLAS call site (a strided batched GEMM, f32 accumulation) and the
// cuBLAS handles, one per device, created when planning and kept for the process's life (a
// handle destroyed at exit could outlive the CUDA context it belongs to).
#include <cublas_v2.h>

#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "launcher.cuh"

namespace infkv::cuda::detail {

namespace {

struct device_blas {
  cublasHandle_t handle = nullptr;
  std::mutex mu;  // stream, workspace and call of one handle go together
};

std::mutex table_mu;
std::vector<std::unique_ptr<device_blas>>& table() {
  static std::vector<std::unique_ptr<device_blas>> t;
  return t;
}

void check_blas(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    infkv::raise<engine_error>("infkv: ", call, " failed: ", cublasGetStatusName(s), " (", cublasGetStatusString(s),
                               ")");
}

int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

cudaDataType_t cuda_type(dtype t) {
  switch (t) {
    case dtype::f32: return CUDA_R_32F;
    case dtype::f16: return CUDA_R_16F;
    case dtype::bf16: return CUDA_R_16BF;
  }
  infkv::fail("infkv: cublasGemmStridedBatchedEx: unknown dtype ", int(t));
}

cublasOperation_t cuda_op(blas_op o) { return o == blas_op::n ? CUBLAS_OP_N : CUBLAS_OP_T; }

int as_int(std::int64_t v, const char* name) {
  INFKV_REQUIRE(v >= 0 && v <= std::numeric_limits<int>::max(), name, v,
                "must fit cublasGemmStridedBatchedEx's int (0 to 2^31 - 1)");
  return int(v);
}

}  // namespace

void blas_prepare() {
  const int device = current_device();
  const std::lock_guard lock(table_mu);
  auto& t = table();
  if (std::size_t(device) >= t.size()) t.resize(std::size_t(device) + 1);
  if (!t[std::size_t(device)]) {
    auto b = std::make_unique<device_blas>();
    check_blas(cublasCreate(&b->handle), "cublasCreate");
    t[std::size_t(device)] = std::move(b);
  }
}

std::size_t blas_workspace_bytes() {
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, current_device()),
             "cudaDeviceGetAttribute");
  return std::size_t(major >= 9 ? 32 : 4) << 20;
}

void gemm_strided_batched(cudaStream_t stream, std::span<std::byte> workspace, blas_op transa, blas_op transb,
                          std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const void* a, dtype atype,
                          std::int64_t lda, std::int64_t stride_a, const void* b, dtype btype, std::int64_t ldb,
                          std::int64_t stride_b, float beta, void* c, dtype ctype, std::int64_t ldc,
                          std::int64_t stride_c, std::int64_t batch) {
  const int device = current_device();
  device_blas* blas = nullptr;
  {
    const std::lock_guard lock(table_mu);
    if (std::size_t(device) < table().size()) blas = table()[std::size_t(device)].get();
  }
  INFKV_REQUIRE(blas != nullptr, "device", device,
                "has no cuBLAS handle yet: plan on this device first (backend::scratch_bytes, make_plan or "
                "h2o_scratch_bytes create it; a run never does, as it may be captured into a graph)");
  INFKV_REQUIRE(ctype == dtype::f32, "Ctype", to_string(ctype), "must be f32");
  const std::lock_guard lock(blas->mu);
  check_blas(cublasSetStream(blas->handle, stream), "cublasSetStream");  // resets the workspace: set it after
  check_blas(cublasSetWorkspace(blas->handle, workspace.data(), workspace.size()), "cublasSetWorkspace");
  check_blas(cublasGemmStridedBatchedEx(blas->handle, cuda_op(transa), cuda_op(transb), as_int(m, "m"), as_int(n, "n"),
                                        as_int(k, "k"), &alpha, a, cuda_type(atype), as_int(lda, "lda"), stride_a, b,
                                        cuda_type(btype), as_int(ldb, "ldb"), stride_b, &beta, c, cuda_type(ctype),
                                        as_int(ldc, "ldc"), stride_c, as_int(batch, "batchCount"), CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT),
             "cublasGemmStridedBatchedEx");
}

}  // namespace infkv::cuda::detail
