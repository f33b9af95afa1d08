// infkv llama.cpp adapter: a session's position bookkeeping. llama.h has no public cell ->
// position map, so the session keeps the cached tokens itself, in its slot order (the order of
// its host copies), with the stream's next position and the positions reserved by explicitly
// positioned chunks; `check` holds it against what llama.cpp reports.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <llama.h>

#include <infkv/error.hpp>
#include <infkv/keep_set.hpp>
#include <infkv/rope.hpp>
#include <infkv/tokens.hpp>

namespace infkv::llama_cpp::detail {

/// The cached tokens of one sequence in slot order, and where the stream goes on. Each token also
/// has its token id (-1 where the session was not told it: embeddings, recalled slots) and its origin: the position it
/// had when decoded plus every compaction's shift before it, i.e. its position in the stream as keep mode would hold it
/// (equal to its position in keep mode).
class position_book {
 public:
  /// `max_gap`: compaction narrows the gaps between kept runs to at most this many positions
  /// (0: closes them; infkv::compact_positions). `max_span` (> 0): instead, each compaction
  /// narrows them to the largest gap that keeps the positions within [0, max_span) (closing them
  /// all when even that exceeds it).
  explicit position_book(std::int64_t max_gap = 0, std::int64_t max_span = 0)
      : max_gap_(max_gap), max_span_(max_span) {}
  std::span<const token> tokens() const { return tokens_; }
  /// Each cached slot's origin (the stream's position of its token).
  std::span<const std::int64_t> origins() const { return origins_; }
  /// Each cached slot's token id, -1 where unknown.
  std::span<const llama_token> ids() const { return ids_; }
  /// The origin of position `pos`: a cached slot's, or for a position past the cache's, as the
  /// next decoded token's would be.
  std::int64_t origin_of(std::int64_t pos) const {
    for (std::size_t s = 0; s < tokens_.size(); ++s)
      if (tokens_[s].pos == pos) return origins_[s];
    return pos + drift_;
  }
  std::int64_t size() const { return std::int64_t(tokens_.size()); }
  bool empty() const { return tokens_.empty(); }
  /// Bytes of the bookkeeping (its capacity).
  std::int64_t bytes() const {
    return std::int64_t(tokens_.capacity() * sizeof(token) + origins_.capacity() * sizeof(std::int64_t) +
                        ids_.capacity() * sizeof(llama_token));
  }
  /// Oldest and newest cached positions (-1 when nothing is cached).
  std::int64_t min_pos() const { return empty() ? -1 : std::ranges::min_element(tokens_, {}, &token::pos)->pos; }
  std::int64_t max_pos() const { return empty() ? -1 : std::ranges::max_element(tokens_, {}, &token::pos)->pos; }
  /// Position the next decoded token gets: one past the newest cached position (llama.cpp wants
  /// consecutive positions), or the stream's next position when nothing is cached; at least the
  /// end of what reserve() took.
  std::int64_t next_pos() const { return std::max(empty() ? stream_next_ : max_pos() + 1, reserved_); }
  /// Marks the stream positions below `end` as taken.
  void reserve(std::int64_t end) { reserved_ = std::max(reserved_, end); }

