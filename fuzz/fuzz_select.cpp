// Fuzz target: selection for every registered policy and granularity on hostile shapes, values
// (NaN, Inf, denormals, huge and tiny scales), positions and budgets, on contiguous and paged
// views. Either infkv raises an infkv::error, or each unit keeps min(n, budget) slots, strictly
// increasing and in range, the protected sinks and recent tokens among them; and the CUDA
// backend's steps (run on the host) keep the same sets from the same finished scores.
#include <cstdint>
#include <string>
#include <vector>

#include <infkv/cpu.hpp>
#include <infkv/cuda/detail/steps.hpp>

#include "cuda/host_launcher.hpp"
#include "input.hpp"
#include "policy_registry.hpp"

using namespace infkv;

namespace {

/// Rows [n][heads][d] of type t, NHD or in pages of 4 slots (pages in reverse order).
struct cache {
  std::vector<std::uint8_t> bytes;
  std::vector<std::int32_t> pages;
  tensor_view tensor{};
  paged_rows paged{};
  cache(infkv_fuzz::input& in, std::int64_t n, std::int32_t heads, std::int32_t d, dtype t, bool hostile) {
    const std::int64_t rows = (n + 3) / 4 * 4 * heads;
    bytes.resize(std::size_t(std::max<std::int64_t>(rows * d, 1)) * size_of(t));
    for (std::int64_t i = 0; i < rows * d; ++i) {
      const float x = hostile ? in.hostile_float() : in.finite_float();
      from_f32(t, &x, bytes.data() + i * std::int64_t(size_of(t)), 1);
    }
    tensor = nhd(bytes.data(), t, n, heads, d);
    for (std::int64_t p = (n + 3) / 4 - 1; p >= 0; --p) pages.push_back(std::int32_t(p));
    paged = {{bytes.data(), 4 * std::int64_t(heads) * d, std::int64_t(heads) * d, d}, pages.data(), t, n, heads, d, 4};
  }
};

template <class R>
void check(const layer_inputs<R>& in, const budget& b, granularity g) {
  infkv_test::for_each_policy(in, [&](const std::string&, const auto& pol, const auto& with) {
    const auto inputs = with(in);
    keep_set k;
    try {
      k = cpu::select(pol, b, inputs, g);
    } catch (const infkv::error&) {
      return;
    }
    const std::int64_t n = std::int64_t(in.tokens.size());
    const budget kept = protect(pol, b);
    const std::int64_t cap = kept.keep_count(n);
    const auto order = time_order(in.tokens);
    for (std::int64_t u = 0; u < k.n_units(); ++u) {
      const auto s = k.unit(u);
      INFKV_FUZZ_ASSERT(std::int64_t(s.size()) == cap);
      const auto mask = k.mask(u);
      if (cap < n)
        for (std::int64_t i = 0; i < n; ++i)
          if (i < kept.sinks || i >= n - kept.recent) INFKV_FUZZ_ASSERT(mask[std::size_t(order[std::size_t(i)])]);
    }
    // The CUDA steps on the host keep the same sets as the CPU from the CPU's finished scores.
    if (g != granularity::per_head) return;
    const cpu::backend cb{};
    const plan p = make_plan(cb, pol, b, shape_of(inputs), {.g = g});
    cpu::workspace ws(p.workspace_bytes);
    const score_view s = run_scores(p, cb, inputs, ws.span());
    score_matrix scores(s.rows, s.cols);
    for (std::int64_t r = 0; r < s.rows; ++r) std::copy(s.row(r), s.row(r) + n, scores.row(r).begin());
    layer_inputs<> fixed;
    fixed.tokens = in.tokens, fixed.accumulated = scores.view();
    const policy_spec spec{.name = "fixed",
                           .score = {.source = score_source::accumulated},
                           .protect_sinks = pol.spec().protect_sinks,
                           .protect_recent = pol.spec().protect_recent};
    cuda::status_word status = cuda::status_ok;
    infkv_test::host_cuda_backend gb{{}, &status};
    gb.position_bits = 63;                         // the fuzzed positions go up to max_position, which the CPU takes
    gb.select_threads = 32, gb.select_slice = 16;  // narrow blocks (fibers on the host), many parts
    const plan gp = make_plan(gb, spec, b, shape_of(fixed), {.g = g});
    cpu::workspace gws(gp.workspace_bytes);
    std::vector<std::int64_t> offsets(std::size_t(gp.offsets_size())), slots(std::size_t(gp.kept_total));
    const keep_view out{slots.data(), offsets.data(), gp.units, n};
    try {
      run(gp, gb, std::span<const layer_inputs<>>(&fixed, 1), gws.span(), out);
    } catch (const infkv::error& e) {
      std::fputs(e.what(), stderr);
      INFKV_FUZZ_ASSERT(false);  // the CPU accepted these scores
    }
    INFKV_FUZZ_ASSERT(cuda::decode(status).ok());  // the CPU found nothing wrong either
    INFKV_FUZZ_ASSERT(keep_set::from_view(out) == k);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  infkv_fuzz::input in(data, size);
  const std::int64_t n = in.range(0, 90), nq = in.range(0, 6);
  const auto hkv = std::int32_t(in.range(1, 3)), group = std::int32_t(in.range(1, 3)), d = std::int32_t(in.range(1, 9));
  const dtype t = dtype(in.range(0, 2));
  const bool hostile = in.range(0, 3) == 0;
  const cache keys(in, n, hkv, d, t, hostile), queries(in, nq, hkv * group, d, t, hostile);
  std::vector<token> tokens(static_cast<std::size_t>(n));
  for (auto& x : tokens)
    x = {in.range(0, 7) == 0 ? in.hostile_int() : in.range(0, 120), std::int32_t(in.range(0, 3)), modality::text};
  std::vector<std::int64_t> qpos(static_cast<std::size_t>(nq));
  for (auto& x : qpos) x = in.flag() ? in.hostile_int() : in.range(0, 130);
  budget b;
  if (in.flag())
    b.capacity = in.flag() ? in.hostile_int() : in.range(0, 100);
  else
    b.ratio = in.flag() ? double(in.hostile_float()) : double(in.range(0, 100)) / 100.0;
  b.sinks = in.flag() ? in.hostile_int() : in.range(0, 6);
  b.recent = in.flag() ? in.hostile_int() : in.range(0, 10);
  const granularity g = granularity(in.range(0, 2));
  const float scale = in.flag() ? in.hostile_float() : 0.f;
  try {  // the registry's H2O states observe the inputs first, which may raise too
    if (in.flag())
      check(layer_inputs<>{keys.tensor, {}, queries.tensor, qpos, tokens, scale}, b, g);
    else
      check(layer_inputs<const_paged_rows>{keys.paged, {}, queries.tensor, qpos, tokens, scale}, b, g);
  } catch (const infkv::error&) {
  }
  return 0;
}
