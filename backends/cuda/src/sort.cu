// infkv CUDA backend: the CUB call sites (radix sort of 64-bit keys with 64-bit values, exclusive
// sum of 64-bit integers).
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "launcher.cuh"

namespace infkv::cuda::detail {

cudaError_t radix_sort_pairs(void* temp, std::size_t& bytes, const std::uint64_t* kin, std::uint64_t* kout,
                             const std::int64_t* vin, std::int64_t* vout, std::int64_t n, int bits,
                             cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, bytes, kin, kout, vin, vout, n, 0, bits, stream);
}

cudaError_t exclusive_sum(void* temp, std::size_t& bytes, const std::int64_t* in, std::int64_t* out, std::int64_t n,
                          cudaStream_t stream) {
  return cub::DeviceScan::ExclusiveSum(temp, bytes, in, out, n, stream);
}

}  // namespace infkv::cuda::detail
