// infkv CUDA backend: the status word through which device code reports faults (the smallest
// code wins) and the host raises them by name (`cuda::check`): its faults, its encoding and the
// message each fault raises. Plain C++: no CUDA header needed.
#pragma once

#include <cstdint>

#include <infkv/config.hpp>
#include <infkv/error.hpp>

namespace infkv::cuda {

/// What a device step found wrong, by priority (the smallest recorded code wins).
enum class fault : std::uint8_t {
  none = 0,
  bad_keep = 1,      ///< a keep set that does not fit the cache (a = unit, b = entry)
  bad_pages = 2,     ///< a page table that does not match the sequence (b = the sequence's slots)
  bad_position = 3,  ///< tokens[b].pos outside [0, max_position] (a = 0), query_pos[b] outside +-max_position (a = 1),
                     ///< tokens[b].pos at or above 2^e, the backend's position_bits (a = 2)
  key_not_finite = 4,    ///< a = head, e = element, b = slot
  query_not_finite = 5,  ///< a = query head, e = element, b = query (as the caller counts them)
  value_not_finite = 6,  ///< a = head, b = slot
  logit_overflow = 7,    ///< Expected Attention's logit of key b of head a under query head e is not finite
  nan_score = 8,         ///< a = row, b = column
  not_archivable = 9,    ///< an archived element not finite or beyond f16's range: a = page row, e = channel, b = token
};

/// A status word: ~0 when nothing was recorded, else kind (8 bits) | a (12) | e (12) | b (32).
using status_word = unsigned long long;
inline constexpr status_word status_ok = ~status_word{0};

/// A decoded status word.
struct status {
  fault kind = fault::none;
  std::int64_t a = 0, e = 0, b = 0;
  bool ok() const { return kind == fault::none; }
};

INFKV_HOST_DEVICE inline status_word encode(fault kind, std::int64_t a, std::int64_t e, std::int64_t b) {
  return (status_word(kind) << 56) | (status_word(a & 0xfff) << 44) | (status_word(e & 0xfff) << 32) |
         status_word(std::uint32_t(b));
}
inline status decode(status_word w) {
  if (w == status_ok) return {};
  return {fault(w >> 56), std::int64_t((w >> 44) & 0xfff), std::int64_t((w >> 32) & 0xfff),
          std::int64_t(w & 0xffffffffu)};
}

/// Raises `infkv::invalid_argument` describing a recorded fault; `what` names the call.
inline void raise_if(status s, const char* what) {
  using infkv::fail;
  switch (s.kind) {
    case fault::none: return;
    case fault::bad_keep:
      fail("infkv: ", what, ": keep (unit ", s.a, ", entry ", s.b,
           "): every unit must keep the planned count of slots, "
           "strictly increasing in [0, n_slots), offsets u x count; nothing was moved");
    case fault::bad_pages:
      fail("infkv: ", what, ": paged: ", s.a == 0 ? "the sequence does not hold " : "indices[", s.b,
           s.a == 0 ? " slots (n_slots)" : "] is not a page of the pool [0, n_pages)", "; nothing was moved");
    case fault::bad_position:
      if (s.a == 2)
        fail("infkv: ", what, ": tokens[", s.b, "].pos is at or above 2^", s.e,
             ", the bound the backend was given (backend.position_bits = ", s.e, ")");
      fail("infkv: ", what, s.a == 1 ? ": query_pos[" : ": tokens[", s.b, s.a == 1 ? "]" : "].pos",
           s.a == 1 ? ": query positions must be in [-2^62, 2^62]" : ": positions must be in [0, 2^62]");
    case fault::key_not_finite:
      fail("infkv: ", what, ": keys[slot ", s.b, ", head ", s.a, "][", s.e,
           "] is not finite: keys must be finite (a NaN or Inf would silently distort every score of the layer)");
    case fault::query_not_finite:
      fail("infkv: ", what, ": queries[slot ", s.b, ", head ", s.a, "][", s.e,
           "] is not finite: queries must be finite (a NaN or Inf would silently distort every score of the layer)");
    case fault::value_not_finite:
      fail("infkv: ", what, ": values[slot ", s.b, ", head ", s.a,
           "] is not finite: values must be finite (their norms weight the scores)");
    case fault::logit_overflow:
      fail("infkv: ", what, ": keys[slot ", s.b, ", head ", s.a, "]: expected_attention's logit under the window ",
           "queries of head ", s.e, " overflows f32: keys and queries must be small enough that s^2 (q.k)^2 / 2 ",
           "stays finite");
    case fault::nan_score: fail("infkv: ", what, ": scores[", s.a, ", ", s.b, "] = nan: scores must not be NaN");
    case fault::not_archivable:
      fail("infkv: ", what, ": page row ", s.a, ", token ", s.b, ", channel ", s.e,
           ": an archived element must be finite with |x| <= 65504 (f16's range)");
  }
  fail("infkv: ", what, ": unknown device status ", int(s.kind));
}

}  // namespace infkv::cuda
