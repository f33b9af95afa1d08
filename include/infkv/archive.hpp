// infkv: the archive, a second tier for what an eviction removes. Evicted slots go, page by
// page, into a bounded host-memory store, keys and values quantized group-wise (keys per
// channel over a page's tokens, values per token over groups of channels, as KIVI does), with
// the slots' tokens. A page's key parameters double as its lookup summary: every dequantized key
// of the page lies in [lo_d, hi_d] per channel, so q . k <= sum_d max(q_d lo_d, q_d hi_d) bounds
// the page's logits from above (Quest's bound) with no extra bytes.
//
// This header holds the format (the quantization rule and its parameters, the page layout) and
// the store (pages in a fixed arena, the byte capacity and what leaves when it is full). The
// backends quantize into it, rank its pages and restore them (cpu/archive.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "config.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "scores.hpp"
#include "tokens.hpp"

namespace infkv {

// ---- the quantization rule -------------------------------------------------------------------

/// Parameters of one quantization group: value = lo + code * step, codes in [0, 2^bits - 1].
/// Both are stored as f16, rounded outward (lo down, step up) so that the group's range fits:
/// every value x of the group is within step / 2 of its dequantized value (plus f32 rounding).
struct quant_params {
  std::uint16_t lo = 0;    ///< f16 bits
  std::uint16_t step = 0;  ///< f16 bits, >= 0
};

namespace detail {
/// The next f16 below / above a finite f16 (bits).
INFKV_HOST_DEVICE inline std::uint16_t f16_below(std::uint16_t h) {
  if (h == 0x0000) return 0x8001;  // +0 -> the smallest negative subnormal
  return (h & 0x8000) ? std::uint16_t(h + 1) : std::uint16_t(h - 1);
}
INFKV_HOST_DEVICE inline std::uint16_t f16_above(std::uint16_t h) {
  if (h == 0x8000) return 0x0001;  // -0 -> the smallest positive subnormal
  return (h & 0x8000) ? std::uint16_t(h - 1) : std::uint16_t(h + 1);
}
INFKV_HOST_DEVICE inline bool f16_finite(std::uint16_t h) { return (h & 0x7c00) != 0x7c00; }
/// The largest f16 at or below x (`up`: the smallest at or above) into h; false when x has none
/// (not finite, or beyond f16's range on that side). Host and device alike.
INFKV_HOST_DEVICE inline bool f16_rounded(float x, bool up, std::uint16_t& h) {
  if (!(x - x == 0.f)) return false;  // not finite
  h = f32_to_f16(x);
  if (f16_finite(h) && (up ? f16_to_f32(h) < x : f16_to_f32(h) > x)) h = up ? f16_above(h) : f16_below(h);
  return f16_finite(h);
}
/// make_quant_params without throwing: false when min or the step has no f16 (host and device).
INFKV_HOST_DEVICE inline bool quant_params_of(float min, float max, std::int32_t bits, quant_params& out) {
  std::uint16_t lo = 0, step = 0;
  if (!f16_rounded(min, false, lo)) return false;
  const double span = (double(max) - double(f16_to_f32(lo))) / double((1 << bits) - 1);  // >= 0: lo <= min <= max
  float s = float(span);
  if (double(s) < span) {  // the next float up (s >= 0)
    std::uint32_t b = 0;
    std::memcpy(&b, &s, sizeof b);
    ++b;
    std::memcpy(&s, &b, sizeof s);
  }
  if (!f16_rounded(s, true, step)) return false;
  out = {lo, step};
  return true;
}
}  // namespace detail

/// The largest f16 at or below x; throws when x has none (below -65504 or not finite).
inline std::uint16_t f16_round_down(float x, const char* what) {
  std::uint16_t h = 0;
  INFKV_REQUIRE(detail::f16_rounded(x, false, h), what, x, "must be finite and within f16's range (|x| <= 65504)");
  return h;
}
/// The smallest f16 at or above x; throws when x has none.
inline std::uint16_t f16_round_up(float x, const char* what) {
  std::uint16_t h = 0;
  INFKV_REQUIRE(detail::f16_rounded(x, true, h), what, x, "must be finite and within f16's range (|x| <= 65504)");
  return h;
}

/// The parameters of a group whose values lie in [min, max] at `bits` bits per code.
inline quant_params make_quant_params(float min, float max, std::int32_t bits) {
  quant_params q;
  if (!detail::quant_params_of(min, max, bits, q)) {  // say which bound has no f16
    const std::uint16_t lo = f16_round_down(min, "archive: a group's smallest value");
    (void)f16_round_up(float((double(max) - double(f16_to_f32(lo))) / double((1 << bits) - 1)),
                       "archive: a group's step (range / (2^bits - 1))");
  }
  return q;
}

/// The code of x in a group (x within the group's range; rounding to nearest, ties to even,
/// clamped to the code range against f32 rounding at its ends). Host and device alike.
INFKV_HOST_DEVICE inline std::uint32_t quant_code(float x, float lo, float step, std::int32_t bits) {
  if (step <= 0.f) return 0;
#if defined(__CUDA_ARCH__)
  const float q = nearbyintf((x - lo) / step);
#else
  const float q = std::nearbyint((x - lo) / step);
#endif
  const float top = float((1 << bits) - 1);
  return std::uint32_t(q < 0.f ? 0.f : (q > top ? top : q));
}

/// The largest magnitude an archived element may have: its group's f16 parameters hold it.
inline constexpr float archive_max_abs = 65504.f;

/// Group i's parameters in a page row's parameter array starting at `at` (unaligned).
INFKV_HOST_DEVICE inline quant_params params_at(const std::uint8_t* at, std::size_t i) {
  quant_params q;
  std::memcpy(&q, at + i * sizeof q, sizeof q);
  return q;
}
/// The value a code stands for in a group: lo + code * step.
INFKV_HOST_DEVICE inline float dequantized(quant_params q, std::uint32_t code) {
  return f16_to_f32(q.lo) + float(code) * f16_to_f32(q.step);
}

/// Code i of a packed code array (bits in {2, 4, 8}, least significant bits first).
INFKV_HOST_DEVICE inline std::uint32_t code_at(const std::uint8_t* codes, std::int64_t i, std::int32_t bits) {
  const std::int64_t bit = i * bits;
  return (codes[bit >> 3] >> (bit & 7)) & ((1u << bits) - 1);
}
inline void set_code(std::uint8_t* codes, std::int64_t i, std::int32_t bits, std::uint32_t c) {
  const std::int64_t bit = i * bits;
  const auto mask = std::uint8_t(((1u << bits) - 1) << (bit & 7));
  codes[bit >> 3] = std::uint8_t((codes[bit >> 3] & ~mask) | ((c << (bit & 7)) & mask));
}

// ---- shape, options, layout ------------------------------------------------------------------

/// What the archive stores: the cache's layers, KV heads and head size, and the granularity of
/// the keep sets whose evictions it takes. A page spans what one decision unit covers: every
/// layer and head (per_token), one layer's heads (per_layer) or one layer's head (per_head).
struct archive_shape {
  std::int32_t n_layers = 1;
  std::int32_t kv_heads = 1;
  std::int32_t head_dim = 0;
  granularity g = granularity::per_token;

