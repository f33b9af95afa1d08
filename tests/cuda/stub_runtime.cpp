// A stand-in for the CUDA runtime that the no-sync test links infkv::cuda against instead of
// libcudart: it runs no kernel, records every runtime call the library makes (launches and
// copies with their stream), and flags any call that would make the host wait for the device,
// copy to pageable host memory, or allocate. "Device memory" is an address range mapped without
// access rights, so host code that dereferences a device pointer crashes the test. Only the
// calls infkv::cuda uses are defined: a new runtime call in the library fails to link here, and
// then belongs in this file, allowed or flagged. The same holds for the cuBLAS calls the library
// makes (the test links no cuBLAS): creating a handle is flagged (it allocates), setting a
// handle's stream and workspace is not, and a GEMM is flagged when its operands or workspace are
// not device memory or when its handle has no workspace of the caller (cuBLAS would then
// allocate its own).
#include "stub_runtime.hpp"

#include <cublas_v2.h>

#include <sys/mman.h>

#include <cstring>
#include <mutex>

namespace stub {

namespace {
constexpr std::size_t region_bytes = std::size_t(1) << 32;
std::byte* region = nullptr;
std::size_t used = 0;
std::vector<call> log_;
std::mutex mu;
int handles = 0;

std::byte* base() {
  if (region == nullptr) {
    void* p = mmap(nullptr, region_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) std::abort();
    region = static_cast<std::byte*>(p);
  }
  return region;
}

void note(const char* name, cudaStream_t stream, bool forbidden, std::string detail = {}) {
  std::lock_guard lock(mu);
  log_.push_back({name, stream, forbidden, std::move(detail)});
}
}  // namespace

void* device_alloc(std::size_t bytes) {
  std::byte* b = base();
  std::lock_guard lock(mu);
  const std::size_t at = (used + 255) / 256 * 256;
  if (at + bytes > region_bytes) std::abort();
  used = at + bytes;
  return b + at;
}

bool is_device(const void* p) {
  const auto* b = static_cast<const std::byte*>(p);
  return region != nullptr && b >= region && b < region + region_bytes;
}

std::vector<call> calls() {
  std::lock_guard lock(mu);
  return log_;
}

void clear() {
  std::lock_guard lock(mu);
  log_.clear();
}

int handles_created() {
  std::lock_guard lock(mu);
  return handles;
}

}  // namespace stub

using stub::note;

extern "C" {

// What nvcc's host code calls to register device code and launch kernels.
void** __cudaRegisterFatBinary(void* fat) {
  static void* handle = nullptr;
  handle = fat;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char*, char*, const char*, int, uint3*, uint3*, dim3*, dim3*, int*) {}
void __cudaRegisterVar(void**, char*, char*, const char*, int, size_t, int, int) {}

namespace {
struct launch_config {
  dim3 grid, block;
  size_t shared;
  cudaStream_t stream;
} pending{};
}  // namespace

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shared, CUstream_st* stream) {
  pending = {grid, block, shared, stream};
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shared, void* stream) {
  *grid = pending.grid, *block = pending.block, *shared = pending.shared;
  *static_cast<cudaStream_t*>(stream) = pending.stream;
  return cudaSuccess;
}
cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* fun) {
  *kernel = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t, dim3 grid, dim3 block, void**, size_t, cudaStream_t stream) {
  note("launch", stream, false,
       std::to_string(std::uint64_t(grid.x) * grid.y * grid.z) + " x " + std::to_string(block.x * block.y * block.z));
  return cudaSuccess;
}

// Queries: answered as a 132-SM compute capability 9.0 device would.
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrL2CacheSize: *value = 50 << 20; break;
    default: *value = 1;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void*) {
  std::memset(attr, 0, sizeof *attr);
  attr->maxThreadsPerBlock = 1024;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  attr->numRegs = 32;
  return cudaSuccess;
}
// A kernel's shared memory limit (the fused window attention's above 48 KiB): a property of the
// function, not stream work; it waits for nothing and is allowed under capture (not recorded).
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* blocks, const void*, int, size_t,
                                                                   unsigned int) {
  *blocks = 4;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorStub"; }
const char* cudaGetErrorString(cudaError_t) { return "stub runtime"; }

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  std::memset(attr, 0, sizeof *attr);
  attr->type = stub::is_device(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  attr->devicePointer = stub::is_device(p) ? const_cast<void*>(p) : nullptr;
  return cudaSuccess;
}

// Stream work: allowed while both sides of a copy are device memory; a copy to or from host
// memory (pageable here: the stub pins nothing) is flagged, and reads as "all ones" (a status
// word with nothing recorded), so that cuda::check can be run through.
cudaError_t cudaMemsetAsync(void* p, int, size_t bytes, cudaStream_t stream) {
  note("cudaMemsetAsync", stream, !stub::is_device(p), std::to_string(bytes) + " bytes");
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
  const bool pageable = !stub::is_device(dst) || !stub::is_device(src);
  if (!stub::is_device(dst)) std::memset(dst, 0xff, bytes);
  note("cudaMemcpyAsync", stream, pageable, pageable ? "to or from pageable host memory" : "device to device");
  return cudaSuccess;
}

// Everything that waits for the device or allocates: flagged.
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  note("cudaStreamSynchronize", stream, true);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  note("cudaDeviceSynchronize", nullptr, true);
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  note("cudaStreamQuery", stream, true);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void*, size_t bytes, cudaMemcpyKind) {
  if (!stub::is_device(dst)) std::memset(dst, 0xff, bytes);
  note("cudaMemcpy", nullptr, true);
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = stub::device_alloc(bytes);
  note("cudaMalloc", nullptr, true);
  return cudaSuccess;
}
cudaError_t cudaFree(void*) {
  note("cudaFree", nullptr, true);
  return cudaSuccess;
}

}  // extern "C"

// cuBLAS: a handle remembers its stream and the workspace set since that stream was set.
struct cublasContext {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  *handle = new cublasContext{};
  {
    std::lock_guard lock(stub::mu);
    ++stub::handles;
  }
  note("cublasCreate", nullptr, true, "allocates");
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  handle->stream = stream, handle->workspace = nullptr, handle->workspace_bytes = 0;  // as cuBLAS resets it
  note("cublasSetStream", stream, false);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  handle->workspace = workspace, handle->workspace_bytes = bytes;
  const bool bad = bytes > 0 && (!stub::is_device(workspace) || reinterpret_cast<std::uintptr_t>(workspace) % 256 != 0);
  note("cublasSetWorkspace", handle->stream, bad, std::to_string(bytes) + " bytes");
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t, cublasOperation_t, int m, int n,
                                          int k, const void*, const void* a, cudaDataType, int, long long,
                                          const void* b, cudaDataType, int, long long, const void*, void* c,
                                          cudaDataType, int, long long, int batch, cublasComputeType_t,
                                          cublasGemmAlgo_t) {
  const bool bad = !stub::is_device(a) || !stub::is_device(b) || !stub::is_device(c) || handle->workspace_bytes == 0;
  note("cublasGemmStridedBatchedEx", handle->stream, bad,
       std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k) + ", batch " + std::to_string(batch) +
           (handle->workspace_bytes == 0 ? ", no workspace of the caller" : ""));
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_STUB"; }
const char* cublasGetStatusString(cublasStatus_t) { return "stub cuBLAS"; }

}  // extern "C"
