// Compaction of contiguous (NHD, HND) and paged caches: kept rows hold their source bytes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

/// Random bytes of `n` elements of type t (finite values, as a cache would hold).
std::vector<std::uint8_t> random_elements(dtype t, std::int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> f(static_cast<std::size_t>(n));
  for (auto& x : f) x = dist(rng);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(n) * size_of(t));
  from_f32(t, f.data(), out.data(), n);
  return out;
}

/// A view of the same shape and strides over another buffer.
tensor_view rebase(tensor_view v, std::vector<std::uint8_t>& buf) {
  v.data = buf.data();
  return v;
}

bool same_row(const tensor_view& a, std::int64_t sa, const tensor_view& b, std::int64_t sb, std::int32_t h) {
  return std::memcmp(a.row(sa, h), b.row(sb, h), std::size_t(a.head_dim) * size_of(a.type)) == 0;
}

/// Sorted random subset of [0, n) of size m.
std::vector<std::int64_t> random_subset(std::int64_t n, std::int64_t m, std::mt19937& rng) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(std::size_t(m));
  std::sort(all.begin(), all.end());
  return all;
}

std::vector<token> numbered_tokens(std::int64_t n, std::int64_t offset) {
  std::vector<token> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    t[std::size_t(i)] = {offset + 3 * i, std::int32_t(i / 5), i % 3 ? modality::image : modality::text};
  return t;
}

enum class layout { nhd, hnd };

struct contiguous_case {
  std::vector<std::uint8_t> k, v, k0, v0;
  kv_view kv{};
  kv_view kv0{};
};

contiguous_case make_case(layout l, dtype t, std::int64_t n, std::int32_t heads, std::int32_t d, std::mt19937& rng) {
  contiguous_case c;
  const std::int64_t cap = l == layout::nhd ? n : n + 5;  // HND with spare slots per head
  c.k = random_elements(t, cap * heads * d, rng);
  c.v = random_elements(t, cap * heads * d, rng);
  c.k0 = c.k, c.v0 = c.v;
  c.kv = l == layout::nhd ? contiguous_nhd(c.k.data(), c.v.data(), t, n, heads, d)
                          : contiguous_hnd(c.k.data(), c.v.data(), t, n, heads, d, cap);
  c.kv0 = {rebase(c.kv.k, c.k0), rebase(c.kv.v, c.v0)};
  return c;
}

}  // namespace

TEST_CASE("compact keeps the source bytes of every kept slot, one unit for all heads") {
  std::mt19937 rng(11);
  for (layout l : {layout::nhd, layout::hnd})
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16})
      for (std::int64_t m : {0, 1, 9, 23, 24}) {
        CAPTURE(int(l));
        CAPTURE(to_string(t));
        CAPTURE(m);
        const std::int64_t n = 24;
        const std::int32_t heads = 3, d = 16;
        auto c = make_case(l, t, n, heads, d, rng);
        auto tokens = numbered_tokens(n, 100);
        const auto tokens0 = tokens;
        const auto slots = random_subset(n, m, rng);
        keep_set keep(n);
        keep.add_unit(slots);
        CHECK(cpu::compact(c.kv, tokens, keep) == m);
        CHECK(c.kv.k.n_slots == m);
        CHECK(c.kv.v.n_slots == m);
        for (std::int64_t i = 0; i < m; ++i) {
          const auto src = slots[std::size_t(i)];
          CHECK(tokens[std::size_t(i)].pos == tokens0[std::size_t(src)].pos);
          CHECK(tokens[std::size_t(i)].segment == tokens0[std::size_t(src)].segment);
          CHECK(tokens[std::size_t(i)].kind == tokens0[std::size_t(src)].kind);
          for (std::int32_t h = 0; h < heads; ++h) {
            CHECK(same_row(c.kv.k, i, c.kv0.k, src, h));
            CHECK(same_row(c.kv.v, i, c.kv0.v, src, h));
          }
        }
      }
}

