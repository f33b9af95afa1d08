// infkv: the top-k selector: keep the protected sinks and recent tokens, then the highest
// scores. Deterministic: ties go to the newer position, then the lower slot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "budget.hpp"
#include "keep_set.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

namespace detail {

/// Keeps `cap` of the row's slots: sinks + recent by time order, then the best scores.
inline std::vector<std::int64_t> select_row(std::span<const float> score, std::span<const token> tokens,
                                            std::int64_t cap, std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(score.size());
  std::vector<std::int64_t> kept;
  if (cap >= n) {
    kept.resize(std::size_t(n));
    for (std::int64_t i = 0; i < n; ++i) kept[std::size_t(i)] = i;
    return kept;
  }
  const auto order = time_order(tokens);
  std::vector<std::int64_t> cand;
  cand.reserve(std::size_t(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t s = order[std::size_t(i)];
    (i < sinks || i >= n - recent ? kept : cand).push_back(s);
  }
  const auto better = [&](std::int64_t a, std::int64_t b) {
    const float sa = score[std::size_t(a)], sb = score[std::size_t(b)];
    if (sa != sb) return sa > sb;
    const auto pa = tokens[std::size_t(a)].pos, pb = tokens[std::size_t(b)].pos;
    if (pa != pb) return pa > pb;
    return a < b;
  };
  const auto take = std::size_t(cap) - kept.size();
  std::nth_element(cand.begin(), cand.begin() + std::ptrdiff_t(take), cand.end(), better);
  kept.insert(kept.end(), cand.begin(), cand.begin() + std::ptrdiff_t(take));
  std::sort(kept.begin(), kept.end());
  return kept;
}

inline std::span<const token> unit_tokens(std::span<const token> tokens, std::int64_t unit, std::int64_t rows,
                                          std::int64_t cols) {
  if (std::int64_t(tokens.size()) == cols) return tokens;
  require(std::int64_t(tokens.size()) == rows * cols, "tokens.size()", tokens.size(),
          "must be the slot count (", cols, ") or one list per unit (", rows, " x ", cols, ")");
  return tokens.subspan(std::size_t(unit * cols), std::size_t(cols));
}

}  // namespace detail

/// Per row of `scores`, keeps `b.keep_count(cols)` slots: the first `b.sinks` and last
/// `b.recent` by position, then the highest scores. `tokens` holds one entry per slot, shared by
/// all rows, or rows x cols entries (one list per unit). NaN scores are an error.
/// O(rows * cols log cols).
inline keep_set select_top(const score_matrix& scores, std::span<const token> tokens, const budget& b) {
  check_scores(scores);
  const std::int64_t cap = b.keep_count(scores.cols);
  keep_set k(scores.cols);
  for (std::int64_t r = 0; r < scores.rows; ++r) {
    const auto t = detail::unit_tokens(tokens, r, scores.rows, scores.cols);
    validate_tokens(t, scores.cols);
    k.add_unit(detail::select_row(scores.row(r), t, cap, b.sinks, b.recent));
  }
  return k;
}

/// As above with one capacity per row (budget allocation: AdaKV, PyramidKV); each capacity must
/// hold the sinks and recent tokens.
inline keep_set select_top(const score_matrix& scores, std::span<const token> tokens,
                           std::span<const std::int64_t> capacities, std::int64_t sinks, std::int64_t recent) {
  check_scores(scores);
  detail::require(std::int64_t(capacities.size()) == scores.rows, "capacities.size()", capacities.size(),
                  "must equal scores.rows (", scores.rows, ")");
  keep_set k(scores.cols);
  for (std::int64_t r = 0; r < scores.rows; ++r) {
    const auto cap = capacities[std::size_t(r)];
    detail::require(cap >= sinks + recent || cap >= scores.cols, "capacities[" + std::to_string(r) + "]", cap,
                    "cannot hold sinks (", sinks, ") + recent (", recent, ")");
    const auto t = detail::unit_tokens(tokens, r, scores.rows, scores.cols);
    validate_tokens(t, scores.cols);
    k.add_unit(detail::select_row(scores.row(r), t, cap, sinks, recent));
  }
  return k;
}

}  // namespace infkv