  std::int32_t layers_per_page() const { return g == granularity::per_token ? n_layers : 1; }
  std::int32_t heads_per_page() const { return g == granularity::per_head ? 1 : kv_heads; }
  /// (layer, head) rows a page holds.
  std::int32_t rows_per_page() const { return layers_per_page() * heads_per_page(); }
  /// Decision units of one layer's keep set (pages of a per_head archive carry their head).
  std::int32_t units() const { return g == granularity::per_head ? kv_heads : 1; }
};

/// What to do when a page arrives and the archive is full.
enum class when_full : std::uint8_t {
  drop_oldest,  ///< the page archived earliest leaves (counted in archive::stats)
  error,        ///< the archiving call throws and the archive is unchanged
};

struct archive_options {
  std::int32_t page_tokens = 32;   ///< most slots per page (an eviction's slots, in time order)
  std::int32_t key_bits = 4;       ///< 2, 4 or 8
  std::int32_t value_bits = 4;     ///< 2, 4 or 8
  std::int32_t value_group = 0;    ///< channels per value group; 0: head_dim
  std::size_t capacity_bytes = 0;  ///< the arena's bytes (whole pages); at least one page
  when_full full = when_full::drop_oldest;
};

/// Byte layout of one page (offsets from the page's start). Per (layer, head) row r, in order:
/// key parameters [head_dim] (per channel), key codes [page_tokens][head_dim], value parameters
/// [page_tokens][groups], value codes [page_tokens][head_dim]; codes packed, rows 2-byte aligned.
struct page_layout {
  std::int32_t tokens = 0, head_dim = 0, k_bits = 0, v_bits = 0, v_group = 0, rows = 0;
  std::size_t k_params = 0, k_codes = 0, v_params = 0, v_codes = 0, row_bytes = 0, bytes = 0;