TEST_CASE("compact with per-head units moves each head's own slots and token list") {
  std::mt19937 rng(12);
  for (layout l : {layout::nhd, layout::hnd})
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      CAPTURE(int(l));
      CAPTURE(to_string(t));
      const std::int64_t n = 20, m = 7;
      const std::int32_t heads = 4, d = 8;
      auto c = make_case(l, t, n, heads, d, rng);
      std::vector<token> tokens;
      for (std::int32_t h = 0; h < heads; ++h) {
        const auto list = numbered_tokens(n, 1000 * h);
        tokens.insert(tokens.end(), list.begin(), list.end());
      }
      const auto tokens0 = tokens;
      keep_set keep(n);
      std::vector<std::vector<std::int64_t>> slots;
      for (std::int32_t h = 0; h < heads; ++h) keep.add_unit(slots.emplace_back(random_subset(n, m, rng)));
      REQUIRE_FALSE(keep.uniform());
      CHECK(cpu::compact(c.kv, tokens, keep) == m);
      CHECK(c.kv.k.n_slots == m);
      CHECK(c.kv.v.n_slots == m);
      for (std::int32_t h = 0; h < heads; ++h)
        for (std::int64_t i = 0; i < m; ++i) {
          const auto src = slots[std::size_t(h)][std::size_t(i)];
          CHECK(tokens[std::size_t(h * m + i)].pos == tokens0[std::size_t(h * n + src)].pos);
          CHECK(tokens[std::size_t(h * m + i)].segment == tokens0[std::size_t(h * n + src)].segment);
          CHECK(same_row(c.kv.k, i, c.kv0.k, src, h));
          CHECK(same_row(c.kv.v, i, c.kv0.v, src, h));
        }
    }
}

TEST_CASE("compact without values moves keys only") {
  std::mt19937 rng(13);
  for (layout l : {layout::nhd, layout::hnd}) {
    const std::int64_t n = 17;
    auto c = make_case(l, dtype::f16, n, 2, 8, rng);
    c.kv.v = {};
    auto tokens = numbered_tokens(n, 0);
    const std::vector<std::int64_t> slots{0, 3, 4, 10, 16};
    keep_set keep(n);
    keep.add_unit(slots);
    CHECK(cpu::compact(c.kv, tokens, keep) == 5);
    CHECK(c.kv.k.n_slots == 5);
    CHECK(c.kv.v.empty());
    CHECK(c.v == c.v0);  // the value buffer is not touched
    for (std::int64_t i = 0; i < 5; ++i) {
      CHECK(tokens[std::size_t(i)].pos == 3 * slots[std::size_t(i)]);
      for (std::int32_t h = 0; h < 2; ++h) CHECK(same_row(c.kv.k, i, c.kv0.k, slots[std::size_t(i)], h));
    }
  }
}

TEST_CASE("compact of a cache beyond the cache-bypassing threshold (128 MiB) keeps every kept row's bytes") {
  // NHD and HND f32 keys of 32768 slots x 8 heads x 128: 128 MiB, where runs whose source and
  // destination do not overlap move with non-temporal stores. Kept: a run that stays, a long run
  // that moves far, every other slot of a range (runs of one), the last slot.
  const std::int64_t n = 32768;
  const std::int32_t heads = 8, d = 128;
  std::vector<std::int64_t> slots;
  for (std::int64_t j = 0; j < 100; ++j) slots.push_back(j);
  for (std::int64_t j = 20000; j < 21000; ++j) slots.push_back(j);
  for (std::int64_t j = 25001; j < 26000; j += 2) slots.push_back(j);
  slots.push_back(n - 1);
  const auto value = [](std::int64_t slot, std::int32_t h, std::int32_t e) {
    return float(slot) * 1024.f + float(h) * 128.f + float(e);  // exact in f32 below 2^24
  };
  for (layout l : {layout::nhd, layout::hnd}) {
    CAPTURE(int(l));
    std::vector<float> k(static_cast<std::size_t>(n * heads * d));
    kv_view kv{l == layout::nhd ? nhd(k.data(), dtype::f32, n, heads, d) : hnd(k.data(), dtype::f32, n, heads, d, n),
               {}};
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int32_t h = 0; h < heads; ++h)
        for (std::int32_t e = 0; e < d; ++e) static_cast<float*>(kv.k.row(j, h))[e] = value(j, h, e);
    auto tokens = numbered_tokens(n, 0);
    keep_set keep(n);
    keep.add_unit(slots);
    REQUIRE(cpu::compact(kv, tokens, keep) == std::int64_t(slots.size()));
    std::int64_t bad = 0;
    for (std::size_t i = 0; i < slots.size(); ++i)
      for (std::int32_t h = 0; h < heads; ++h)
        for (std::int32_t e = 0; e < d; ++e)
          bad += static_cast<const float*>(kv.k.row(std::int64_t(i), h))[e] != value(slots[i], h, e);
    CHECK(bad == 0);
    CHECK(tokens[100].pos == 3 * 20000);
  }
}

