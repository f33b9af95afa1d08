// infkv: the union of two policies' selections (e.g. attention saddles and KeyDiff's outlier
// keys): after the protected tokens, a share of the room goes to the first policy's best tokens and
// the rest is filled by the second's ranking, skipping what is already kept. A policy like the
// others: its spec carries both scores, and make_plan / run select with both on every backend.
#pragma once

#include <algorithm>
#include <cmath>
#include <string_view>

#include "error.hpp"
#include "policy.hpp"

namespace infkv {

/// The spec of the union of two policies' specs `a` and `b` (each a single score): `a`'s score
/// first, `b`'s second, both protections, `share` of the room by the first; one decision per layer
/// or token by nature. For unions whose parts are known only at run time (the Python module).
inline policy_spec unite(const policy_spec& a, const policy_spec& b, double share) {
  INFKV_REQUIRE(!a.second && !b.second, "union_of.first", a.second ? a.name : b.name,
                "a union unites two single policies");
  return {.name = "union_of",
          .score = a.score,
          .protect_sinks = std::max(a.protect_sinks, b.protect_sinks),
          .protect_recent = std::max(a.protect_recent, b.protect_recent),
          .natural = granularity::per_layer,
          .second = b.score,
          .share = share};
}

/// Two policies whose selections are united: `share` of the slots left after the protected ones
/// go to `first`'s best (rounded to nearest), the others to `second`'s best among the rest. Both
/// policies' protections apply; each policy's rows are combined into one decision (per layer or
/// per token: the union has no per-head granularity). The run marks the first's picks +infinity in
/// the second's scores, so a second score of +infinity (no source gives one from finite inputs)
/// would rank with them.
template <policy A, policy B>
struct union_of {
  static constexpr std::string_view name = "union_of";

  A first{};
  B second{};
  double share = 0.5;  ///< of the unprotected room, kept by `first`'s scores; in [0, 1]

  void validate() const {
    first.validate();
    second.validate();
    INFKV_REQUIRE(std::isfinite(share) && share >= 0.0 && share <= 1.0, "union_of.share", share, "must be in [0, 1]");
  }
  policy_spec spec() const { return unite(first.spec(), second.spec(), share); }
};

}  // namespace infkv
