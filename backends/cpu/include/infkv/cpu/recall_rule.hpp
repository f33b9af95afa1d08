// infkv CPU backend: recall's displacement rule (cpu/recall.hpp runs it): given one decision row
// of scores over a cache's slots and the candidate pages' slots after them, which candidates come
// back and which cached slots they displace. A pure function, tested against its definition; and
// the types a recall takes and returns (recall_options, recall_result).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <infkv/budget.hpp>
#include <infkv/error.hpp>
#include <infkv/select.hpp>
#include <infkv/tokens.hpp>

namespace infkv::cpu {

/// A candidate page's slots [begin, end) among the scored slots (after the cache's);
/// `joins_previous`: the page follows the previous candidate's with no archived page between
/// (their positions adjoin when the archive is written through).
struct recall_candidate {
  std::int32_t page = 0;
  std::int64_t begin = 0, end = 0;
  bool joins_previous = false;
};

/// The displacement rule, on one decision row `scores` over the cache's `n_cache` slots and the
/// candidates' slots after them (tokens alike). The cache's first `protect.sinks` and last
/// `protect.recent` slots in time order are never displaced; the others are displaced worst
/// first (the reverse of keep_before: lowest score, then oldest position, then highest slot).
/// Candidates are taken by their mean score, highest first (ties: the newer first position, then
/// the lower page id); a candidate of n slots comes back when it fits in `budget_tokens` and in
/// the displaceable slots left and the sum of its scores exceeds the sum of the n worst slots
/// left (strictly; sums in double), which it then displaces. A candidate that comes back brings
/// its `neighbours` nearest joined candidates on each side (nearest first, the next before the
/// previous) that have not come back, each as it fits, displacing the worst slots left without
/// a score test: a question's queries find the words a statement shares with it, not always the
/// answer beside them. Writes the chosen candidates' indices, in decision order, to `chosen` and
/// the displaced slots, increasing, to `displaced`; returns their counts. `work` holds
/// 2 * n_cache + 2 * candidates entries. Allocates nothing.
inline std::pair<std::int64_t, std::int64_t> decide_recall(
    std::span<const float> scores, std::span<const token> tokens, std::int64_t n_cache,
    std::span<const recall_candidate> cands, const budget& protect, std::int64_t budget_tokens, std::int32_t neighbours,
    std::span<std::int64_t> work, std::span<std::int64_t> chosen, std::span<std::int64_t> displaced) {
  const std::int64_t n = std::int64_t(scores.size()), nc = std::int64_t(cands.size());
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n, "tokens.size()", tokens.size(), "must equal scores.size() (", n, ")");
  INFKV_REQUIRE(n_cache >= 0 && n_cache <= n, "n_cache", n_cache, "must be in [0, ", n, "]");
  INFKV_REQUIRE(budget_tokens >= 0, "budget_tokens", budget_tokens, "must be >= 0");
  INFKV_REQUIRE(neighbours >= 0, "neighbours", neighbours, "must be >= 0");
  INFKV_REQUIRE(std::int64_t(work.size()) >= 2 * n_cache + 2 * nc, "work.size()", work.size(),
                "must be >= ", 2 * n_cache + 2 * nc);
  INFKV_REQUIRE(std::int64_t(chosen.size()) >= nc, "chosen.size()", chosen.size(), "must be >= ", nc);
  for (std::int64_t i = 0; i < n; ++i)
    INFKV_REQUIRE(!std::isnan(scores[std::size_t(i)]), "scores[" + std::to_string(i) + "]", "nan", "must not be NaN");
  std::int64_t prev = n_cache;
  for (std::int64_t c = 0; c < nc; ++c) {
    const auto& x = cands[std::size_t(c)];
    INFKV_REQUIRE(x.begin == prev && x.end > x.begin && x.end <= n, "cands[" + std::to_string(c) + "].begin", x.begin,
                  "candidates tile the slots after the cache in order: expected begin ", prev, " < end <= ", n,
                  "; end = ", x.end);
    prev = x.end;
  }
  std::int64_t* const order = work.data();
  std::int64_t* const worst = order + n_cache;
  std::int64_t* const corder = worst + n_cache;
  std::int64_t* const taken = corder + nc;
  time_order_into(tokens.first(std::size_t(n_cache)), order);
  std::int64_t nd = 0;
  const std::int64_t sinks = std::min(protect.sinks, n_cache), recent = std::min(protect.recent, n_cache - sinks);
  for (std::int64_t i = sinks; i < n_cache - recent; ++i) worst[nd++] = order[i];
  const auto sc = [&](std::int64_t j) { return scores[std::size_t(j)]; };
  const auto pos = [&](std::int64_t j) { return tokens[std::size_t(j)].pos; };
  std::sort(worst, worst + nd,
            [&](std::int64_t a, std::int64_t b) { return keep_before(sc(b), pos(b), b, sc(a), pos(a), a); });
  const auto sum = [&](std::int64_t b, std::int64_t e, auto at) {
    double t = 0.0;
    for (std::int64_t j = b; j < e; ++j) t += double(sc(at(j)));
    return t;
  };
  const auto mean = [&](std::int64_t c) {
    const auto& x = cands[std::size_t(c)];
    return sum(x.begin, x.end, [](std::int64_t j) { return j; }) / double(x.end - x.begin);
  };
  for (std::int64_t c = 0; c < nc; ++c) corder[c] = c;
  std::sort(corder, corder + nc, [&](std::int64_t a, std::int64_t b) {
    const double ma = mean(a), mb = mean(b);
    if (ma != mb) return ma > mb;
    const auto pa = pos(cands[std::size_t(a)].begin), pb = pos(cands[std::size_t(b)].begin);
    if (pa != pb) return pa > pb;
    return cands[std::size_t(a)].page < cands[std::size_t(b)].page;
  });
  std::fill(taken, taken + nc, std::int64_t{0});
  std::int64_t used = 0, k = 0, nch = 0;
  const auto fits = [&](std::int64_t c) {
    const std::int64_t m = cands[std::size_t(c)].end - cands[std::size_t(c)].begin;
    return used + m <= budget_tokens && k + m <= nd;
  };
  const auto take = [&](std::int64_t c) {
    const std::int64_t m = cands[std::size_t(c)].end - cands[std::size_t(c)].begin;
    taken[c] = 1, chosen[std::size_t(nch++)] = c, k += m, used += m;
  };
  for (std::int64_t i = 0; i < nc; ++i) {
    const std::int64_t c = corder[i];
    const auto& x = cands[std::size_t(c)];
    const std::int64_t m = x.end - x.begin;
    if (taken[c] || !fits(c)) continue;
    if (!(sum(x.begin, x.end, [](std::int64_t j) { return j; }) >
          sum(k, k + m, [&](std::int64_t j) { return worst[j]; })))
      continue;
    take(c);
    bool next = true, prev = true;  // the chains of joined candidates on each side are unbroken
    for (std::int64_t step = 1; step <= neighbours && (next || prev); ++step) {
      next = next && c + step < nc && cands[std::size_t(c + step)].joins_previous;
      prev = prev && c - step >= 0 && cands[std::size_t(c - step + 1)].joins_previous;
      if (next && !taken[c + step] && fits(c + step)) take(c + step);
      if (prev && !taken[c - step] && fits(c - step)) take(c - step);
    }
  }
  INFKV_REQUIRE(std::int64_t(displaced.size()) >= k, "displaced.size()", displaced.size(), "must be >= ", k);
  std::copy(worst, worst + k, displaced.begin());
  std::sort(displaced.begin(), displaced.begin() + k);
  return {nch, k};
}

