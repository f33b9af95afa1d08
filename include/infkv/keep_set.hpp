// infkv: the result of a selection: per decision unit, the sorted slots to keep; and its
// conversion to position runs [p0, p1) for engines that remove by position.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "tokens.hpp"

namespace infkv {

/// Half-open range of positions [begin, end).
struct position_run {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  friend bool operator==(const position_run&, const position_run&) = default;
};

/// Non-owning keep set in CSR form: unit u keeps slots[offsets[u] .. offsets[u + 1]), strictly
/// increasing, within [0, n_slots). What the pipeline writes (`keep_view`) and compaction reads
/// (`const_keep_view`, to which a keep_view converts); kernels take it by value.
template <class T>
struct basic_keep_view {
  T* slots = nullptr;    ///< [offsets[n_units]]
  T* offsets = nullptr;  ///< [n_units + 1], offsets[0] = 0
  std::int64_t n_units = 0;
  std::int64_t n_slots = 0;

  INFKV_HOST_DEVICE std::int64_t size(std::int64_t u) const { return offsets[u + 1] - offsets[u]; }
  INFKV_HOST_DEVICE T* unit(std::int64_t u) const { return slots + offsets[u]; }
  INFKV_HOST_DEVICE constexpr operator detail::read_only_view<std::is_const_v<T>, basic_keep_view<const std::int64_t>>()
      const {
    return {slots, offsets, n_units, n_slots};
  }
};
using keep_view = basic_keep_view<std::int64_t>;
using const_keep_view = basic_keep_view<const std::int64_t>;

/// Unit u of a host keep view as a span.
inline std::span<const std::int64_t> unit_span(const const_keep_view& v, std::int64_t u) {
  return {v.unit(u), std::size_t(v.size(u))};
}

/// True when every unit of a host keep view keeps the same slots (a per-token decision).
inline bool uniform(const const_keep_view& v) {
  for (std::int64_t u = 1; u < v.n_units; ++u)
    if (!std::ranges::equal(unit_span(v, u), unit_span(v, 0))) return false;
  return true;
}

/// Checks a host keep view: at least one unit, offsets from 0 and non-decreasing, every unit's
/// slots strictly increasing within [0, n_slots); names the first entry that is not. O(kept).
inline void validate(const const_keep_view& v, const char* name = "keep") {
  const std::string n(name);
  INFKV_REQUIRE(v.n_units >= 1, n + ".n_units", v.n_units, "must be >= 1");
  INFKV_REQUIRE(v.n_slots >= 0, n + ".n_slots", v.n_slots, "must be >= 0");
  INFKV_REQUIRE(v.offsets != nullptr && (v.slots != nullptr || v.offsets[v.n_units] == 0), n + ".offsets", "null",
                "a keep view needs its offsets and slots");
  INFKV_REQUIRE(v.offsets[0] == 0, n + ".offsets[0]", v.offsets[0], "must be 0");
  for (std::int64_t u = 0; u < v.n_units; ++u) {
    INFKV_REQUIRE(v.size(u) >= 0, n + ".offsets[" + std::to_string(u + 1) + "]", v.offsets[u + 1],
                  "must not be below offsets[", u, "] = ", v.offsets[u]);
    for (std::int64_t i = 0; i < v.size(u); ++i) {
      const std::int64_t s = v.unit(u)[i];
      INFKV_REQUIRE(s >= 0 && s < v.n_slots && (i == 0 || s > v.unit(u)[i - 1]),
                    n + ".unit(" + std::to_string(u) + ")[" + std::to_string(i) + "]", s,
                    "slots must be strictly increasing within [0, n_slots = ", v.n_slots, ")");
    }
  }
}

/// Slots kept per decision unit (a KV head, a layer, or the whole token), in CSR form.
/// Each unit's slots are strictly increasing and in [0, n_slots).
class keep_set {
 public:
  keep_set() = default;
  explicit keep_set(std::int64_t n_slots) : n_slots_(n_slots) {
    INFKV_REQUIRE(n_slots >= 0, "n_slots", n_slots, "must be >= 0");
  }

  /// Every slot kept, for `n_units` units.
  static keep_set all(std::int64_t n_slots, std::int64_t n_units = 1) {
    keep_set k(n_slots);
    std::vector<std::int64_t> s(static_cast<std::size_t>(n_slots));
    for (std::int64_t i = 0; i < n_slots; ++i) s[std::size_t(i)] = i;
    for (std::int64_t u = 0; u < n_units; ++u) k.add_unit(s);
    return k;
  }

