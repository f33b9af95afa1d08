// Inputs the fuzz targets (fuzz/, scripts/fuzz.sh) found to overflow, read out of bounds or be
// refused wrongly, each now an error naming the argument (or accepted, where it was valid).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

#define CHECK_ERROR(expr, text) CHECK_THROWS_WITH_AS(expr, doctest::Contains(text), infkv::invalid_argument)

namespace {
constexpr std::int64_t huge = std::numeric_limits<std::int64_t>::max();
}

TEST_CASE("fuzz views: strides whose products overflow are refused, not wrapped") {
  float x = 0;
  // fuzz_views: head_stride x n_slots overflowed in the overlap check (UBSan).
  CHECK_ERROR(validate(tensor_view{&x, dtype::f32, 59, 3, 4, 4, huge}, "keys"), "keys.");
  CHECK_ERROR(validate(tensor_view{&x, dtype::f32, 3, 2, 4, std::int64_t(1) << 61, 4}, "keys"), "more than 2^62 bytes");
  CHECK_NOTHROW(validate(tensor_view{&x, dtype::f32, 3, 2, 4, 8, 4}, "keys"));
}

TEST_CASE("fuzz views: a paged table whose rows leave their page, or whose indptr overflows, is refused") {
  std::vector<float> pool(64);
  std::vector<std::int32_t> indptr{0, 2}, indices{0, 1}, last{2};
  paged_view p{{pool.data(), 8, 4, 2}, {}, dtype::f32, 2, 2, 2, 1, 2, indptr.data(), indices.data(), last.data()};
  CHECK_NOTHROW(validate(p, "paged"));
  p.k.page_stride = 5;  // a page's rows span 1 x 4 + 1 x 2 + 2 = 8 elements
  CHECK_ERROR(validate(p, "paged"), "paged.k.page_stride = 5");
  p.k.page_stride = 8, p.k.slot_stride = 1;  // rows of a page overlap
  CHECK_ERROR(validate(p, "paged"), "paged.k.");
  p.k.slot_stride = 4;
  std::vector<std::int32_t> wrap{0, std::numeric_limits<std::int32_t>::max(),
                                 -std::numeric_limits<std::int32_t>::max()};
  std::vector<std::int32_t> last2{2, 2};
  p.n_seqs = 2, p.indptr = wrap.data(), p.last_page_len = last2.data();
  CHECK_ERROR(validate(p, "paged"), "paged.indptr[2]");
}

TEST_CASE("fuzz runs / select: positions past 2^62 and sinks or recent near the int64 limit are refused") {
  std::vector<token> t = text_tokens(4);
  t[2].pos = huge;  // fuzz_runs: run end = pos + 1 overflowed
  CHECK_ERROR(validate_tokens(t, 4), "tokens[2].pos = 9223372036854775807");
  keep_set k(4);
  k.add_unit(std::vector<std::int64_t>{0, 2});
  CHECK_ERROR(k.evicted_runs(t), "tokens[2].pos");
  t[2].pos = max_position;
  CHECK_NOTHROW(validate_tokens(t, 4));
  // fuzz_select: capacity >= sinks + recent overflowed.
  CHECK_ERROR((budget{.capacity = 10, .sinks = huge, .recent = 4}.validate()), "budget.sinks");
  CHECK_ERROR((budget{.ratio = 0.5, .sinks = 4, .recent = huge}.keep_count(10)), "budget.recent");
}

TEST_CASE("fuzz select: an empty cache with an accumulated (H2O-style) source plans and runs") {
  const cpu::backend be{};
  score_matrix acc(3, 0);  // 3 heads, no slots: data() may be null
  layer_inputs<> in;
  in.accumulated = acc.view();
  const policy_spec spec{.name = "fixed", .score = {.source = score_source::accumulated}};
  const plan p = make_plan(be, spec, budget{.capacity = 4}, shape_of(in), {.g = granularity::per_head});
  CHECK(p.units == 3);
  cpu::workspace ws(p.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(p.offsets_size()), -1);
  run(p, be, std::span<const layer_inputs<>>(&in, 1), ws.span(), {nullptr, offsets.data(), 3, 0});
  CHECK(offsets == std::vector<std::int64_t>{0, 0, 0, 0});
}

TEST_CASE("fuzz trace: 16-bit conversions read and write at any alignment") {
  // fuzz_trace: to_f32 loaded f16 values through a misaligned uint16_t pointer (UBSan).
  const std::vector<float> x = {1.f, -2.f, 0.5f, 3.25f, -0.125f, 65504.f, 1e-3f, 7.f, -9.5f, 0.f, 2.f};
  for (dtype t : {dtype::f16, dtype::bf16}) {
    std::vector<unsigned char> aligned(2 * x.size()), odd(2 * x.size() + 1);
    from_f32(t, x.data(), aligned.data(), std::int64_t(x.size()));
    from_f32(t, x.data(), odd.data() + 1, std::int64_t(x.size()));
    CHECK(std::equal(aligned.begin(), aligned.end(), odd.begin() + 1));
    std::vector<float> a(x.size()), b(x.size());
    to_f32(t, aligned.data(), a.data(), std::int64_t(x.size()));
    to_f32(t, odd.data() + 1, b.data(), std::int64_t(x.size()));
    CHECK(a == b);
    CHECK(a[2] == 0.5f);
  }
}
