// The CUDA backend's steps run on the host: a launcher that calls each body once per index, in
// blocks of an odd size visited last block first (a body that depends on the order in which
// threads run, or reads past its index range, shows up here under ASan / UBSan), a stable sort
// standing in for CUB's radix sort and std::exclusive_scan for CUB's scan.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include <infkv/cuda/detail/cache_steps.hpp>

namespace infkv_test {

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
};

/// The CUDA backend's algorithm, run on the host.
using host_cuda_backend = infkv::cuda::basic_backend<host_launcher>;

}  // namespace infkv_test