  /// Copies a view's units, checking each (a pipeline's output, for instance).
  static keep_set from_view(const const_keep_view& v) {
    keep_set k(v.n_slots);
    INFKV_REQUIRE(v.n_units >= 0, "keep.n_units", v.n_units, "must be >= 0");
    k.slots_.reserve(std::size_t(v.n_units == 0 ? 0 : v.offsets[v.n_units]));
    for (std::int64_t u = 0; u < v.n_units; ++u) {
      INFKV_REQUIRE(v.size(u) >= 0, "keep.offsets[" + std::to_string(u + 1) + "]", v.offsets[u + 1],
                    "must not be below offsets[", u, "] = ", v.offsets[u]);
      k.add_unit({v.unit(u), std::size_t(v.size(u))});
    }
    return k;
  }
  /// A read-only view of the storage (also implicitly: a keep set goes wherever a view does).
  const_keep_view view() const { return {slots_.data(), offsets_.data(), n_units(), n_slots_}; }
  operator const_keep_view() const { return view(); }

  /// Appends a unit; `slots` must be strictly increasing and within [0, n_slots).
  void add_unit(std::span<const std::int64_t> slots) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      INFKV_REQUIRE(slots[i] >= 0 && slots[i] < n_slots_, "slots[" + std::to_string(i) + "]", slots[i],
                    "must be in [0, n_slots = ", n_slots_, ")");
      if (i)
        INFKV_REQUIRE(slots[i] > slots[i - 1], "slots[" + std::to_string(i) + "]", slots[i],
                      "must be greater than the previous slot ", slots[i - 1]);
    }
    slots_.insert(slots_.end(), slots.begin(), slots.end());
    offsets_.push_back(std::int64_t(slots_.size()));
  }

  std::int64_t n_slots() const { return n_slots_; }
  std::int64_t n_units() const { return std::int64_t(offsets_.size()) - 1; }
  std::int64_t size(std::int64_t u) const { return offsets_[std::size_t(u + 1)] - offsets_[std::size_t(u)]; }
  std::span<const std::int64_t> unit(std::int64_t u) const {
    INFKV_REQUIRE(u >= 0 && u < n_units(), "unit", u, "must be in [0, n_units = ", n_units(), ")");
    return {slots_.data() + offsets_[std::size_t(u)], std::size_t(size(u))};
  }
  /// True when every unit keeps the same slots (a per-token decision).
  bool uniform() const { return infkv::uniform(view()); }
  /// Per-slot flags of unit u.
  std::vector<bool> mask(std::int64_t u = 0) const {
    std::vector<bool> m(static_cast<std::size_t>(n_slots_), false);
    for (auto s : unit(u)) m[std::size_t(s)] = true;
    return m;
  }

  /// Runs of positions covering the kept (keep = true) or evicted (false) slots of unit u, in
  /// time order, maximal: consecutive slots in time order with the same fate share one run (a
  /// run may span positions that no slot holds). Throws when one position has slots of both fates.
  std::vector<position_run> runs(std::span<const token> tokens, bool keep, std::int64_t u = 0) const {
    validate_tokens(tokens, n_slots_);
    const auto m = mask(u);
    std::vector<position_run> out;
    bool open = false;
    const auto order = time_order(tokens);
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto s = std::size_t(order[i]);
      if (i && tokens[s].pos == tokens[std::size_t(order[i - 1])].pos && m[s] != m[std::size_t(order[i - 1])])
        infkv::fail("infkv: tokens: position ", tokens[s].pos,
                    " is held by a kept and an evicted slot; it cannot be expressed as position runs");
      if (m[s] == keep) {
        if (open && out.back().end > tokens[s].pos) continue;  // same position again
        if (open)
          out.back().end = tokens[s].pos + 1;
        else
          out.push_back({tokens[s].pos, tokens[s].pos + 1});
        open = true;
      } else {
        open = false;
      }
    }
    return out;
  }
  std::vector<position_run> kept_runs(std::span<const token> t, std::int64_t u = 0) const { return runs(t, true, u); }
  std::vector<position_run> evicted_runs(std::span<const token> t, std::int64_t u = 0) const {
    return runs(t, false, u);
  }

  /// One unit keeping the slots whose positions fall in one of `kept` (inverse of kept_runs).
  static keep_set from_runs(std::span<const position_run> kept, std::span<const token> tokens) {
    for (std::size_t i = 0; i < kept.size(); ++i)
      INFKV_REQUIRE(kept[i].begin < kept[i].end, "kept[" + std::to_string(i) + "].end", kept[i].end,
                    "must exceed begin = ", kept[i].begin);
    keep_set k(std::int64_t(tokens.size()));
    std::vector<std::int64_t> s;
    for (std::size_t i = 0; i < tokens.size(); ++i)
      if (std::ranges::any_of(kept,
                              [&](const position_run& r) { return tokens[i].pos >= r.begin && tokens[i].pos < r.end; }))
        s.push_back(std::int64_t(i));
    k.add_unit(s);
    return k;
  }

  friend bool operator==(const keep_set&, const keep_set&) = default;

 private:
  std::int64_t n_slots_ = 0;
  std::vector<std::int64_t> offsets_{0};
  std::vector<std::int64_t> slots_;
};

}  // namespace infkv
