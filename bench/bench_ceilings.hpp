// infkv benchmarks: machine ceilings measured in the same run as the kernels, so each kernel's
// throughput can be read as a fraction of what this machine (and its current load) allows.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infkv_bench {

/// Flops of one call of `fma_kernel(iters)` (iters rounded up to a multiple of 4).
std::int64_t fma_kernel_flops(std::int64_t iters);

/// Runs `iters` rounds of independent 8-wide f32 FMA chains (AVX2+FMA when the CPU has them,
/// scalar otherwise); returns a value derived from the chains so they cannot be optimised away.
float fma_kernel(std::int64_t iters);

/// True when `fma_kernel` takes the AVX2+FMA path on this CPU.
bool fma_kernel_is_vector();

/// Single-thread peak f32 flop/s of `fma_kernel` (best of several timed runs), measured once.
double peak_flops();

/// Bytes for a buffer well beyond the last-level cache.
std::size_t beyond_llc_bytes();

/// memcpy bandwidth (bytes copied per second, best of several copies of a `beyond_llc_bytes`
/// buffer), measured once.
double memcpy_bandwidth();

}  // namespace infkv_bench
