// infkv: the top-k selector: keep the protected sinks and recent tokens, then the highest
// scores, in one total order that every backend honours exactly (see `keep_before`).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "budget.hpp"
#include "config.hpp"
#include "keep_set.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

/// The total order of selection: slot a is kept before slot b when its score is higher; equal
/// scores (-0 and +0 are equal) go to the newer position, then to the lower slot. NaN never
/// reaches it (selection raises first). Every backend keeps exactly the set this order gives.
INFKV_HOST_DEVICE inline bool keep_before(float sa, std::int64_t pos_a, std::int64_t slot_a, float sb,
                                          std::int64_t pos_b, std::int64_t slot_b) {
  if (sa != sb) return sa > sb;
  if (pos_a != pos_b) return pos_a > pos_b;
  return slot_a < slot_b;
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
    const auto m = select_row_into(scores.row(r).data(), t, order.data(), cap, sinks, recent, cand.data(), out.data());
    k.add_unit({out.data(), std::size_t(m)});
  }
  return k;
}

/// Per row of `scores`, keeps `b.keep_count(cols)` slots (see above).
inline keep_set select_top(const score_matrix& scores, std::span<const token> tokens, const budget& b) {
  const std::vector<std::int64_t> caps(static_cast<std::size_t>(scores.rows), b.keep_count(scores.cols));
  return select_top(scores, tokens, caps, b.sinks, b.recent);
}

}  // namespace infkv
