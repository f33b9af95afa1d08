// Fuzz target: compaction. For contiguous (NHD, HND, padded strides; one unit or one per head)
// and paged caches and any keep set, cpu::compact either raises, leaving K, V and tokens as they
// were, or moves exactly the kept rows, byte for byte and in order, with their tokens (paged: the
// freed pages are those past the kept count, the table stays consistent).
#include <cstdint>
#include <cstring>
#include <vector>

#include <infkv/cpu.hpp>

#include "input.hpp"

using namespace infkv;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  infkv_fuzz::input in(data, size);
  const std::int64_t n = in.range(0, 40);
  const auto heads = std::int32_t(in.range(1, 3)), d = std::int32_t(in.range(1, 6));
  const dtype t = dtype(in.range(0, 2));
  const std::int64_t es = std::int64_t(size_of(t)), row = d * es;
  // The keep set: one unit, or one per head; hostile slot lists sometimes.
  const std::int64_t units = in.flag() ? heads : 1;
  keep_set keep(n);
  try {
    for (std::int64_t u = 0; u < units; ++u) {
      std::vector<std::int64_t> s;
      for (std::int64_t j = 0; j < n; ++j)
        if (in.flag()) s.push_back(j);
      if (in.range(0, 9) == 0 && !s.empty()) s[std::size_t(in.range(0, std::int64_t(s.size()) - 1))] = in.hostile_int();
      keep.add_unit(s);
    }
  } catch (const infkv::error&) {
    return 0;
  }
  std::vector<token> tokens(static_cast<std::size_t>(units > 1 ? n * heads : n));
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = {std::int64_t(i), std::int32_t(i % 5), modality::text};
  if (in.flag()) {  // contiguous
    const int lay = int(in.range(0, 2));
    const std::int64_t ss = lay == 0   ? heads * d
                            : lay == 1 ? d
                                       : heads * (d + 2) + 1,
                       hs = lay == 1   ? (n + 2) * d
                            : lay == 0 ? d
                                       : d + 2;
    std::vector<std::uint8_t> k(std::size_t(std::max<std::int64_t>((n + 2) * heads * (d + 3) * es, 1))), v(k.size());
    for (auto& x : k) x = in.byte();
    for (auto& x : v) x = in.byte();
    const auto k0 = k, v0 = v;
    const auto tok0 = tokens;
    kv_view kv{{k.data(), t, n, heads, d, ss, hs}, {v.data(), t, n, heads, d, ss, hs}};
    const kv_view before = kv;
    std::int64_t m = 0;
    try {
      m = cpu::compact(kv, tokens, keep);
    } catch (const infkv::error&) {
      INFKV_FUZZ_ASSERT(k == k0 && v == v0);
      return 0;
    }
    for (std::int32_t h = 0; h < heads; ++h) {
      const auto slots = keep.unit(units > 1 ? h : 0);
      INFKV_FUZZ_ASSERT(std::int64_t(slots.size()) == m);
      for (std::int64_t i = 0; i < m; ++i) {
        const auto from = static_cast<const std::uint8_t*>(before.k.row(slots[std::size_t(i)], h)) - k.data();
        INFKV_FUZZ_ASSERT(std::memcmp(kv.k.row(i, h), k0.data() + from, std::size_t(row)) == 0);
        INFKV_FUZZ_ASSERT(std::memcmp(kv.v.row(i, h), v0.data() + from, std::size_t(row)) == 0);
        const std::size_t list = units > 1 ? std::size_t(h) : 0;
        INFKV_FUZZ_ASSERT(tokens[list * std::size_t(m) + std::size_t(i)].pos ==
                          tok0[list * std::size_t(n) + std::size_t(slots[std::size_t(i)])].pos);
      }
    }
    return 0;
  }
  // Paged: one sequence after a decoy one, pages of 3 slots.
  const std::int32_t page = 3, pages = std::int32_t((n + page - 1) / page);
  std::vector<std::int32_t> indptr{0, 1, 1 + pages}, indices,
      last{page, n == 0 ? 0 : std::int32_t(n - (pages - 1) * page)};
  indices.push_back(pages);  // the decoy's page
  for (std::int32_t p = pages - 1; p >= 0; --p) indices.push_back(p);
  const std::int64_t ps = page * heads * d;
  std::vector<std::uint8_t> k(std::size_t((pages + 1) * ps * es));
  for (auto& x : k) x = in.byte();
  const auto k0 = k;
  paged_view p{
      {k.data(), ps, heads * d, d}, {}, t, heads, d, page, 2, pages + 1, indptr.data(), indices.data(), last.data()};
  const paged_rows rows = key_rows(p, 1);
  const auto table = indices;
  std::int64_t m = 0;
  try {
    m = cpu::compact(rows, paged_rows{}, tokens, keep);
  } catch (const infkv::error&) {
    INFKV_FUZZ_ASSERT(k == k0);
    return 0;
  }
  INFKV_FUZZ_ASSERT(m == keep.size(0) && indices == table);  // the engine's page table: untouched
  INFKV_FUZZ_ASSERT(pages_freed(n, m, page) == pages - (m + page - 1) / page);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int32_t h = 0; h < heads; ++h) {
      const auto from = static_cast<const std::uint8_t*>(rows.row(keep.unit(0)[std::size_t(i)], h)) - k.data();
      INFKV_FUZZ_ASSERT(std::memcmp(rows.row(i, h), k0.data() + from, std::size_t(row)) == 0);
    }
  return 0;
}