/// One archived token: its page and its index among the page's tokens.
struct archived_token {
  std::int32_t page = 0, index = 0;
};

/// What a recall decided: the pages chosen (decision order), the archived tokens that come back
/// (their tokens the cache does not hold, page by page in decision order, each page's in time
/// order) and the cache slots they displace (increasing, as many); spans into the recaller, valid
/// until its next call.
struct recall_result {
  std::span<const std::int32_t> pages;
  std::span<const archived_token> recalled;
  std::span<const std::int64_t> displaced;
  std::int64_t tokens = 0;  ///< recalled.size() = displaced.size()
};

struct recall_options {
  std::int64_t budget_tokens = 0;  ///< most slots one recall brings back (>= 1)
  std::int32_t candidates = 32;    ///< at most this many pages scored exactly, the best by their bounds (>= 1)
  /// Score with the policy's attention bias. false: without it (beta 0), since archived pages are
  /// old by definition and a recency bias ranks every one of them below the cache.
  bool recency_bias = true;
  /// A page that comes back brings this many adjoining pages on each side (decide_recall): they
  /// are candidates too, scored beside the others.
  std::int32_t neighbours = 1;
  /// Only pages whose every token lies below this position come back (none: any). The llama.cpp
  /// session sets it on a model with sliding-window layers to the oldest position those layers
  /// can still attend to, so that what comes back is what a full cache holds in every layer.
  std::optional<std::int64_t> below{};
  /// The layers whose scores rank the pages and place them (ascending; a per_token archive's;
  /// empty: every layer). The llama.cpp session sets a sliding-window model's global layers:
  /// its sliding layers never attend to what recall brings back (below).
  std::vector<std::int32_t> layers{};
  /// Position-agnostic ranking (as InfLLM and LiveVLM retrieve). Unset: a candidate is scored
  /// where attention will see it after the recall (keep mode: at its own position; with
  /// rotary_pos: where it lands among the compacted positions). Set: every candidate page is
  /// scored, bound and exact scores alike, as if its first token stood `distance` positions before
  /// the newest cached token (its other tokens at their offsets from the first), so that pages
  /// compete on what they hold and not on how near the question they would land. Where the
  /// recalled tokens go does not change. Needs each scored layer's `rotary`; >= 0.
  std::optional<std::int64_t> distance{};
};

}  // namespace infkv::cpu
