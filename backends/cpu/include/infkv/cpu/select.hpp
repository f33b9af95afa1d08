// infkv CPU backend: host conveniences over score matrices that own their results: the top-k
// of every row (select_top), selection by whole positions (select_whole_positions), the
// attention bias and AdaKV's allocation of a score matrix. They allocate; callers that must not
// use make_plan / run with cpu::backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <infkv/allocation.hpp>
#include <infkv/bias.hpp>
#include <infkv/budget.hpp>
#include <infkv/keep_set.hpp>
#include <infkv/scores.hpp>
#include <infkv/tokens.hpp>

#include "detail/rows.hpp"

namespace infkv::cpu {

/// Keeps at most `cap` of one row's n slots such that slots sharing a position are kept or
/// dropped together (the tokens of one M-RoPE image share one position, and an engine removes
/// cache cells by position): every group of equal positions holding one of the first `sinks` or
/// the last `recent` slots in time order is kept whole, then whole groups in order of their mean
/// score (double; equal means go to the newer position), each taken when it fits the room left
/// and skipped otherwise. So fewer than `cap` slots may stay when a group does not fit. With
/// distinct positions this keeps exactly what select_top keeps. Raises naming `cap` when
/// the protected groups alone exceed it, and on a NaN score. O(n log n).
inline keep_set select_whole_positions(std::span<const float> score, std::span<const token> tokens, std::int64_t cap,
                                       std::int64_t sinks, std::int64_t recent) {
  const auto n = std::int64_t(tokens.size());
  validate_tokens(tokens, n);
  INFKV_REQUIRE(std::int64_t(score.size()) == n, "score.size()", score.size(), "must equal tokens.size() (", n, ")");
  INFKV_REQUIRE(cap >= 0 && sinks >= 0 && recent >= 0, "cap", cap, "cap, sinks (", sinks, ") and recent (", recent,
                ") must be >= 0");
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isnan(score[std::size_t(i)])) [[unlikely]]
      infkv::fail("infkv: score[", i, "] = nan: scores must not be NaN");
  // Groups: runs of equal positions in time order, [first, end) into `order`.
  const auto order = time_order(tokens);
  struct group {
    std::int64_t first, end;
    double mean;
  };
  std::vector<group> groups;
  for (std::int64_t i = 0; i < n;) {
    std::int64_t j = i;
    double sum = 0;
    for (; j < n && tokens[std::size_t(order[j])].pos == tokens[std::size_t(order[i])].pos; ++j)
      sum += double(score[std::size_t(order[j])]);
    groups.push_back({i, j, sum / double(j - i)});
    i = j;
  }
  std::vector<bool> keep(static_cast<std::size_t>(n), false);
  std::int64_t kept = 0;
  std::vector<std::size_t> cand;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const bool guarded = groups[g].first < sinks || groups[g].end > n - recent || cap >= n;
    if (!guarded) {
      cand.push_back(g);
      continue;
    }
    for (std::int64_t i = groups[g].first; i < groups[g].end; ++i) keep[std::size_t(order[i])] = true;
    kept += groups[g].end - groups[g].first;
  }
  INFKV_REQUIRE(kept <= cap || cap >= n, "cap", cap, "cannot hold the protected slots' whole positions: the first ",
                sinks, " and last ", recent, " slots lie in positions held by ", kept, " slots");
  // Later groups first on equal means: the newer position (time order is position order).
  std::stable_sort(cand.begin(), cand.end(), [&](std::size_t a, std::size_t b) {
    return groups[a].mean != groups[b].mean ? groups[a].mean > groups[b].mean : a > b;
  });
  for (const auto g : cand) {
    const std::int64_t size = groups[g].end - groups[g].first;
    if (kept + size > cap) continue;
    for (std::int64_t i = groups[g].first; i < groups[g].end; ++i) keep[std::size_t(order[i])] = true;
    kept += size;
  }
  std::vector<std::int64_t> slots;
  slots.reserve(std::size_t(kept));
  for (std::int64_t s = 0; s < n; ++s)
    if (keep[std::size_t(s)]) slots.push_back(s);
  keep_set k(n);
  k.add_unit(slots);
  return k;
}

