// Fuzz target: view construction and validation. A strided tensor view that `validate` accepts
// has non-overlapping rows (checked element by element); a paged table that `validate` accepts
// only addresses its pool: every row of every sequence lies inside the pages it names.
#include <cstdint>
#include <vector>

#include <infkv/kv_view.hpp>

#include "input.hpp"

using namespace infkv;

namespace {

void strided(infkv_fuzz::input& in) {
  tensor_view v{};
  v.type = dtype(in.range(0, 2));
  v.n_slots = in.flag() ? in.hostile_int() : in.range(0, 40);
  v.n_heads = std::int32_t(in.flag() ? in.hostile_int() : in.range(0, 6));
  v.head_dim = std::int32_t(in.flag() ? in.hostile_int() : in.range(0, 12));
  v.slot_stride = in.flag() ? in.hostile_int() : in.range(-3, 90);
  v.head_stride = in.flag() ? in.hostile_int() : in.range(-3, 90);
  std::vector<std::uint8_t> byte(1);
  v.data = byte.data();
  try {
    validate(v, "keys");
  } catch (const infkv::error&) {
    return;
  }
  if (v.n_slots > 40 || v.n_heads > 6 || v.head_dim > 12) return;      // the check below is brute force
  if (v.slot_stride > (1 << 16) || v.head_stride > (1 << 16)) return;  // spans too large to mark element by element
  INFKV_FUZZ_ASSERT(v.slot_stride >= 0 || v.n_slots <= 1);
  INFKV_FUZZ_ASSERT(v.head_stride >= 0 || v.n_heads <= 1);
  std::vector<int> owner;
  for (std::int64_t j = 0; j < v.n_slots; ++j)
    for (std::int64_t h = 0; h < v.n_heads; ++h)
      for (std::int64_t e = 0; e < v.head_dim; ++e) {
        const std::int64_t at = j * v.slot_stride + h * v.head_stride + e;
        INFKV_FUZZ_ASSERT(at >= 0);
        if (at >= std::int64_t(owner.size())) owner.resize(std::size_t(at + 1), -1);
        const int row = int(j * v.n_heads + h);
        INFKV_FUZZ_ASSERT(owner[std::size_t(at)] == -1 || owner[std::size_t(at)] == row);  // rows do not overlap
        owner[std::size_t(at)] = row;
      }
}

void paged(infkv_fuzz::input& in) {
  paged_view p{};
  p.type = dtype(in.range(0, 2));
  p.n_heads = std::int32_t(in.range(-1, 3));
  p.head_dim = std::int32_t(in.range(-1, 5));
  p.page_size = std::int32_t(in.flag() ? in.hostile_int() : in.range(-1, 5));
  p.n_seqs = std::int32_t(in.range(-1, 4));
  p.n_pages = std::int32_t(in.range(-1, 8));
  std::vector<std::int32_t> indptr(std::size_t(std::max(p.n_seqs, 0) + 1)), last(std::size_t(std::max(p.n_seqs, 0)));
  for (auto& x : indptr) x = std::int32_t(in.flag() ? in.hostile_int() : in.range(-2, 10));
  for (auto& x : last) x = std::int32_t(in.range(-2, 7));
  std::vector<std::int32_t> indices(16);
  for (auto& x : indices) x = std::int32_t(in.range(-2, 9));
  p.k.slot_stride = in.range(-2, 20);
  p.k.head_stride = in.range(-2, 8);
  p.k.page_stride = in.range(-2, 120);
  // The pool: n_pages pages of page_stride elements; a row read outside it is a finding.
  const std::int64_t elems = std::max<std::int64_t>(p.n_pages, 0) * std::max<std::int64_t>(p.k.page_stride, 0);
  std::vector<std::uint8_t> pool(std::size_t(std::max<std::int64_t>(elems, 1)) * size_of(p.type));
  p.k.data = pool.data();
  p.indptr = indptr.data(), p.last_page_len = last.data(), p.indices = indices.data();
  if (std::int64_t(indptr.back()) > std::int64_t(indices.size()) || indptr.back() < 0) return;  // the caller's arrays
  try {
    validate(p, "paged");
  } catch (const infkv::error&) {
    return;
  }
  for (std::int32_t s = 0; s < p.n_seqs; ++s) {
    const paged_rows r = key_rows(p, s);
    INFKV_FUZZ_ASSERT(r.n_slots >= 0);
    for (std::int64_t j = 0; j < r.n_slots; ++j)
      for (std::int32_t h = 0; h < r.n_heads; ++h) {
        const auto* first = static_cast<const std::uint8_t*>(r.row(j, h));
        const auto* last_byte = first + std::int64_t(r.head_dim) * std::int64_t(size_of(r.type)) - 1;
        INFKV_FUZZ_ASSERT(first >= pool.data() && last_byte < pool.data() + pool.size());
      }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  infkv_fuzz::input in(data, size);
  if (in.flag())
    strided(in);
  else
    paged(in);
  return 0;
}
