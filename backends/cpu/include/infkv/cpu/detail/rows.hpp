// infkv CPU backend: the finishing and selection algorithms over rows of scores that the
// backend's primitives run (backend.hpp): reductions, pooling along time, the attention bias,
// AdaKV's allocation and one row's top-k. In place, in the caller's scratch; nothing allocated.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>

#include <infkv/allocation.hpp>
#include <infkv/bias.hpp>
#include <infkv/scores.hpp>
#include <infkv/select.hpp>
#include <infkv/tokens.hpp>

namespace infkv::cpu::detail {

/// Folds every row of `s` into `acc` (one row of s.cols): sum or max (mean is a sum divided by
/// the row count at the end, see `finish_reduction`). `first` starts the fold.
inline void reduce_into(score_view acc, const_score_view s, reduction r, bool first) {
  float* a = acc.row(0);
  if (first) std::fill(a, a + s.cols, r == reduction::max ? -std::numeric_limits<float>::infinity() : 0.f);
  for (std::int64_t row = 0; row < s.rows; ++row) {
    const float* x = s.row(row);
    for (std::int64_t c = 0; c < s.cols; ++c) a[c] = r == reduction::max ? std::max(a[c], x[c]) : a[c] + x[c];
  }
}

/// Divides a mean reduction's sum by the number of rows folded.
inline void finish_reduction(score_view acc, reduction r, std::int64_t rows_folded) {
  if (r != reduction::mean || rows_folded == 0) return;
  for (std::int64_t c = 0; c < acc.cols; ++c) acc(0, c) /= float(rows_folded);
}

/// Pools one row along time, as SnapKV's reference pools `attn[..., :-window]`: `order` lists
/// the n slots in time order; the first n - tail of them (the prefix) are pooled with an odd
/// `kernel`, stride 1, padding at the prefix's two ends (zeros for avg and sum, counted by avg;
/// nothing for max). The last `tail` slots (the observation window, which the policy protects)
/// are left as they are (see `fill_tail`). Kernel 1 (or no pooling) leaves the row as it is.
/// `tmp` holds n floats. Allocates nothing.
inline void pool_row(float* row, const std::int64_t* order, std::int64_t n, std::int32_t kernel, pooling kind,
                     std::int64_t tail, float* tmp) {
  const std::int64_t len = n - std::min(tail, n), half = kernel / 2;
  if (kind == pooling::none || kernel == 1 || len == 0) return;  // kernel 1 is the identity
  for (std::int64_t i = 0; i < len; ++i) tmp[i] = row[order[i]];
  for (std::int64_t i = 0; i < len; ++i) {
    float acc = kind == pooling::max ? -std::numeric_limits<float>::infinity() : 0.f;
    for (std::int64_t j = std::max<std::int64_t>(0, i - half); j <= std::min(len - 1, i + half); ++j)
      acc = kind == pooling::max ? std::max(acc, tmp[j]) : acc + tmp[j];
    row[order[i]] = kind == pooling::avg ? acc / float(kernel) : acc;
  }
}

/// Gives the last `tail` slots of a pooled row (in time order) the mean score of the rest. The
/// window is protected, so its scores never decide what is kept; its raw mass, unpooled, would
/// not be comparable with pooled scores, and the mean leaves the row's mean (which the attention
/// bias divides by) that of the pooled slots. No-op when no prefix remains or nothing is left out.
inline void fill_tail(float* row, const std::int64_t* order, std::int64_t n, std::int64_t tail) {
  const std::int64_t len = n - std::min(tail, n);
  if (len == 0 || len == n) return;
  double sum = 0;
  for (std::int64_t i = 0; i < len; ++i) sum += row[order[i]];
  const auto mean = float(sum / double(len));
  for (std::int64_t i = len; i < n; ++i) row[order[i]] = mean;
}

/// Applies `bias` to every row of `s`. `order` lists the slots in time order; `when` holds
/// s.cols doubles of scratch. Allocates nothing.
inline void apply_bias(const attention_bias& bias, score_view s, std::span<const token> tokens,
                       const std::int64_t* order, double* when) {
  if (bias.beta == 0.0 || s.cols == 0) return;
  const auto n = std::int64_t(tokens.size());
  std::int64_t rank = -1;  // ranks: index among the distinct cached positions, oldest = 0
  for (std::int64_t i = 0; i < n; ++i) {
    const token& t = tokens[std::size_t(order[i])];
    if (i == 0 || t.pos != tokens[std::size_t(order[i - 1])].pos) ++rank;
    when[order[i]] = bias.unit == age_unit::ranks       ? double(rank)
                     : bias.unit == age_unit::positions ? double(t.pos)
                                                        : double(t.segment);
  }
  const auto [oldest, newest] = std::minmax_element(when, when + n);
  const double top = *newest, span = *newest - *oldest;
  for (std::int64_t r = 0; r < s.rows; ++r) {
    float* row = s.row(r);
    double mean = 0;
    for (std::int64_t c = 0; c < s.cols; ++c) mean += row[c];
    mean /= double(s.cols);
    const double inv = mean > 0 ? 1.0 / mean : 1.0;
    for (std::int64_t c = 0; c < s.cols; ++c) {
      const double a = span > 0 ? (top - when[c]) / span : 0.0;
      row[c] = float(row[c] * inv + bias.beta * bias.recency(a));
    }
  }
}

/// AdaKV's capacities per row of `s` (KV heads) into `caps`, adding up to rows x `cap` (the budget's
/// keep count, below the slot count): each row keeps sinks + recent, the rest is shared.
/// `order` is the slots' time order; `scratch` holds scratch_size(rows, cols) int64. Allocates
/// nothing. The global top scores are ranked by score, ties to the lower row, then the newer slot.
inline void allocate_into(const adakv& a, const_score_view s, const std::int64_t* order, const budget& b,
                          std::int64_t cap, std::span<std::int64_t> scratch, std::int64_t* caps) {
  a.validate();
  const std::int64_t n = s.cols, rows = s.rows, prot = b.sinks + b.recent, free_each = cap - prot;
  INFKV_REQUIRE(std::int64_t(scratch.size()) >= adakv::scratch_size(rows, n), "scratch.size()", scratch.size(),
                "must be >= ", adakv::scratch_size(rows, n));
  std::int64_t* cand = scratch.data();  // r * n + time rank, unprotected slots only
  std::int64_t nc = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = b.sinks; i < n - b.recent; ++i) cand[nc++] = r * n + i;
  const auto score = [&](std::int64_t c) { return s(c / n, order[c % n]); };
  const std::int64_t total = rows * free_each;
  std::nth_element(cand, cand + total, cand + nc, [&](std::int64_t x, std::int64_t y) {
    const float sx = score(x), sy = score(y);
    if (sx != sy) return sx > sy;
    return x / n != y / n ? x / n < y / n : x % n > y % n;
  });
  auto* wins = reinterpret_cast<double*>(scratch.data() + rows * n);
  std::fill(wins, wins + rows, 0.0);
  for (std::int64_t i = 0; i < total; ++i) wins[cand[i] / n] += 1.0;
  for (std::int64_t r = 0; r < rows; ++r) wins[r] = wins[r] * (1.0 - a.alpha) + a.alpha * double(free_each);
  infkv::detail::round_shares_into({wins, std::size_t(rows)}, total, caps, scratch.data() + rows * n + rows);
  for (std::int64_t r = 0; r < rows; ++r) caps[r] += prot;
}

/// Keeps `cap` of one row's n slots: the first `sinks` and last `recent` in time order (`order`),
/// then the best others by `keep_before`. Writes the kept slots, increasing, to `out[0, min(cap,
/// n))` and returns their count. `cand` holds n int64 of scratch. Allocates nothing.
inline std::int64_t select_row_into(const float* score, std::span<const token> tokens, const std::int64_t* order,
                                    std::int64_t cap, std::int64_t sinks, std::int64_t recent, std::int64_t* cand,
                                    std::int64_t* out) {
  const auto n = std::int64_t(tokens.size());
  if (cap >= n) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = i;
    return n;
  }
  std::int64_t kept = 0, nc = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t s = order[i];
    if (i < sinks || i >= n - recent)
      out[kept++] = s;
    else
      cand[nc++] = s;
  }
  const auto better = [&](std::int64_t a, std::int64_t b) {
    return keep_before(score[a], tokens[std::size_t(a)].pos, a, score[b], tokens[std::size_t(b)].pos, b);
  };
  const std::int64_t take = cap - kept;
  std::nth_element(cand, cand + take, cand + nc, better);
  std::copy(cand, cand + take, out + kept);
  std::sort(out, out + cap);
  return cap;
}

}  // namespace infkv::cpu::detail
