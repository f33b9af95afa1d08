// infkv: per-slot token metadata (position, modality, segment) and ordering helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "error.hpp"

namespace infkv {

/// What a token came from.
enum class modality : std::uint8_t { text, image, video, audio };

constexpr const char* to_string(modality m) {
  switch (m) {
    case modality::text: return "text";
    case modality::image: return "image";
    case modality::video: return "video";
    case modality::audio: return "audio";
  }
  return "?";
}

/// Metadata of one cached slot. `segment` names the frame, tile or turn the token belongs to;
/// segments are non-decreasing in time. Positions may repeat (M-RoPE image tokens).
struct token {
  std::int64_t pos = 0;
  std::int32_t segment = 0;
  modality kind = modality::text;
};

/// Tokens of a plain text stream with positions first, first + 1, ... in one segment.
inline std::vector<token> text_tokens(std::int64_t n, std::int64_t first = 0, std::int32_t segment = 0) {
  std::vector<token> t(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)));
  for (std::int64_t i = 0; i < n; ++i) t[std::size_t(i)] = {first + i, segment, modality::text};
  return t;
}

/// Writes the slot indices sorted by (position, slot), time order, to `order[0, tokens.size())`.
/// Allocates nothing. O(n log n).
inline void time_order_into(std::span<const token> tokens, std::int64_t* order) {
  const auto n = std::int64_t(tokens.size());
  for (std::int64_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order, order + n, [&](std::int64_t a, std::int64_t b) {
    const auto pa = tokens[std::size_t(a)].pos, pb = tokens[std::size_t(b)].pos;
    return pa != pb ? pa < pb : a < b;
  });
}

/// Slot indices sorted by (position, slot): time order. O(n log n).
inline std::vector<std::int64_t> time_order(std::span<const token> tokens) {
  std::vector<std::int64_t> order(tokens.size());
  time_order_into(tokens, order.data());
  return order;
}

/// The largest position a token may have: runs [p, p + 1) and position arithmetic never overflow.
inline constexpr std::int64_t max_position = std::int64_t(1) << 62;

/// Checks that `tokens` describes exactly `n_slots` slots with positions in [0, max_position].
inline void validate_tokens(std::span<const token> tokens, std::int64_t n_slots, const char* name = "tokens") {
  INFKV_REQUIRE(std::int64_t(tokens.size()) == n_slots, std::string(name) + ".size()", tokens.size(),
                "must equal the number of cached slots (", n_slots, ")");
  for (std::size_t i = 0; i < tokens.size(); ++i)
    INFKV_REQUIRE(tokens[i].pos >= 0 && tokens[i].pos <= max_position,
                  std::string(name) + "[" + std::to_string(i) + "].pos", tokens[i].pos,
                  "positions must be in [0, 2^62]");
}

}  // namespace infkv
