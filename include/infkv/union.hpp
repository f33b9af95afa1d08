// infkv: the union of two policies' selections (e.g. attention saddles and KeyDiff's outlier
// keys): after the protected tokens, a share of the room goes to the first policy's best tokens and
// the rest is filled by the second's ranking, skipping what is already kept.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "budget.hpp"
#include "error.hpp"
#include "keep_set.hpp"
#include "policy.hpp"
#include "select.hpp"
#include "tokens.hpp"

namespace infkv {

/// Two policies whose selections are united: `share` of the slots left after the protected ones
/// go to `first`'s best (rounded to nearest), the others to `second`'s best among the rest. Not a
/// `policy` itself (it has two score sources): the CPU backend's `cpu::select` and the llama.cpp
/// session take it.
template <policy A, policy B>
struct union_of {
  A first{};
  B second{};
  double share = 0.5;  ///< of the unprotected room, kept by `first`'s scores; in [0, 1]

  void validate() const {
    first.validate();
    second.validate();
    INFKV_REQUIRE(std::isfinite(share) && share >= 0.0 && share <= 1.0, "union_of.share", share, "must be in [0, 1]");
  }
};

template <class P>
inline constexpr bool is_union = false;
template <policy A, policy B>
inline constexpr bool is_union<union_of<A, B>> = true;

/// The budget a union keeps given `b`: both policies' protections.
template <policy A, policy B>
budget protect(const union_of<A, B>& u, const budget& b) {
  return protect(u.second, protect(u.first, b));
}

/// What an engine must capture for both policies of `u` (checks `u` first).
template <policy A, policy B>
capture_needs capture_needs_of(const union_of<A, B>& u) {
  u.validate();
  const capture_needs a = u.first.spec().needs(), b = u.second.spec().needs();
  return {.keys = a.keys || b.keys,
          .values = a.values || b.values,
          .queries = std::max(a.queries, b.queries),
          .attention = a.attention || b.attention,
          .rope = a.rope || b.rope};
}

/// Keeps `cap` of n slots: the first `sinks` and last `recent` in time order, then
/// round(share * room) slots by score `a` (room: cap minus the protected), then the rest by score
/// `b` among the slots not yet kept. Each ranking in keep_before's order (higher score, then the
/// newer position, then the lower slot). cap >= n keeps everything. Raises on NaN, on scores of
/// another length, and naming `cap` when it cannot hold the protected slots. O(n log n).
inline keep_set select_union(std::span<const float> a, std::span<const float> b, std::span<const token> tokens,
                             std::int64_t cap, std::int64_t sinks, std::int64_t recent, double share) {
  const auto n = std::int64_t(tokens.size());
  validate_tokens(tokens, n);
  INFKV_REQUIRE(std::int64_t(a.size()) == n && std::int64_t(b.size()) == n, "scores.size()", a.size(),
                "both score rows must have tokens.size() = ", n, " entries (the second has ", b.size(), ")");
  INFKV_REQUIRE(std::isfinite(share) && share >= 0.0 && share <= 1.0, "share", share, "must be in [0, 1]");
  INFKV_REQUIRE(sinks >= 0 && recent >= 0, "sinks", sinks, "sinks and recent (", recent, ") must be >= 0");
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isnan(a[std::size_t(i)]) || std::isnan(b[std::size_t(i)])) [[unlikely]]
      detail::fail("infkv: score[", i, "] = nan: scores must not be NaN");
  keep_set k(n);
  std::vector<std::int64_t> kept;
  if (cap >= n) {
    for (std::int64_t s = 0; s < n; ++s) kept.push_back(s);
    k.add_unit(kept);
    return k;
  }
  INFKV_REQUIRE(cap >= sinks + recent, "cap", cap, "cannot hold sinks (", sinks, ") + recent (", recent, ")");
  const auto order = time_order(tokens);
  std::vector<bool> in(static_cast<std::size_t>(n), false);
  std::vector<std::int64_t> cand;
  for (std::int64_t i = 0; i < n; ++i)
    if (i < sinks || i >= n - recent)
      in[std::size_t(order[std::size_t(i)])] = true;
    else
      cand.push_back(order[std::size_t(i)]);
  const std::int64_t room = cap - (n - std::int64_t(cand.size()));
  const auto by = [&](std::span<const float> s) {
    return [&, s](std::int64_t x, std::int64_t y) {
      return keep_before(s[std::size_t(x)], tokens[std::size_t(x)].pos, x, s[std::size_t(y)],
                         tokens[std::size_t(y)].pos, y);
    };
  };
  const auto take_a = std::min<std::int64_t>(room, std::llround(share * double(room)));
  std::sort(cand.begin(), cand.end(), by(a));
  for (std::int64_t i = 0; i < take_a; ++i) in[std::size_t(cand[std::size_t(i)])] = true;
  std::sort(cand.begin(), cand.end(), by(b));
  std::int64_t left = room - take_a;
  for (std::size_t i = 0; i < cand.size() && left > 0; ++i)
    if (!in[std::size_t(cand[i])]) in[std::size_t(cand[i])] = true, --left;
  for (std::int64_t s = 0; s < n; ++s)
    if (in[std::size_t(s)]) kept.push_back(s);
  k.add_unit(kept);
  return k;
}

}  // namespace infkv
