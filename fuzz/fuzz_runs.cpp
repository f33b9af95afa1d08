// Fuzz target: keep sets and position runs. add_unit accepts exactly the strictly increasing
// in-range slot lists; kept_runs and evicted_runs of a unit partition the tokens' positions
// (every position in exactly one kind of run, runs increasing and disjoint) or raise for a
// position held by a kept and an evicted slot; from_runs(kept_runs) keeps the same positions.
#include <algorithm>
#include <cstdint>
#include <set>
#include <vector>

#include <infkv/keep_set.hpp>

#include "input.hpp"

using namespace infkv;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  infkv_fuzz::input in(data, size);
  const std::int64_t n = in.range(0, 64);
  std::vector<token> tokens(static_cast<std::size_t>(n));
  for (auto& t : tokens) t.pos = in.flag() ? in.hostile_int() : in.range(-1, 80);
  std::vector<std::int64_t> slots(static_cast<std::size_t>(in.range(0, 70)));
  for (auto& s : slots) s = in.flag() ? in.hostile_int() : in.range(-1, n);
  keep_set k(n);
  bool valid = true;
  for (std::size_t i = 0; i < slots.size(); ++i)
    valid &= slots[i] >= 0 && slots[i] < n && (i == 0 || slots[i] > slots[i - 1]);
  try {
    k.add_unit(slots);
    INFKV_FUZZ_ASSERT(valid);
  } catch (const infkv::error&) {
    INFKV_FUZZ_ASSERT(!valid);
    return 0;
  }
  std::vector<position_run> kept, evicted;
  try {
    kept = k.kept_runs(tokens);
    evicted = k.evicted_runs(tokens);
  } catch (const infkv::error&) {
    return 0;  // negative positions, or a position both kept and evicted
  }
  const auto m = k.mask();
  for (const auto* runs : {&kept, &evicted})
    for (std::size_t i = 0; i < runs->size(); ++i) {
      INFKV_FUZZ_ASSERT((*runs)[i].begin < (*runs)[i].end);
      if (i) INFKV_FUZZ_ASSERT((*runs)[i].begin > (*runs)[i - 1].end - 1);
    }
  const auto in_runs = [](const std::vector<position_run>& r, std::int64_t p) {
    return std::any_of(r.begin(), r.end(), [&](const position_run& x) { return p >= x.begin && p < x.end; });
  };
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t p = tokens[std::size_t(j)].pos;
    INFKV_FUZZ_ASSERT(in_runs(kept, p) == bool(m[std::size_t(j)]));
    INFKV_FUZZ_ASSERT(in_runs(evicted, p) == !m[std::size_t(j)]);
  }
  const keep_set back = keep_set::from_runs(kept, tokens);
  INFKV_FUZZ_ASSERT(back == k);
  return 0;
}
