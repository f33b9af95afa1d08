// Test helper shared by the core tests: tokens at given positions.
#pragma once

#include <cstdint>
#include <vector>

#include <infkv/tokens.hpp>

namespace infkv_test {

/// One text token per position, in segment 0.
inline std::vector<infkv::token> tokens_at(const std::vector<std::int64_t>& pos) {
  std::vector<infkv::token> t;
  for (auto p : pos) t.push_back({p, 0, infkv::modality::text});
  return t;
}

}  // namespace infkv_test
