// infkv CPU backend: host conveniences over score matrices that own their results: the top-k
// of every row (select_top), selection by whole positions (select_whole_positions) and by
// whole segments first (select_whole_segments), the
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

namespace detail {

/// Checks one row's scores against its tokens and the budget's counts (select_whole_*).
inline void check_row(std::span<const float> score, std::span<const token> tokens, std::int64_t cap, std::int64_t sinks,
                      std::int64_t recent) {
  const auto n = std::int64_t(tokens.size());
  validate_tokens(tokens, n);
  INFKV_REQUIRE(std::int64_t(score.size()) == n, "score.size()", score.size(), "must equal tokens.size() (", n, ")");
  INFKV_REQUIRE(cap >= 0 && sinks >= 0 && recent >= 0, "cap", cap, "cap, sinks (", sinks, ") and recent (", recent,
                ") must be >= 0");
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isnan(score[std::size_t(i)])) [[unlikely]]
      infkv::fail("infkv: score[", i, "] = nan: scores must not be NaN");
}

/// A group of slots kept or dropped together: its members, their mean score, its newest position.
struct slot_group {
  std::vector<std::int64_t> slots;
  double mean = 0;
  std::int64_t newest = 0;
};

/// Takes whole groups of `groups` in order of their mean score (equal means: the newer group
/// first, then the earlier in `groups`), each when it fits the room left to `cap` and skipped
/// otherwise; marks them in `keep` and counts them in `kept`.
inline void take_whole_groups(const std::vector<slot_group>& groups, std::int64_t cap, std::vector<bool>& keep,
                              std::int64_t& kept) {
  std::vector<std::size_t> order(groups.size());
  for (std::size_t g = 0; g < order.size(); ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (groups[a].mean != groups[b].mean) return groups[a].mean > groups[b].mean;
    return groups[a].newest > groups[b].newest;
  });
  for (const auto g : order) {
    const auto size = std::int64_t(groups[g].slots.size());
    if (kept + size > cap) continue;
    for (const auto s : groups[g].slots) keep[std::size_t(s)] = true;
    kept += size;
  }
}

/// The slots marked in `keep` as one unit of a keep set over n slots.
inline keep_set one_unit(const std::vector<bool>& keep, std::int64_t kept) {
  std::vector<std::int64_t> slots;
  slots.reserve(std::size_t(kept));
  for (std::size_t s = 0; s < keep.size(); ++s)
    if (keep[s]) slots.push_back(std::int64_t(s));
  keep_set k(std::int64_t(keep.size()));
  k.add_unit(slots);
  return k;
}

}  // namespace detail

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
  detail::check_row(score, tokens, cap, sinks, recent);
  const auto n = std::int64_t(tokens.size());
  // Groups: runs of equal positions in time order.
  const auto order = time_order(tokens);
  std::vector<bool> keep(static_cast<std::size_t>(n), false);
  std::int64_t kept = 0;
  std::vector<detail::slot_group> cand;
  for (std::int64_t i = 0; i < n;) {
    detail::slot_group g;
    g.newest = tokens[std::size_t(order[i])].pos;
    double sum = 0;
    std::int64_t j = i;
    for (; j < n && tokens[std::size_t(order[j])].pos == g.newest; ++j) {
      g.slots.push_back(order[j]);
      sum += double(score[std::size_t(order[j])]);
    }
    g.mean = sum / double(j - i);
    if (i < sinks || j > n - recent || cap >= n) {
      for (const auto s : g.slots) keep[std::size_t(s)] = true;
      kept += j - i;
    } else {
      cand.push_back(std::move(g));
    }
    i = j;
  }
  INFKV_REQUIRE(kept <= cap || cap >= n, "cap", cap, "cannot hold the protected slots' whole positions: the first ",
                sinks, " and last ", recent, " slots lie in positions held by ", kept, " slots");
  detail::take_whole_groups(cand, cap, keep, kept);
  return detail::one_unit(keep, kept);
}

/// Keeps `min(cap, n)` of one row's n slots, whole segments first (a sentence or line of text,
/// an image tile, a frame group: token::segment): the first `sinks` and the last `recent` slots
/// in time order, then, of the other slots grouped by segment, whole groups in order of their
/// mean score (double; equal means go to the newer segment), each taken when it fits the room
/// left and skipped otherwise, then the room left token by token (higher score, then newer
/// position, then lower slot), so a segment larger than the room is kept in part. With one slot
/// per segment this keeps exactly what select_top keeps. Raises naming `cap` when it cannot hold
/// sinks + recent, and on a NaN score. O(n log n).
inline keep_set select_whole_segments(std::span<const float> score, std::span<const token> tokens, std::int64_t cap,
                                      std::int64_t sinks, std::int64_t recent) {
  detail::check_row(score, tokens, cap, sinks, recent);
  const auto n = std::int64_t(tokens.size());
  INFKV_REQUIRE(cap >= sinks + recent || cap >= n, "cap", cap, "cannot hold sinks (", sinks, ") + recent (", recent,
                ")");
  std::vector<bool> keep(static_cast<std::size_t>(n), cap >= n);
  if (cap >= n) return detail::one_unit(keep, n);
  const auto order = time_order(tokens);
  std::int64_t kept = 0;
  std::vector<std::int64_t> rest;  // unprotected slots, by segment then time
  for (std::int64_t i = 0; i < n; ++i) {
    if (i < sinks || i >= n - recent) {
      keep[std::size_t(order[i])] = true;
      ++kept;
    } else {
      rest.push_back(order[i]);
    }
  }
  std::stable_sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t b) {
    return tokens[std::size_t(a)].segment < tokens[std::size_t(b)].segment;
  });
  std::vector<detail::slot_group> groups;
  for (std::size_t i = 0; i < rest.size();) {
    detail::slot_group g;
    double sum = 0;
    std::size_t j = i;
    for (; j < rest.size() && tokens[std::size_t(rest[j])].segment == tokens[std::size_t(rest[i])].segment; ++j) {
      g.slots.push_back(rest[j]);
      sum += double(score[std::size_t(rest[j])]);
      g.newest = std::max(g.newest, tokens[std::size_t(rest[j])].pos);
    }
    g.mean = sum / double(j - i);
    groups.push_back(std::move(g));
    i = j;
  }
  detail::take_whole_groups(groups, cap, keep, kept);
  std::erase_if(rest, [&](std::int64_t s) { return keep[std::size_t(s)]; });
  std::stable_sort(rest.begin(), rest.end(), [&](std::int64_t a, std::int64_t b) {
    const float x = score[std::size_t(a)], y = score[std::size_t(b)];
    if (x != y) return x > y;
    if (tokens[std::size_t(a)].pos != tokens[std::size_t(b)].pos)
      return tokens[std::size_t(a)].pos > tokens[std::size_t(b)].pos;
    return a < b;
  });
  for (std::size_t i = 0; i < rest.size() && kept < cap; ++i, ++kept) keep[std::size_t(rest[i])] = true;
  return detail::one_unit(keep, kept);
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