  /// The tokens of a successful decode at positions `pos`, appended after the cached ones, with
  /// their ids (`ids` empty: unknown).
  void append(std::span<const std::int64_t> pos, std::int32_t segment, modality kind,
              std::span<const std::int32_t> segments = {}, std::span<const llama_token> ids = {}) {
    for (std::size_t i = 0; i < pos.size(); ++i) {
      tokens_.push_back({pos[i], segments.empty() ? segment : segments[i], kind});
      origins_.push_back(pos[i] + drift_);
      ids_.push_back(ids.empty() ? -1 : ids[i]);
    }
    if (!pos.empty()) {
      stream_next_ = std::max(stream_next_, *std::ranges::max_element(pos) + 1);
      origin_next_ = std::max(origin_next_, *std::ranges::max_element(pos) + 1 + drift_);
    }
  }
  /// Keeps the slots of unit 0 of `keep`, in its (slot) order.
  void keep(const keep_set& keep) {
    std::vector<token> kept;
    std::vector<std::int64_t> origins;
    std::vector<llama_token> ids;
    for (auto s : keep.unit(0))
      kept.push_back(tokens_[std::size_t(s)]), origins.push_back(origins_[std::size_t(s)]),
          ids.push_back(ids_[std::size_t(s)]);
    tokens_ = std::move(kept), origins_ = std::move(origins), ids_ = std::move(ids);
  }
  /// Appends tokens that come back into a compacted cache (their `pos` is their origin) and
  /// compacts (compact()): returns each slot's delta, the appended ones' from their origin.
  std::vector<std::int64_t> insert(std::span<const token> back) {
    for (const token& t : back) tokens_.push_back(t), origins_.push_back(t.pos), ids_.push_back(-1);
    return compact();
  }
  /// True when two cached slots share a position (an M-RoPE image's tokens share their t).
  bool shares_positions() const {
    std::vector<std::int64_t> pos;
    pos.reserve(tokens_.size());
    for (const auto& t : tokens_) pos.push_back(t.pos);
    std::ranges::sort(pos);
    return std::ranges::adjacent_find(pos) != pos.end();
  }
  /// Gives the cached tokens positions 0..n-1 in the order of their origins (slots sharing one
  /// share a position; with a max_gap, gaps between origins narrowed to at most that many free
  /// positions) and returns each slot's delta (new - old); when anything moved, the stream goes
  /// on after the newest.
  std::vector<std::int64_t> compact() {
    std::vector<token> by_origin = tokens_;
    for (std::size_t s = 0; s < by_origin.size(); ++s) by_origin[s].pos = origins_[s];
    infkv::compact_positions(by_origin, 0, max_span_ > 0 ? gap_within(max_span_) : max_gap_);
    std::vector<std::int64_t> delta(tokens_.size());
    for (std::size_t s = 0; s < tokens_.size(); ++s)
      delta[s] = by_origin[s].pos - tokens_[s].pos, tokens_[s].pos = by_origin[s].pos;
    if (std::ranges::any_of(delta, [](std::int64_t d) { return d != 0; })) {
      stream_next_ = max_pos() + 1;
      drift_ = origin_next_ - next_pos();
    }
    return delta;
  }

  /// Checks the bookkeeping against llama_memory_seq_pos_min / max (`lo`, `hi`) of sequence `seq`;
  /// throws infkv::error on a mismatch. With sliding-window layers (`sliding`) llama.cpp answers
  /// from their cache, whose cells of tokens that fell out of the window may already be reused
  /// (and position compaction may since have moved the rest closer): its minimum then lies
  /// anywhere from the session's to the newest position.
  void check(llama_pos lo, llama_pos hi, llama_seq_id seq, bool sliding) const {
    const std::int64_t want_lo = min_pos(), want_hi = max_pos();
    INFKV_REQUIRE(sliding ? lo >= want_lo && lo <= want_hi : lo == want_lo,
                  "llama_memory_seq_pos_min(seq = " + std::to_string(seq) + ")", lo, "the session's bookkeeping says ",
                  want_lo, sliding ? " (sliding-window layers: up to " + std::to_string(want_hi) + ")" : std::string());
    INFKV_REQUIRE(hi == want_hi, "llama_memory_seq_pos_max(seq = " + std::to_string(seq) + ")", hi,
                  "the session's bookkeeping says ", want_hi);
  }

 private:
  /// The largest gap g such that narrowing every gap between the cached origins to at most g free
  /// positions keeps them within `span` positions (0 when none does).
  std::int64_t gap_within(std::int64_t span) const {
    std::vector<std::int64_t> o = origins_;
    std::ranges::sort(o);
    o.erase(std::unique(o.begin(), o.end()), o.end());
    std::vector<std::int64_t> holes;
    for (std::size_t i = 1; i < o.size(); ++i) holes.push_back(o[i] - o[i - 1] - 1);
    const auto span_at = [&](std::int64_t g) {
      std::int64_t s = std::int64_t(o.size());
      for (const std::int64_t h : holes) s += std::min(h, g);
      return s;
    };
    std::int64_t lo = 0, hi = holes.empty() ? 0 : std::ranges::max(holes);
    while (lo < hi) {  // span_at grows with g: the largest g within the span
      const std::int64_t mid = lo + (hi - lo + 1) / 2;
      if (span_at(mid) <= span)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  std::vector<token> tokens_;
  std::vector<std::int64_t> origins_;  // each slot's origin
  std::vector<llama_token> ids_;       // each slot's token id (-1: unknown)
  std::int64_t drift_ = 0;             // origin - position of the next decoded token
  std::int64_t origin_next_ = 0;       // the stream's next origin
  std::int64_t stream_next_ = 0;
  std::int64_t reserved_ = 0;
  std::int64_t max_gap_ = 0;
  std::int64_t max_span_ = 0;
};

}  // namespace infkv::llama_cpp::detail