  page_layout() = default;
  page_layout(const archive_shape& s, const archive_options& o)
      : tokens(o.page_tokens),
        head_dim(s.head_dim),
        k_bits(o.key_bits),
        v_bits(o.value_bits),
        v_group(o.value_group == 0 ? s.head_dim : o.value_group),
        rows(s.rows_per_page()) {
    const auto code_bytes = [&](std::int32_t bits) { return (std::size_t(tokens) * head_dim * bits + 15) / 16 * 2; };
    k_params = 0;
    k_codes = k_params + std::size_t(head_dim) * sizeof(quant_params);
    v_params = k_codes + code_bytes(k_bits);
    v_codes = v_params + std::size_t(tokens) * std::size_t(head_dim / v_group) * sizeof(quant_params);
    row_bytes = v_codes + code_bytes(v_bits);
    bytes = row_bytes * std::size_t(rows);
  }
  std::int32_t groups() const { return head_dim / v_group; }
};

/// One held page: where it came from and what it holds.
struct page_info {
  std::int32_t layer = 0;  ///< its first layer (0 for per_token)
  std::int32_t unit = 0;   ///< its decision unit (the head for per_head)
  std::int32_t n_tokens = 0;
  std::uint64_t serial = 0;  ///< archiving order (what drop_oldest reads)
  bool held = false;
};

inline void validate(const archive_shape& s) {
  INFKV_REQUIRE(s.n_layers >= 1, "archive_shape.n_layers", s.n_layers, "must be >= 1");
  INFKV_REQUIRE(s.kv_heads >= 1, "archive_shape.kv_heads", s.kv_heads, "must be >= 1");
  INFKV_REQUIRE(s.head_dim >= 1, "archive_shape.head_dim", s.head_dim, "must be >= 1");
}

inline void validate(const archive_options& o, const archive_shape& s) {
  validate(s);
  INFKV_REQUIRE(o.page_tokens >= 1 && o.page_tokens <= 4096, "archive_options.page_tokens", o.page_tokens,
                "must be in [1, 4096]");
  for (auto [name, bits] :
       {std::pair{"archive_options.key_bits", o.key_bits}, {"archive_options.value_bits", o.value_bits}})
    INFKV_REQUIRE(bits == 2 || bits == 4 || bits == 8, name, bits, "must be 2, 4 or 8");
  const std::int32_t g = o.value_group == 0 ? s.head_dim : o.value_group;
  INFKV_REQUIRE(g >= 1 && s.head_dim % g == 0, "archive_options.value_group", o.value_group, "must divide head_dim (",
                s.head_dim, "); 0 means head_dim");
  const page_layout l(s, o);
  INFKV_REQUIRE(o.capacity_bytes >= l.bytes, "archive_options.capacity_bytes", o.capacity_bytes,
                "holds no page: a page of ", o.page_tokens, " tokens takes ", l.bytes, " bytes");
}

// ---- the store -------------------------------------------------------------------------------

/// Pages in a fixed arena of capacity_bytes / page bytes pages, allocated once at construction:
/// archiving, recalling and dropping allocate nothing. Host memory.
class archive {
 public:
  struct counters {
    std::int64_t archived_pages = 0, archived_tokens = 0;
    std::int64_t dropped_pages = 0, dropped_tokens = 0;    ///< left because the archive was full
    std::int64_t released_pages = 0, released_tokens = 0;  ///< taken back into the cache
  };

  archive(const archive_shape& s, const archive_options& o) : shape_(s), opt_(o) {
    validate(o, s);
    layout_ = page_layout(s, o);
    const std::size_t pages = o.capacity_bytes / layout_.bytes;
    INFKV_REQUIRE(pages <= std::size_t(std::numeric_limits<std::int32_t>::max()), "archive_options.capacity_bytes",
                  o.capacity_bytes, "holds more than 2^31 pages");
    arena_.assign(pages * layout_.bytes, std::uint8_t{0});
    info_.assign(pages, page_info{});
    tokens_.assign(pages * std::size_t(o.page_tokens), token{});
    free_.resize(pages);
    for (std::size_t i = 0; i < pages; ++i) free_[i] = std::int32_t(pages - 1 - i);  // page 0 first
  }

  const archive_shape& shape() const { return shape_; }
  const archive_options& options() const { return opt_; }
  const page_layout& layout() const { return layout_; }
  /// Pages the arena holds at most.
  std::int32_t capacity_pages() const { return std::int32_t(info_.size()); }
  std::int32_t held_pages() const { return capacity_pages() - std::int32_t(free_.size()); }
  std::int64_t held_tokens() const { return held_tokens_; }
  /// Bytes the archive holds in all (arena, tokens, page table): what memory accounting counts.
  std::size_t memory() const {
    return arena_.size() + tokens_.size() * sizeof(token) + info_.size() * sizeof(page_info) +
           free_.capacity() * sizeof(std::int32_t);
  }
  /// Bytes of the pages held (their share of the arena and their tokens).
  std::size_t held_bytes() const {
    return std::size_t(held_pages()) * (layout_.bytes + std::size_t(opt_.page_tokens) * sizeof(token));
  }
  const counters& stats() const { return stats_; }

