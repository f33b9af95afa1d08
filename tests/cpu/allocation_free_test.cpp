// plan / run with a caller workspace allocates nothing: this translation unit replaces the global
// operator new with one that counts calls made by the current thread while counting is on, and
// every registered policy runs through the pipeline (one thread, contiguous and paged keys, one
// layer and several, AdaKV capacities) with the count checked to stay 0.
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

namespace {
thread_local bool counting = false;
thread_local std::size_t allocations = 0;

void* counted(std::size_t n, std::size_t align) {
  if (counting) ++allocations;
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (std::max<std::size_t>(n, 1) + align - 1) / align * align)
                : std::malloc(std::max<std::size_t>(n, 1));
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(std::size_t n) { return counted(n, 0); }
void* operator new[](std::size_t n) { return counted(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return counted(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted(n, std::size_t(a)); }
// The nothrow forms too (std::stable_sort's buffer): every form must pair with the free below.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counted(n, 0);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

using namespace infkv;
using namespace infkv_test;

namespace {

/// Allocations the current thread makes while f runs.
template <class F>
std::size_t allocations_in(F&& f) {
  allocations = 0;
  counting = true;
  try {
    f();
  } catch (...) {
    counting = false;
    throw;
  }
  counting = false;
  return allocations;
}

/// Plans, allocates every buffer, then checks that run (and run_scores) allocate nothing.
template <class P, class R>
void check_run(const P& pol, std::span<const layer_inputs<R>> layers, const budget& b, plan_options opt) {
  const cpu::backend be{cpu::executor{1}};
  const plan pl = make_plan(be, pol, b, shape_of(layers[0]), opt);
  cpu::workspace ws(pl.workspace_bytes);
  std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size()), -1), slots(std::size_t(pl.kept_total), -1);
  const keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
  CHECK(allocations_in([&] { run(pl, be, layers, ws.span(), out); }) == 0);
  // The result is the convenience call's (which allocates), so the run did its job.
  if (opt.n_layers == 1 && !opt.adakv) CHECK(keep_set::from_view(out) == cpu::select(pol, b, layers[0], opt.g, opt.r));
  if (opt.n_layers == 1) {
    score_view s;
    CHECK(allocations_in([&] { s = run_scores(pl, be, layers[0], ws.span()); }) == 0);
    CHECK((s.rows == pl.finished_rows && s.cols == pl.shape.n_slots));
  }
}

}  // namespace

TEST_CASE("the counting allocator sees allocations") {
  CHECK(allocations_in([] { std::vector<int> v(10); }) == 1);
  const auto tokens = text_tokens(8);
  const layer_inputs<> in{.tokens = tokens};
  CHECK(allocations_in([&] { (void)cpu::select(streaming_llm{}, budget{.capacity = 4}, in); }) >
        0);  // the convenience call does
}

TEST_CASE("plan / run with a caller workspace allocates nothing, for every policy") {
  const problem p = make_problem(31, 300, 2, 2, 16, 6, dtype::f16);
  const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
  const stored paged = store(p.k, p.n, p.hkv, p.d, p.type, layout::paged);
  const stored queries = store_queries(p);
  const layer_inputs<> in{keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const layer_inputs<const_paged_rows> in_paged{key_rows(paged.paged, 1), {}, queries.tensor, p.qpos, p.tokens, 0.f};
  const budget b{.capacity = 100, .sinks = 4, .recent = 8};
  for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
    INFO(name);
    const auto one = with(in);
    const auto one_paged = with(in_paged);
    for (granularity g : {granularity::per_head, granularity::per_layer, granularity::per_token}) {
      check_run(pol, std::span<const layer_inputs<>>(&one, 1), b, {.g = g});
      check_run(pol, std::span<const layer_inputs<const_paged_rows>>(&one_paged, 1), b, {.g = g, .r = reduction::max});
    }
    const std::vector<layer_inputs<>> three(3, one);  // one per-token decision over three layers
    check_run(pol, std::span<const layer_inputs<>>(three), b, {.g = granularity::per_token, .n_layers = 3});
    if (pol.spec().natural == granularity::per_head && pol.spec().score.source != score_source::recency)
      check_run(pol, std::span<const layer_inputs<>>(&one, 1), b,
                {.g = granularity::per_head, .adakv = adakv{.alpha = 0.2}});
  });
}