namespace detail {

inline std::span<const token> unit_tokens(std::span<const token> tokens, std::int64_t unit, std::int64_t rows,
                                          std::int64_t cols) {
  if (std::int64_t(tokens.size()) == cols) return tokens;
  INFKV_REQUIRE(std::int64_t(tokens.size()) == rows * cols, "tokens.size()", tokens.size(), "must be the slot count (",
                cols, ") or one list per unit (", rows, " x ", cols, ")");
  return tokens.subspan(std::size_t(unit * cols), std::size_t(cols));
}

}  // namespace detail

/// Per row of `scores`, keeps `capacities[r]` slots: the first `sinks` and last `recent` by
/// position, then the highest scores. `tokens` holds one entry per slot, shared by all rows, or
/// rows x cols entries (one list per unit). NaN scores are an error. O(rows * cols log cols).
inline keep_set select_top(const score_matrix& scores, std::span<const token> tokens,
                           std::span<const std::int64_t> capacities, std::int64_t sinks, std::int64_t recent) {
  check_scores(scores);
  INFKV_REQUIRE(std::int64_t(capacities.size()) == scores.rows, "capacities.size()", capacities.size(),
                "must equal scores.rows (", scores.rows, ")");
  const std::int64_t n = scores.cols;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n)), cand(order.size()), out(order.size());
  keep_set k(n);
  for (std::int64_t r = 0; r < scores.rows; ++r) {
    const auto cap = capacities[std::size_t(r)];
    INFKV_REQUIRE(cap >= sinks + recent || cap >= n, "capacities[" + std::to_string(r) + "]", cap,
                  "cannot hold sinks (", sinks, ") + recent (", recent, ")");
    const auto t = detail::unit_tokens(tokens, r, scores.rows, n);
    if (r == 0 || t.data() != tokens.data()) {
      validate_tokens(t, n);
      time_order_into(t, order.data());
    }
    const auto m =
        detail::select_row_into(scores.row(r).data(), t, order.data(), cap, sinks, recent, cand.data(), out.data());
    k.add_unit({out.data(), std::size_t(m)});
  }
  return k;
}

/// Per row of `scores`, keeps `b.keep_count(cols)` slots (see above).
inline keep_set select_top(const score_matrix& scores, std::span<const token> tokens, const budget& b) {
  const std::vector<std::int64_t> caps(static_cast<std::size_t>(scores.rows), b.keep_count(scores.cols));
  return select_top(scores, tokens, caps, b.sinks, b.recent);
}

/// Applies `bias` to every row of `s` (allocating its scratch).
inline void apply_bias(const attention_bias& bias, score_matrix& s, std::span<const token> tokens) {
  bias.validate();
  if (bias.beta == 0.0 || s.cols == 0) return;
  validate_tokens(tokens, s.cols);
  const auto order = time_order(tokens);
  std::vector<double> when(tokens.size());
  detail::apply_bias(bias, s.view(), tokens, order.data(), when.data());
}

/// AdaKV's capacities per row of `scores` (KV heads), adding up to rows x b.keep_count(cols).
inline std::vector<std::int64_t> allocate(const adakv& a, const score_matrix& scores, std::span<const token> tokens,
                                          const budget& b) {
  a.validate();
  check_scores(scores);
  validate_tokens(tokens, scores.cols);
  const std::int64_t n = scores.cols, cap = b.keep_count(n), rows = scores.rows;
  std::vector<std::int64_t> out(static_cast<std::size_t>(rows), n);
  if (cap >= n) return out;
  const auto order = time_order(tokens);
  std::vector<std::int64_t> scratch(static_cast<std::size_t>(adakv::scratch_size(rows, n)));
  detail::allocate_into(a, scores.view(), order.data(), b, cap, scratch, out.data());
  return out;
}
}  // namespace infkv::cpu
