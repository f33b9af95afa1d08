// infkv CUDA backend: the one CUB call site (radix sort of 64-bit keys with 64-bit values).
#include <cub/device/device_radix_sort.cuh>

#include "launcher.cuh"

namespace infkv::cuda::detail {

cudaError_t radix_sort_pairs(void* temp, std::size_t& bytes, const std::uint64_t* kin, std::uint64_t* kout,
                             const std::int64_t* vin, std::int64_t* vout, std::int64_t n, int bits,
                             cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, bytes, kin, kout, vin, vout, n, 0, bits, stream);
}

}  // namespace infkv::cuda::detail