  /// True when `page` is a page slot holding a page.
  bool holds(std::int32_t page) const { return page >= 0 && page < capacity_pages() && info_[std::size_t(page)].held; }
  const page_info& info(std::int32_t page) const {
    check_page(page);
    return info_[std::size_t(page)];
  }
  std::span<const token> tokens(std::int32_t page) const {
    const auto& i = info(page);
    return {tokens_.data() + std::size_t(page) * std::size_t(opt_.page_tokens), std::size_t(i.n_tokens)};
  }
  /// Row r's bytes of a page (r = layer offset * heads_per_page + head offset).
  const std::uint8_t* row(std::int32_t page, std::int32_t r) const {
    return arena_.data() + std::size_t(page) * layout_.bytes + std::size_t(r) * layout_.row_bytes;
  }
  std::uint8_t* row(std::int32_t page, std::int32_t r) {
    return arena_.data() + std::size_t(page) * layout_.bytes + std::size_t(r) * layout_.row_bytes;
  }

  /// Takes a page slot for `tokens` (1..page_tokens of them) of `layer`'s unit `unit`: under
  /// drop_oldest the earliest archived page leaves when the arena is full; under error a full
  /// arena throws and nothing changes. The caller fills the page's rows (cpu::archive_evicted).
  std::int32_t add(std::int32_t layer, std::int32_t unit, std::span<const token> toks) {
    INFKV_REQUIRE(layer >= 0 && layer < shape_.n_layers && (shape_.g != granularity::per_token || layer == 0), "layer",
                  layer, "must be in [0, ", shape_.g == granularity::per_token ? 1 : shape_.n_layers, ")");
    INFKV_REQUIRE(unit >= 0 && unit < shape_.units(), "unit", unit, "must be in [0, ", shape_.units(), ")");
    INFKV_REQUIRE(!toks.empty() && std::int64_t(toks.size()) <= opt_.page_tokens, "tokens.size()", toks.size(),
                  "a page holds 1 to ", opt_.page_tokens, " tokens");
    if (free_.empty()) {
      INFKV_REQUIRE(opt_.full == when_full::drop_oldest, "archive", "full", "holds ", capacity_pages(), " pages (",
                    opt_.capacity_bytes, " bytes) and when_full is error");
      std::int32_t oldest = 0;
      for (std::int32_t p = 1; p < capacity_pages(); ++p)
        if (info_[std::size_t(p)].serial < info_[std::size_t(oldest)].serial) oldest = p;
      stats_.dropped_pages += 1, stats_.dropped_tokens += info_[std::size_t(oldest)].n_tokens;
      take_out(oldest);
    }
    const std::int32_t p = free_.back();
    free_.pop_back();
    info_[std::size_t(p)] = {layer, unit, std::int32_t(toks.size()), next_serial_++, true};
    std::copy(toks.begin(), toks.end(), tokens_.begin() + std::ptrdiff_t(p) * opt_.page_tokens);
    held_tokens_ += std::int64_t(toks.size());
    stats_.archived_pages += 1, stats_.archived_tokens += std::int64_t(toks.size());
    return p;
  }
  /// Removes a held page (taken back into the cache).
  void release(std::int32_t page) {
    check_page(page);
    stats_.released_pages += 1, stats_.released_tokens += info_[std::size_t(page)].n_tokens;
    take_out(page);
  }
  /// Removes every page (counters stay).
  void clear() {
    for (std::int32_t p = 0; p < capacity_pages(); ++p)
      if (info_[std::size_t(p)].held) take_out(p);
  }
  /// The held pages, oldest first.
  std::vector<std::int32_t> held() const {
    std::vector<std::int32_t> out;
    for (std::int32_t p = 0; p < capacity_pages(); ++p)
      if (info_[std::size_t(p)].held) out.push_back(p);
    std::sort(out.begin(), out.end(),
              [&](auto a, auto b) { return info_[std::size_t(a)].serial < info_[std::size_t(b)].serial; });
    return out;
  }

 private:
  void check_page(std::int32_t page) const {
    INFKV_REQUIRE(page >= 0 && page < capacity_pages() && info_[std::size_t(page)].held, "page", page,
                  "is not a page the archive holds (capacity ", capacity_pages(), " pages)");
  }
  void take_out(std::int32_t p) {
    held_tokens_ -= info_[std::size_t(p)].n_tokens;
    info_[std::size_t(p)] = page_info{};
    free_.push_back(p);
  }

  archive_shape shape_;
  archive_options opt_;
  page_layout layout_;
  std::vector<std::uint8_t> arena_;
  std::vector<page_info> info_;
  std::vector<token> tokens_;
  std::vector<std::int32_t> free_;
  std::int64_t held_tokens_ = 0;
  std::uint64_t next_serial_ = 0;
  counters stats_;
};

}  // namespace infkv
