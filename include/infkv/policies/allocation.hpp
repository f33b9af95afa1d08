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
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "../budget.hpp"
#include "../scores.hpp"
#include "../tokens.hpp"

namespace infkv {

namespace detail {
/// Rounds non-negative shares to integers that add up to `total` (largest remainder).
inline std::vector<std::int64_t> round_shares(std::span<const double> share, std::int64_t total) {
  std::vector<std::int64_t> out(share.size());
  std::vector<std::size_t> idx(share.size());
  std::int64_t sum = 0;
  for (std::size_t i = 0; i < share.size(); ++i) sum += out[i] = std::int64_t(std::floor(share[i] + 1e-9));
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) {
    return share[a] - double(out[a]) > share[b] - double(out[b]);
  });
  for (std::size_t k = 0; sum < total && k < idx.size(); ++k, ++sum) ++out[idx[k]];
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
    detail::require(base.capacity > 0, "budget.capacity", base.capacity, "PyramidKV needs an absolute capacity");
    detail::require(n_layers >= 1, "n_layers", n_layers, "must be >= 1");
    detail::require(std::isfinite(beta) && beta >= 1.0, "pyramidkv.beta", beta, "must be >= 1");
    const double b = double(base.capacity - base.recent), lo = b / beta, hi = 2 * b - lo;
    std::vector<double> share(static_cast<std::size_t>(n_layers));
    for (std::int32_t l = 0; l < n_layers; ++l)
      share[std::size_t(l)] = n_layers == 1 ? b : hi - double(l) * (hi - lo) / double(n_layers - 1);
    const auto prefix = detail::round_shares(share, std::int64_t(n_layers) * (base.capacity - base.recent));
    std::vector<budget> out(static_cast<std::size_t>(n_layers), base);
    for (std::int32_t l = 0; l < n_layers; ++l) {
      out[std::size_t(l)].capacity = prefix[std::size_t(l)] + base.recent;
      detail::require(out[std::size_t(l)].capacity >= base.sinks + base.recent, "budget.capacity", base.capacity,
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
  double alpha = 0.2;

  /// Capacities per row of `scores` (KV heads), adding up to rows x b.keep_count(cols).
  std::vector<std::int64_t> allocate(const score_matrix& scores, std::span<const token> tokens, const budget& b) const {
    detail::require(std::isfinite(alpha) && alpha >= 0.0 && alpha <= 1.0, "adakv.alpha", alpha, "must be in [0, 1]");
    check_scores(scores);
    validate_tokens(tokens, scores.cols);
    const std::int64_t n = scores.cols, cap = b.keep_count(n), rows = scores.rows;
    if (cap >= n) return std::vector<std::int64_t>(std::size_t(rows), n);
    const std::int64_t prot = b.sinks + b.recent, free_each = cap - prot;
    const auto order = time_order(tokens);
    std::vector<std::pair<float, std::int64_t>> cand;  // (score, row)
    cand.reserve(std::size_t(rows * (n - prot)));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = b.sinks; i < n - b.recent; ++i) cand.push_back({scores(r, order[std::size_t(i)]), r});
    const std::int64_t total = rows * free_each;
    std::nth_element(cand.begin(), cand.begin() + total, cand.end(), [](auto& x, auto& y) {
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    std::vector<double> wins(static_cast<std::size_t>(rows), 0.0);
    for (std::int64_t i = 0; i < total; ++i) wins[std::size_t(cand[std::size_t(i)].second)] += 1.0;
    for (auto& w : wins) w = w * (1.0 - alpha) + alpha * double(free_each);
    auto out = detail::round_shares(wins, total);
    for (auto& c : out) c += prot;
    return out;
  }
};

}  // namespace infkv
