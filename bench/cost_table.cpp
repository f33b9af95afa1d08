// infkv_cost_table: the CUDA cost model (cost_model.hpp) for one layer of 128K slots, 8 KV heads,
// head_dim 128, f16, a window of 32 queries of 32 query heads, 8,192 slots kept per head, with the
// roofline time on a GPU of the given copy bandwidth, tensor-core peak and f32 peak (an H200's by
// default: 4.8 TB/s, 989 TFLOP/s dense f16, 67 TFLOP/s f32). Writes JSON for
// scripts/perf_report.py; needs no GPU.
//
//   infkv_cost_table COMMIT [BANDWIDTH_BYTES_PER_S PEAK_FLOP_PER_S PEAK_F32_FLOP_PER_S]
//     > bench/results/gpu/cost_model.json
#include <cstdio>
#include <cstdlib>

#include "cost_model.hpp"

int main(int argc, char** argv) {
  const char* commit = argc > 1 ? argv[1] : "unknown";
  const bool given = argc > 4;
  const double bandwidth = given ? std::atof(argv[2]) : 4.8e12, peak = given ? std::atof(argv[3]) : 989e12,
               peak_f32 = given ? std::atof(argv[4]) : 67e12;
  const infkv_bench::layer_case c;
  std::printf(
      "{\n \"commit\": \"%s\",\n \"protocol\": \"computed from the shapes by bench/cost_model.hpp "
      "(no measurement): least bytes and FLOPs per kernel, roofline = max(bytes / bandwidth, flops / peak), the f32 "
      "peak for f32 products\",\n",
      commit);
  std::printf(
      " \"case\": {\"n\": %lld, \"kv_heads\": %lld, \"q_heads\": %lld, \"head_dim\": %lld, \"window\": %lld, "
      "\"element_bytes\": %lld, \"kept\": %lld},\n",
      (long long)c.n, (long long)c.hkv, (long long)c.hq, (long long)c.d, (long long)c.m, (long long)c.elem,
      (long long)c.kept);
  std::printf(
      " \"gpu\": {\"copy_bytes_per_s\": %.4g, \"peak_flop_per_s\": %.4g, \"peak_f32_flop_per_s\": %.4g},\n "
      "\"kernels\": [\n",
      bandwidth, peak, peak_f32);
  const auto kernels = infkv_bench::eviction_kernels(c);
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    const auto& k = kernels[i];
    std::printf(
        "  {\"kernel\": \"%s\", \"what\": \"%s\", \"bytes\": %.6g, \"flops\": %.6g, \"f32\": %s, \"roofline_us\": "
        "%.4g}%s\n",
        k.kernel.c_str(), k.what.c_str(), k.bytes, k.flops, k.f32 ? "true" : "false",
        k.roofline(bandwidth, peak, peak_f32) * 1e6, i + 1 < kernels.size() ? "," : "");
  }
  std::printf(" ]\n}\n");
  return 0;
}
