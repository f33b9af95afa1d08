// infkv CUDA cost model: the least bytes each kernel of one eviction must move and the FLOPs it
// must do, computed from the layer's shape. infkv_bench_cuda divides its measured rates by them
// (fraction of the copy bandwidth or of the tensor-core peak measured in the same run);
// infkv_cost_table prints them with the roofline time on a given GPU for docs/performance.md.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace infkv_bench {

/// One layer: n slots of hkv KV heads of head_dim d, `elem` bytes per element, a window of m
/// queries of hq query heads, `kept` slots kept per head by the eviction.
struct layer_case {
  std::int64_t n = 131072;
  std::int64_t hkv = 8, hq = 32, d = 128, m = 32, elem = 2;
  std::int64_t kept = 8192;
  double key_bytes() const { return double(n) * double(hkv * d * elem); }
};

/// Least traffic (bytes read + written) and arithmetic (FLOPs) of a kernel.
struct cost {
  std::string kernel, what;
  double bytes = 0, flops = 0;
  bool f32 = false;  ///< its products are f32 GEMMs (CUDA cores), not f16 / bf16 ones on tensor cores
  /// The roofline time in seconds on a GPU of `bandwidth` bytes/s, `peak` FLOP/s on tensor cores
  /// and `peak_f32` in f32.
  double roofline(double bandwidth, double peak, double peak_f32) const {
    return std::max(bytes / bandwidth, flops / (f32 ? peak_f32 : peak));
  }
};

/// Window queries against every key: logits twice (softmax statistics, then the mass), keys read
/// once per pass; the scores written once.
inline cost window_scoring(const layer_case& c, std::int64_t queries) {
  return {"window scoring", "two passes over the keys, logits of every window query twice",
          2 * c.key_bytes() + double(c.hkv * c.n) * 4, 2.0 * 2.0 * double(c.hq * queries) * double(c.n) * double(c.d)};
}
/// KeyDiff: the anchor (sum of unit keys) in one pass, the cosines in a second.
inline cost keydiff(const layer_case& c) {
  return {"keydiff", "two passes over the keys", 2 * c.key_bytes() + double(c.hkv * c.n) * 4,
          4.0 * double(c.hkv * c.n * c.d)};
}
/// Expected Attention: one pass over the keys; per (key, query head) the product with mu' and the
/// covariance term in the cheaper form (the m centred queries' projections, or k^T Sigma' k with
/// Sigma' one d x d x m GEMM per query head), f32 GEMMs (the operands are derived statistics).
inline cost expected_attention(const layer_case& c) {
  const bool matrix = c.d * (c.m + c.n) < c.n * c.m;  // covariance_as_matrix
  const double rows = double(1 + (matrix ? c.d : c.m)), sigma = matrix ? 2.0 * double(c.hq * c.d * c.d * c.m) : 0.0;
  return {"expected attention",
          matrix ? "one pass over the keys, q.k and k^T S k per query head, f32"
                 : "one pass over the keys, q.k and the window's projections per query head, f32",
          c.key_bytes() + double(c.hkv * c.n) * 4, 2.0 * double(c.hq * c.n) * double(c.d) * rows + sigma, true};
}
/// H2O's step for one decode token: its logits against every key (one pass), the state's three
/// f32 rows read and written.
inline cost h2o_observe(const layer_case& c) {
  return {"h2o observe", "one decode query: keys once, state rows read and written",
          c.key_bytes() + 6.0 * double(c.hkv * c.n) * 4, 2.0 * 2.0 * double(c.hq * c.n * c.d)};
}
/// Per-head selection: the scores and the time order read once, the kept slots written.
inline cost selection(const layer_case& c) {
  return {"selection", "scores and order read once, kept slots written",
          double(c.hkv * c.n) * 4 + double(c.n) * 8 + double(c.hkv * c.kept) * 8, 0};
}
/// Compaction: every kept row of K and V that moves read and written once (the first stays).
inline cost compaction(const layer_case& c) {
  return {"compaction", "kept K and V rows read and written once",
          2.0 * 2.0 * double(c.kept - 1) * double(c.hkv * c.d * c.elem), 0};
}
/// Re-rotation of every kept key.
inline cost rerotate(const layer_case& c) {
  return {"rerotate", "kept keys read and written once", 2.0 * double(c.kept) * double(c.hkv * c.d * c.elem),
          6.0 * double(c.kept * c.hkv * c.d / 2)};
}

/// Every kernel of one eviction of the case (window scoring, then selection, compaction and
/// re-rotation), and the other score sources.
inline std::vector<cost> eviction_kernels(const layer_case& c) {
  cost tova = window_scoring(c, 1);
  tova.kernel = "tova scoring", tova.what = "two passes over the keys, the last query's logits twice";
  return {window_scoring(c, c.m), tova,         keydiff(c),    expected_attention(c),
          h2o_observe(c),         selection(c), compaction(c), rerotate(c)};
}

}  // namespace infkv_bench
