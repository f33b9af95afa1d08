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
  std::int64_t kept = 65536;
  double key_bytes() const { return double(n) * double(hkv * d * elem); }
};

/// Least traffic (bytes read + written) and arithmetic (FLOPs) of a kernel.
struct cost {
  std::string kernel, what;
  double bytes = 0, flops = 0;
  /// The roofline time in seconds on a GPU of `bandwidth` bytes/s and `peak` FLOP/s.
  double roofline(double bandwidth, double peak) const { return std::max(bytes / bandwidth, flops / peak); }
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
/// Expected Attention: one pass over the keys, a d x d quadratic form per (key, query head).
inline cost expected_attention(const layer_case& c) {
  return {"expected attention", "one pass over the keys, q.k and k^T S k per query head",
          c.key_bytes() + double(c.hkv * c.n) * 4, 2.0 * double(c.hq * c.n) * double(c.d * c.d + c.d)};
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