TEST_CASE("compact rejects keep sets and token lists that do not fit the cache") {
  std::mt19937 rng(14);
  const std::int64_t n = 10;
  auto c = make_case(layout::nhd, dtype::f32, n, 2, 4, rng);
  auto tokens = numbered_tokens(n, 0);
  keep_set wrong_n(n + 1);
  wrong_n.add_unit(std::vector<std::int64_t>{0, 1});
  CHECK_THROWS_WITH_AS(cpu::compact(c.kv, tokens, wrong_n), doctest::Contains("keep.n_slots = 11"), error);
  keep_set three(n);
  for (int u = 0; u < 3; ++u) three.add_unit(std::vector<std::int64_t>{1, 2});
  CHECK_THROWS_WITH_AS(cpu::compact(c.kv, tokens, three), doctest::Contains("keep.n_units = 3"), error);
  keep_set uneven(n);
  uneven.add_unit(std::vector<std::int64_t>{1, 2});
  uneven.add_unit(std::vector<std::int64_t>{1});
  CHECK_THROWS_WITH_AS(cpu::compact(c.kv, tokens, uneven), doctest::Contains("keep.size(1) = 1"), error);
  keep_set per_head(n);
  per_head.add_unit(std::vector<std::int64_t>{1, 2});
  per_head.add_unit(std::vector<std::int64_t>{3, 4});
  CHECK_THROWS_WITH_AS(cpu::compact(c.kv, tokens, per_head), doctest::Contains("one token list per head"), error);
  std::vector<token> short_tokens(n - 1);
  keep_set one(n);
  one.add_unit(std::vector<std::int64_t>{0});
  CHECK_THROWS_WITH_AS(cpu::compact(c.kv, short_tokens, one), doctest::Contains("tokens.size() = 9"), error);
  CHECK(c.k == c.k0);  // nothing moved by a rejected call
}

// ---------------------------------------------------------------------------------------------
// Paged caches.

namespace {

struct paged_case {
  std::int32_t page_size = 4, heads = 2, d = 8, n_pages = 16;
  dtype type = dtype::f16;
  std::vector<std::uint8_t> k, v;
  std::vector<std::int32_t> indptr, indices, last;
  paged_view p{};
  std::vector<std::vector<token>> tokens;

