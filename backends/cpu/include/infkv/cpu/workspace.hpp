// infkv CPU backend: a 64-byte-aligned buffer for the calls that own their scratch (the
// conveniences over the pipeline and the kernels); callers that must not allocate pass their own.
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>
#include <span>

namespace infkv::cpu {

/// A 64-byte-aligned workspace of `bytes` bytes.
class workspace {
 public:
  explicit workspace(std::size_t bytes)
      : bytes_(bytes),
        p_(static_cast<std::byte*>(::operator new(std::max<std::size_t>(bytes, 1), std::align_val_t(64)))) {}
  ~workspace() { ::operator delete(p_, std::align_val_t(64)); }
  workspace(const workspace&) = delete;
  workspace& operator=(const workspace&) = delete;
  std::span<std::byte> span() const { return {p_, bytes_}; }

 private:
  std::size_t bytes_;
  std::byte* p_;
};

}  // namespace infkv::cpu
