// Budget allocation on top of any scorer.
// PyramidKV (Cai et al., arXiv 2406.02069): per-layer capacity falls linearly with depth.
//   Inputs: layer count and the mean budget. Cost: O(layers).
// AdaKV (Feng et al., arXiv 2407.11550): within a layer, heads share the budget by how many of
//   the layer's global top scores they hold, with a safety floor alpha. Inputs: per-head scores.
//   Granularity: per KV head. Cost: O(Hkv * n log(Hkv * n)).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "budget.hpp"
#include "error.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

namespace detail {
/// Rounds non-negative shares to integers that add up to `total` (largest remainder, ties to the
/// lower index). `idx` holds share.size() entries of scratch. Allocates nothing.
inline void round_shares_into(std::span<const double> share, std::int64_t total, std::int64_t* out, std::int64_t* idx) {
  const auto k = std::int64_t(share.size());
  std::int64_t sum = 0;
  for (std::int64_t i = 0; i < k; ++i) sum += out[i] = std::int64_t(std::floor(share[std::size_t(i)] + 1e-9));
  for (std::int64_t i = 0; i < k; ++i) idx[i] = i;
  const auto rem = [&](std::int64_t i) { return share[std::size_t(i)] - double(out[i]); };
  std::sort(idx, idx + k, [&](std::int64_t a, std::int64_t b) { return rem(a) != rem(b) ? rem(a) > rem(b) : a < b; });
  for (std::int64_t j = 0; sum < total && j < k; ++j, ++sum) ++out[idx[j]];
}
inline std::vector<std::int64_t> round_shares(std::span<const double> share, std::int64_t total) {
  std::vector<std::int64_t> out(share.size()), idx(share.size());
  round_shares_into(share, total, out.data(), idx.data());
  return out;
}
}  // namespace detail

/// PyramidKV: layer l of `n_layers` keeps max - l (max - min) / (L - 1) slots besides the
/// protected `recent` window, with B = capacity - recent, min = B / beta, max = 2B - min.
/// The capacities add up to n_layers * base.capacity.
struct pyramidkv {
  double beta = 20.0;

  std::vector<budget> allocate(std::int32_t n_layers, const budget& base) const {
    base.validate();
    INFKV_REQUIRE(base.capacity > 0, "budget.capacity", base.capacity, "PyramidKV needs an absolute capacity");
    INFKV_REQUIRE(n_layers >= 1, "n_layers", n_layers, "must be >= 1");
    INFKV_REQUIRE(std::isfinite(beta) && beta >= 1.0, "pyramidkv.beta", beta, "must be >= 1");
    const double b = double(base.capacity - base.recent), lo = b / beta, hi = 2 * b - lo;
    std::vector<double> share(static_cast<std::size_t>(n_layers));
    for (std::int32_t l = 0; l < n_layers; ++l)
      share[std::size_t(l)] = n_layers == 1 ? b : hi - double(l) * (hi - lo) / double(n_layers - 1);
    const auto prefix = detail::round_shares(share, std::int64_t(n_layers) * (base.capacity - base.recent));
    std::vector<budget> out(static_cast<std::size_t>(n_layers), base);
    for (std::int32_t l = 0; l < n_layers; ++l) {
      out[std::size_t(l)].capacity = prefix[std::size_t(l)] + base.recent;
      INFKV_REQUIRE(out[std::size_t(l)].capacity >= base.sinks + base.recent, "budget.capacity", base.capacity,
                    "too small for PyramidKV: layer ", l, " would keep ", out[std::size_t(l)].capacity,
                    " < sinks + recent (", base.sinks + base.recent, ")");
    }
    return out;
  }
};

/// AdaKV: every head keeps its protected sinks + recent; the rest of the layer's budget
/// (Hkv x (capacity - protected)) goes to the heads in proportion to how many of the layer's
/// global top unprotected scores they hold, blended with an equal share by `alpha`.
struct adakv {
  double alpha = 0.2;  ///< safety floor in [0, 1]: the share of the free budget split equally

  void validate() const {
    INFKV_REQUIRE(std::isfinite(alpha) && alpha >= 0.0 && alpha <= 1.0, "adakv.alpha", alpha, "must be in [0, 1]");
  }

  /// Scratch `allocate_into` needs for `rows` x `cols` scores, in int64 entries.
  static std::int64_t scratch_size(std::int64_t rows, std::int64_t cols) { return rows * cols + 3 * rows; }
};

}  // namespace infkv