  /// Sequences of the given lengths on shuffled (non-sequential) page ids; `hnd_pages` lays each
  /// page out head-major.
  paged_case(const std::vector<std::int64_t>& lens, bool hnd_pages, std::mt19937& rng) {
    const std::int64_t page_elems = std::int64_t(page_size) * heads * d;
    k = random_elements(type, n_pages * page_elems, rng);
    v = random_elements(type, n_pages * page_elems, rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n_pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    indptr.push_back(0);
    std::size_t next = 0;
    for (std::size_t s = 0; s < lens.size(); ++s) {
      const auto pages = std::int32_t((lens[s] + page_size - 1) / page_size);
      for (std::int32_t i = 0; i < pages; ++i) indices.push_back(ids[next++]);
      indptr.push_back(indptr.back() + pages);
      last.push_back(pages == 0 ? 0 : std::int32_t(lens[s] - std::int64_t(pages - 1) * page_size));
      tokens.push_back(numbered_tokens(lens[s], 10000 * std::int64_t(s)));
    }
    const page_storage ks = hnd_pages ? page_storage{k.data(), page_elems, d, std::int64_t(page_size) * d}
                                      : page_storage{k.data(), page_elems, std::int64_t(heads) * d, d};
    page_storage vs = ks;
    vs.data = v.data();
    p = {ks,         vs, type, heads, d, page_size, std::int32_t(lens.size()), n_pages, indptr.data(), indices.data(),
         last.data()};
  }

  /// Bytes of every (slot, head) row of sequence s, keys then values.
  std::vector<std::vector<std::uint8_t>> rows(std::int32_t s) const {
    std::vector<std::vector<std::uint8_t>> out;
    const std::size_t bytes = std::size_t(d) * size_of(type);
    for (const auto& r : {key_rows(p, s), value_rows(p, s)})
      for (std::int64_t j = 0; j < r.n_slots; ++j)
        for (std::int32_t h = 0; h < heads; ++h) {
          const auto* b = static_cast<const std::uint8_t*>(r.row(j, h));
          out.emplace_back(b, b + bytes);
        }
    return out;
  }
  std::vector<std::int32_t> pages_of(std::int32_t s) const {
    return {p.indices + p.indptr[s], p.indices + p.indptr[s + 1]};
  }
};

/// Compacts sequence `seq` and checks everything the paged compaction promises.
void check_paged_compact(paged_case& c, std::int32_t seq, const std::vector<std::int64_t>& slots) {
  const std::int32_t n_seqs = c.p.n_seqs;
  const std::int64_t n = c.p.seq_len(seq), m = std::int64_t(slots.size());
  std::vector<std::vector<std::vector<std::uint8_t>>> before;
  std::vector<std::vector<std::int32_t>> pages_before;
  for (std::int32_t s = 0; s < n_seqs; ++s) before.push_back(c.rows(s)), pages_before.push_back(c.pages_of(s));
  const auto tokens0 = c.tokens[std::size_t(seq)];
  keep_set keep(n);
  keep.add_unit(slots);
  const auto table_before = c.indices;
  const std::vector<std::int32_t> starts(c.p.indptr, c.p.indptr + n_seqs + 1);
  CHECK(cpu::compact(key_rows(c.p, seq), value_rows(c.p, seq), c.tokens[std::size_t(seq)], keep) == m);
  c.tokens[std::size_t(seq)].resize(std::size_t(m));
  CHECK(c.indices == table_before);  // the page table is the engine's: untouched
  CHECK(std::vector<std::int32_t>(c.p.indptr, c.p.indptr + n_seqs + 1) == starts);

  // The engine takes back the sequence's last pages_freed pages and shortens its list.
  const auto pages_after = std::size_t((m + c.page_size - 1) / c.page_size);
  const auto& old_pages = pages_before[std::size_t(seq)];
  const std::int64_t drop = pages_freed(n, m, c.page_size);
  CHECK(std::size_t(drop) == old_pages.size() - pages_after);
  const std::int32_t end = c.p.indptr[n_seqs];
  std::memmove(c.p.indices + c.p.indptr[seq + 1] - drop, c.p.indices + c.p.indptr[seq + 1],
               std::size_t(end - c.p.indptr[seq + 1]) * sizeof(std::int32_t));
  for (std::int32_t s = seq + 1; s <= n_seqs; ++s) c.p.indptr[s] -= std::int32_t(drop);
  c.p.last_page_len[seq] = m == 0 ? 0 : std::int32_t(m - std::int64_t(pages_after - 1) * c.page_size);

  CHECK(c.pages_of(seq) ==
        std::vector<std::int32_t>(old_pages.begin(), old_pages.begin() + std::ptrdiff_t(pages_after)));
  CHECK(c.p.seq_len(seq) == m);
  CHECK(c.p.indptr[0] == 0);
  CHECK_NOTHROW(validate(c.p, "paged"));
  const std::size_t row_count = std::size_t(n) * std::size_t(c.heads);
  const auto after = c.rows(seq);
  REQUIRE(after.size() == 2 * std::size_t(m) * std::size_t(c.heads));
  for (std::int64_t i = 0; i < m; ++i) {
    const auto src = slots[std::size_t(i)];
    CHECK(c.tokens[std::size_t(seq)][std::size_t(i)].pos == tokens0[std::size_t(src)].pos);
    for (std::int32_t h = 0; h < c.heads; ++h) {
      const auto dst_k = std::size_t(i * c.heads + h), src_k = std::size_t(src * c.heads + h);
      CHECK(after[dst_k] == before[std::size_t(seq)][src_k]);
      CHECK(after[std::size_t(m) * std::size_t(c.heads) + dst_k] == before[std::size_t(seq)][row_count + src_k]);
    }
  }
  for (std::int32_t s = 0; s < n_seqs; ++s) {
    if (s == seq) continue;
    CAPTURE(s);
    CHECK(c.pages_of(s) == pages_before[std::size_t(s)]);  // same page ids, shifted in the table
    CHECK(c.rows(s) == before[std::size_t(s)]);            // data untouched
  }
}

}  // namespace

TEST_CASE("paged compact keeps the chosen slots in order in the first pages and leaves the table to the engine") {
  const std::vector<std::int64_t> lens{10, 7, 13, 5};
  for (bool hnd_pages : {false, true}) {
    CAPTURE(hnd_pages);
    std::mt19937 rng(hnd_pages ? 21 : 22);
    {  // middle sequences, scattered slots
      paged_case c(lens, hnd_pages, rng);
      check_paged_compact(c, 1, {0, 2, 3, 6});         // 2 pages -> 1, full last page
      check_paged_compact(c, 2, {1, 4, 5, 8, 9, 12});  // 4 pages -> 2
    }
    {  // first sequence: every later one shifts down
      paged_case c(lens, hnd_pages, rng);
      check_paged_compact(c, 0, {3, 7, 9});
    }
    {  // last sequence
      paged_case c(lens, hnd_pages, rng);
      check_paged_compact(c, 3, {4});
    }
    {  // keeping no slot frees every page; an empty sequence stays empty
      paged_case c(lens, hnd_pages, rng);
      check_paged_compact(c, 0, {});
      CHECK(c.p.indptr[1] == 0);
      check_paged_compact(c, 2, {});
      check_paged_compact(c, 0, {});
      CHECK(c.p.indptr[4] == 4);  // only the pages of sequences 1 and 3 remain
    }
    {  // keeping every slot changes nothing
      paged_case c(lens, hnd_pages, rng);
      std::vector<std::int64_t> all(13);
      std::iota(all.begin(), all.end(), std::int64_t{0});
      const auto indices0 = c.indices;
      check_paged_compact(c, 2, all);
      CHECK(c.indices == indices0);
    }
    {  // repeated compaction of every sequence
      paged_case c(lens, hnd_pages, rng);
      for (int round = 0; round < 3; ++round)
        for (std::int32_t s = 0; s < c.p.n_seqs; ++s) {
          const std::int64_t n = c.p.seq_len(s);
          check_paged_compact(c, s, random_subset(n, n * 2 / 3, rng));
        }
    }
  }
}

TEST_CASE("paged compact rejects a bad sequence index or keep set") {
  std::mt19937 rng(23);
  paged_case c({6, 3}, false, rng);
  keep_set keep(6);
  keep.add_unit(std::vector<std::int64_t>{1});
  CHECK_THROWS_WITH_AS(cpu::compact(key_rows(c.p, 2), paged_rows{}, c.tokens[0], keep), doctest::Contains("seq = 2"),
                       error);
  CHECK_THROWS_WITH_AS(cpu::compact(key_rows(c.p, 1), value_rows(c.p, 1), c.tokens[1], keep),
                       doctest::Contains("keep.n_slots = 6"), error);
  keep_set per_head(6);
  per_head.add_unit(std::vector<std::int64_t>{1});
  per_head.add_unit(std::vector<std::int64_t>{2});
  CHECK_THROWS_WITH_AS(cpu::compact(key_rows(c.p, 0), value_rows(c.p, 0), c.tokens[0], per_head),
                       doctest::Contains("keep.n_units = 2"), error);
  CHECK_THROWS_WITH_AS(cpu::compact(key_rows(c.p, 0), value_rows(c.p, 1), c.tokens[0], keep),
                       doctest::Contains("v.n_slots = 3"), error);
  const std::int64_t bad_slots[] = {3, 1}, offsets[] = {0, 2};
  CHECK_THROWS_WITH_AS(cpu::compact(key_rows(c.p, 0), value_rows(c.p, 0), c.tokens[0], {bad_slots, offsets, 1, 6}),
                       doctest::Contains("keep.unit(0)[1] = 1"), error);
}
