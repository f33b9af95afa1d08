// When to evict. every_step: whenever the cache exceeds its capacity (TOVA, greedy H2O).
// on_overflow: only once `slack` slots past capacity, then back to capacity (amortised).
// block_prefill (Kim & Bae, arXiv 2604.16734, budgeted block-wise prefill): cut the input into
// blocks of at most `block` tokens whose boundaries snap to segment changes (image tiles, video
// frames), evict back to `budget` after each block: the cache never holds more than budget +
// block slots however long the input is. Cost: O(n) to plan.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "error.hpp"
#include "tokens.hpp"

namespace infkv {

struct every_step {
  std::int64_t capacity = 0;
  bool due(std::int64_t n_cached) const { return n_cached > capacity; }
  std::int64_t target(std::int64_t) const { return capacity; }
};

struct on_overflow {
  std::int64_t capacity = 0;
  std::int64_t slack = 0;
  bool due(std::int64_t n_cached) const { return n_cached > capacity + slack; }
  std::int64_t target(std::int64_t) const { return capacity; }
};

/// Index range [begin, end) of one prefill block in the input.
struct block_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  friend bool operator==(const block_range&, const block_range&) = default;
};

struct block_prefill {
  std::int64_t block = 256;              ///< most tokens one block appends
  std::int64_t budget = 1024;            ///< slots kept after each block (M)
  bool snap_to_segments = true;          ///< end blocks where the segment changes, when one does
  bool first_block_fills_budget = true;  ///< the part that fits the budget runs as one forward

  void validate() const {
    INFKV_REQUIRE(block >= 1, "block_prefill.block", block, "must be >= 1");
    INFKV_REQUIRE(budget >= 1, "block_prefill.budget", budget, "must be >= 1");
  }
  bool due(std::int64_t n_cached) const { return n_cached > budget; }
  std::int64_t target(std::int64_t) const { return budget; }
  /// Most slots the cache ever holds: budget + block (the first block may fill the budget).
  std::int64_t peak() const { return budget + block; }

  /// Cuts `input` (in stream order) into blocks. A block ends at the last segment change inside
  /// its `block` tokens (the first: `budget` tokens); a segment longer than that is split.
  std::vector<block_range> plan(std::span<const token> input) const {
    validate();
    const auto n = std::int64_t(input.size());
    std::vector<std::int64_t> last_boundary(static_cast<std::size_t>(n + 1), 0);  // largest boundary <= k
    for (std::int64_t k = 1; k <= n; ++k) {
      const bool boundary = k == n || input[std::size_t(k)].segment != input[std::size_t(k - 1)].segment;
      last_boundary[std::size_t(k)] = boundary ? k : last_boundary[std::size_t(k - 1)];
    }
    std::vector<block_range> out;
    for (std::int64_t i = 0; i < n;) {
      const std::int64_t limit = out.empty() && first_block_fills_budget ? std::max(budget, block) : block;
      std::int64_t end = std::min(n, i + limit);
      if (snap_to_segments && end < n && last_boundary[std::size_t(end)] > i) end = last_boundary[std::size_t(end)];
      out.push_back({i, end});
      i = end;
    }
    return out;
  }
};

}  // namespace infkv
