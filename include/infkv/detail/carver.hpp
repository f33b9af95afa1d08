// infkv internals: the one way a workspace is laid out. Every piece starts on a 64-byte
// boundary; the same carving code sizes a workspace (no base: offsets and the total only) and
// hands out its pieces (with a base), so a layout and its size cannot drift apart. Used by the
// pipeline's plan, the CPU kernels' per-worker scratch and the CUDA steps' scratch.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace infkv::detail {

/// A bump allocator over a workspace of 64-byte-aligned pieces.
class carver {
 public:
  static constexpr std::size_t alignment = 64;

  /// Pieces from `base` (null: sizing only), the first at or after byte `at`.
  explicit carver(std::byte* base = nullptr, std::size_t at = 0) : base_(base), at_(at) {}

  /// Reserves `bytes` bytes; returns their offset from the base.
  std::size_t offset(std::size_t bytes) {
    const std::size_t start = round_up(at_);
    at_ = start + bytes;
    return start;
  }
  /// Reserves `count` elements of T (none when count <= 0); null when sizing only.
  template <class T>
  T* take(std::int64_t count) {
    const std::size_t start = offset(std::size_t(std::max<std::int64_t>(count, 0)) * sizeof(T));
    return base_ ? reinterpret_cast<T*>(base_ + start) : nullptr;
  }
  /// Bytes used so far, rounded up to whole pieces.
  std::size_t size() const { return round_up(at_); }

  static constexpr std::size_t round_up(std::size_t bytes) { return (bytes + alignment - 1) / alignment * alignment; }

 private:
  std::byte* base_;
  std::size_t at_;
};

/// The bytes a layout takes: `carve(c)` run on a sizing carver.
template <class F>
std::size_t bytes_of(F&& carve) {
  carver c;
  carve(c);
  return c.size();
}

}  // namespace infkv::detail
