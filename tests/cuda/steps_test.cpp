// The CUDA backend's steps (the bodies its kernels run) executed on the host and compared with
// the CPU backend: finished scores of every registered policy within float tolerance on every
// view and element type, keep sets identical given equal scores (ties, -0 / +0, AdaKV, several
// layers), compaction byte-identical, re-rotation within rounding, and every device fault
// recorded and described. No GPU needed: this is what CI runs of the CUDA code.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "batch_cases.hpp"
#include "cpu/reference_helpers.hpp"
#include "cuda/host_launcher.hpp"
#include "policy_registry.hpp"

using namespace infkv;
using namespace infkv_test;

namespace {

/// A CUDA backend run on the host records faults in a host status word (a device one on a GPU).
/// Selection blocks of 32 threads: the host emulates every thread of a block as a fiber, so the
/// tests that run thousands of small selections take the narrowest blocks (the selection's own
/// test covers 32 to 256).
host_cuda_backend narrow_selection(host_cuda_backend be) {
  be.select_threads = 32;
  return be;
}

template <class B>
B with_status(B be, cuda::status_word& word) {
  word = cuda::status_ok;
  if constexpr (requires { be.status; }) be.status = &word;
  return be;
}

template <class B0, class R>
score_matrix finished(const B0& be0, const policy_spec& spec, const layer_inputs<R>& in) {
  cuda::status_word word;
  const B0 be = with_status(be0, word);
  const plan pl = make_plan(be, spec, budget{.ratio = 1.0}, shape_of(in));
  cpu::workspace ws(pl.workspace_bytes);
  std::fill(ws.span().begin(), ws.span().begin() + std::ptrdiff_t(pl.workspace_bytes),
            std::byte{0xff});  // poison: NaN floats
  const score_view s = run_scores(pl, be, in, ws.span());
  score_matrix out(s.rows, s.cols);
  for (std::int64_t r = 0; r < s.rows; ++r) std::copy(s.row(r), s.row(r) + s.cols, out.row(r).begin());
  return out;
}

template <class B0, class R>
keep_set keep_of(const B0& be0, const policy_spec& spec, const budget& b, std::span<const layer_inputs<R>> layers,
                 plan_options opt, cuda::status* st = nullptr) {
  cuda::status_word word;
  const B0 be = with_status(be0, word);
  const plan pl = make_plan(be, spec, b, shape_of(layers[0]), opt);
  plan_buffers buf(pl);
  run(pl, be, layers, buf.ws.span(), buf.out);
  if (st) *st = cuda::decode(word);
  return keep_set::from_view(buf.out);
}

/// The selection primitive called directly on scores of units x n with a cap per unit, after the
/// backend's own time order; the status word when asked.
template <class B0>
keep_set select_direct(const B0& be0, const score_matrix& s, std::span<const token> tokens,
                       const std::vector<std::int64_t>& caps, const budget& keep, cuda::status* st = nullptr) {
  cuda::status_word word;
  const B0 be = with_status(be0, word);
  const std::int64_t n = s.cols, units = s.rows;
  const score_spec spec{.source = score_source::accumulated};
  cpu::workspace ws(
      be.scratch_bytes(spec, layer_shape{.n_slots = n, .kv_heads = std::int32_t(units)}, {.g = granularity::per_head}));
  std::vector<std::int64_t> order(static_cast<std::size_t>(n)), slots(static_cast<std::size_t>(units * n + 1)),
      offsets(static_cast<std::size_t>(units + 1));
  be.time_order(tokens, order.data(), ws.span());
  score_matrix copy = s;
  be.keep_top(copy.view(), tokens, order.data(), caps.data(), n, keep,
              keep_view{slots.data(), offsets.data(), units, n}, ws.span());
  if (st) *st = cuda::decode(word);
  return keep_set::from_view(keep_view{slots.data(), offsets.data(), units, n});
}

/// AdaKV's capacities from the allocation primitive called directly, after the backend's time order.
template <class B0>
std::vector<std::int64_t> allocate_direct(const B0& be0, const adakv& a, const score_matrix& s,
                                          std::span<const token> tokens, const budget& keep, std::int64_t cap) {
  cuda::status_word word;
  const B0 be = with_status(be0, word);
  const std::int64_t n = s.cols, rows = s.rows;
  const score_spec spec{.source = score_source::accumulated};
  const plan_options opt{.g = granularity::per_head, .adakv = a};
  cpu::workspace ws(be.scratch_bytes(spec, layer_shape{.n_slots = n, .kv_heads = std::int32_t(rows)}, opt));
  std::vector<std::int64_t> order(static_cast<std::size_t>(n)), caps(static_cast<std::size_t>(rows), -1);
  be.time_order(tokens, order.data(), ws.span());
  score_matrix copy = s;
  be.allocate(a, copy.view(), order.data(), keep, cap, caps.data(), ws.span());
  return caps;
}

/// Order-preserving bits of a float, written for the tests: ascending bits are descending scores
/// (-0 as +0).
std::uint32_t test_descending_bits(float x) {
  std::uint32_t u = 0;
  const float y = x == 0.f ? 0.f : x;
  std::memcpy(&u, &y, 4);
  const std::uint32_t up = u >> 31 ? ~u : u ^ 0x80000000u;  // ascending with the value
  return ~up;
}

ref_matrix as_ref(const score_matrix& m) {
  ref_matrix r(std::size_t(m.rows));
  for (std::int64_t i = 0; i < m.rows; ++i) r[std::size_t(i)].assign(m.row(i).begin(), m.row(i).end());
  return r;
}

}  // namespace

TEST_CASE("cuda steps (host): finished scores of every policy match the CPU backend on every view and type") {
  const cpu::backend cpu_be{};
  const host_cuda_backend gpu_be{};
  struct shape {
    std::int64_t n;
    std::int32_t hkv, group, d;
    std::int64_t nq;
  };
  int i = 0;
  for (const shape sh : {shape{37, 2, 2, 8, 6}, shape{600, 2, 3, 17, 5}, shape{300, 1, 4, 64, 9}})
    for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16})
      for (const layout lay : {layout::nhd, layout::hnd, layout::strided, layout::paged}) {
        const problem p = make_problem(100 + std::uint64_t(i++), sh.n, sh.hkv, sh.group, sh.d, sh.nq, t);
        const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay), queries = store_queries(p);
        keys.visit([&](const auto& k) {
          using R = std::decay_t<decltype(k)>;
          const layer_inputs<R> in{k, {}, queries.tensor, p.qpos, p.tokens, 0.f};
          const layer ly(p);
          for_each_policy(ly.in(), [&](const std::string& name, const auto& pol, const auto& with) {
            const auto inputs = with(in);
            const auto want = finished(cpu_be, pol.spec(), inputs), got = finished(gpu_be, pol.spec(), inputs);
            check_close(got, as_ref(want), 2e-4, 2e-6,
                        name + " n=" + std::to_string(p.n) + " " + to_string(t) + " " + to_string(lay));
          });
        });
      }
}

TEST_CASE("cuda steps (host): Expected Attention's two covariance forms match the CPU's, long windows too") {
  const cpu::backend cpu_be{};
  const host_cuda_backend gpu_be{host_launcher{.block = 37}};
  int i = 0;
  for (const std::int64_t m : {5, 90})
    for (const dtype t : {dtype::f32, dtype::f16}) {
      const problem p = make_problem(700 + std::uint64_t(i++), 130, 2, 2, 16, m, t);
      const layer ly(p);
      for (const auto form : {covariance_form::cheaper, covariance_form::projections, covariance_form::matrix}) {
        policy_spec spec = expected_attention{.window = m, .rotary = rope{.theta = 500.0}, .sinks = 3}.spec();
        spec.score.expect.form = form;
        spec.score.value_norm = false;
        check_close(finished(gpu_be, spec, ly.in()), as_ref(finished(cpu_be, spec, ly.in())), 2e-5, 2e-6,
                    "m=" + std::to_string(m) + " " + to_string(t) + " form " + std::to_string(int(form)));
      }
    }
}

TEST_CASE("cuda steps (host): value-weighted scores (Expected Attention, inf_mllm) match the CPU's") {
  const cpu::backend cpu_be{};
  int i = 0;
  for (const std::int32_t group : {1, 3})
    for (const dtype t : {dtype::f32, dtype::bf16})
      for (const layout lay : {layout::nhd, layout::paged}) {
        const problem p = make_problem(500 + std::uint64_t(i++), 300, 2, group, 16, 9, t);
        const host_cuda_backend gpu_be{host_launcher{.block = 1 + 50 * i}};
        std::vector<float> v(static_cast<std::size_t>(p.n * p.hkv * 24));
        for (std::size_t x = 0; x < v.size(); ++x) v[x] = round_to(t, std::sin(0.37f * float(x)) * float(1 + x % 5));
        const stored keys = store(p.k, p.n, p.hkv, p.d, t, lay), values = store(v, p.n, p.hkv, 24, t, lay),
                     queries = store_queries(p);
        keys.visit([&](const auto& k) {
          return values.visit([&](const auto& val) {
            using R = std::decay_t<decltype(k)>;
            if constexpr (std::is_same_v<R, std::decay_t<decltype(val)>>) {
              const layer_inputs<R> in{k, val, queries.tensor, p.qpos, p.tokens, 0.f};
              for (const policy_spec& spec :
                   {expected_attention{.window = 6, .future = 40, .sinks = 5}.spec(),
                    expected_attention{
                        .window = 9, .rotary = rope{.dims = 8, .style = rope_style::neox}, .covariance = false}
                        .spec(),
                    inf_mllm{.window = 5, .kernel = 3, .value_norm = true}.spec()})
                check_close(
                    finished(gpu_be, spec, in), as_ref(finished(cpu_be, spec, in)), 2e-4, 2e-6,
                    std::string(spec.name) + " " + to_string(t) + " " + to_string(lay) + " G=" + std::to_string(group));
            }
            return 0;
          });
        });
      }
}

TEST_CASE("cuda steps (host): given equal scores the keep sets are the CPU's, ties, signed zeros and unions included") {
  const cpu::backend cpu_be{};
  std::mt19937_64 gen(7);
  for (int round = 0; round < 60; ++round) {
    CAPTURE(round);
    const host_cuda_backend gpu_be = narrow_selection(host_cuda_backend{
        host_launcher{.block = std::int64_t(std::vector<int>{37, 1, 256, 5}[std::size_t(round % 4)])}});
    const std::int64_t n = 1 + std::int64_t(gen() % 700);
    const auto heads = std::int32_t(1 + gen() % 4);
    const auto tokens = random_tokens(gen, n);
    const std::vector<score_matrix> acc{tied_scores(gen, heads, n), tied_scores(gen, heads, n)};
    policy_spec spec{.name = "fixed", .score = {.source = score_source::accumulated}};
    if (round % 3 == 1) spec.score.pool = pooling::max, spec.score.kernel = 3;
    if (round % 3 == 2)
      spec.score.pool = pooling::avg, spec.score.kernel = 5, spec.score.pool_tail = spec.protect_recent = 3;
    std::vector<layer_inputs<>> layers(2);
    for (int l = 0; l < 2; ++l)
      layers[std::size_t(l)].tokens = tokens, layers[std::size_t(l)].accumulated = acc[std::size_t(l)].view();
    const budget b{.capacity = std::int64_t(gen() % std::uint64_t(n + 2)) + 4,
                   .sinks = std::int64_t(gen() % 3),
                   .recent = std::int64_t(gen() % 4)};
    for (const granularity g : {granularity::per_head, granularity::per_layer, granularity::per_token})
      for (const reduction r : {reduction::sum, reduction::mean, reduction::max}) {
        CAPTURE(to_string(g));
        const plan_options one{.g = g, .r = r};
        const std::span<const layer_inputs<>> first(layers.data(), 1);
        cuda::status st;
        CHECK(keep_of(gpu_be, spec, b, first, one, &st) == keep_of(cpu_be, spec, b, first, one));
        CHECK(st.ok());
        if (g == granularity::per_token) {
          const plan_options two{.g = g, .r = r, .n_layers = 2};
          CHECK(keep_of(gpu_be, spec, b, std::span<const layer_inputs<>>(layers), two) ==
                keep_of(cpu_be, spec, b, std::span<const layer_inputs<>>(layers), two));
        }
      }
    if (heads > 1 && b.capacity < n)
      for (const double alpha : {0.0, 0.3, 1.0}) {
        const plan_options ada{.g = granularity::per_head, .adakv = adakv{.alpha = alpha}};
        const std::span<const layer_inputs<>> first(layers.data(), 1);
        CHECK(keep_of(gpu_be, spec, b, first, ada) == keep_of(cpu_be, spec, b, first, ada));
      }
    const policy_spec u = union_of_finishes(spec, double(round % 5) / 4.0);
    for (const granularity g : {granularity::per_layer, granularity::per_token}) {
      CAPTURE(to_string(g));
      const std::span<const layer_inputs<>> first(layers.data(), 1);
      cuda::status st;
      CHECK(keep_of(gpu_be, u, b, first, {.g = g}, &st) == keep_of(cpu_be, u, b, first, {.g = g}));
      CHECK(st.ok());
    }
  }
}

TEST_CASE("cuda steps (host): tie ranks from the time order: many equal positions in random slot order, every cap") {
  // Equal scores (+0 and -0 among them) leave the tie rank alone to decide; one unit per cap, from
  // the protected count to every slot, exposes the whole rank order.
  const cpu::backend cpu_be{};
  std::mt19937_64 gen(23);
  for (int round = 0; round < 30; ++round) {
    CAPTURE(round);
    const host_cuda_backend gpu_be = narrow_selection(host_cuda_backend{
        host_launcher{.block = std::int64_t(std::vector<int>{37, 1, 256, 5, 64}[std::size_t(round % 5)])}});
    const std::int64_t n =
        std::vector<std::int64_t>{1, 2, 7, 33, 100, 257}[std::size_t(round % 6)] + std::int64_t(gen() % 3);
    const std::int64_t levels = 1 + std::int64_t(gen() % std::uint64_t(round % 3 == 0 ? 2 : n / 4 + 1));
    std::vector<token> tokens(static_cast<std::size_t>(n));
    for (auto& t : tokens) t = {std::int64_t(gen() % std::uint64_t(levels)) * 1000003, 0, modality::text};
    std::vector<std::int64_t> pos;
    for (const token& t : tokens) pos.push_back(t.pos);
    std::ranges::sort(pos);
    if (n > levels) REQUIRE(std::adjacent_find(pos.begin(), pos.end()) != pos.end());  // groups of equal positions
    const budget keep{.sinks = std::int64_t(gen() % 3), .recent = std::int64_t(gen() % 3)};
    const std::int64_t guarded = std::min(n, keep.sinks + keep.recent), units = n - guarded + 1;
    std::vector<std::int64_t> caps(static_cast<std::size_t>(units));
    std::iota(caps.begin(), caps.end(), guarded);
    score_matrix s(units, n, round % 2 ? 0.f : 1.5f);
    if (round % 2)
      for (float& x : s.data) x = gen() % 2 ? -0.f : 0.f;
    cuda::status st;
    const keep_set got = select_direct(gpu_be, s, tokens, caps, keep, &st);
    CHECK(got == select_direct(cpu_be, s, tokens, caps, keep));
    CHECK(st.ok());
    for (std::int64_t u = 0; u < units; ++u) CHECK(std::int64_t(got.unit(u).size()) == caps[std::size_t(u)]);
  }
}

TEST_CASE("cuda steps (host): the time order sorts the position bits it is promised, and names a position past them") {
  std::mt19937_64 gen(31);
  const std::int64_t n = 3000;
  std::vector<token> tokens(static_cast<std::size_t>(n));
  for (auto& t : tokens) t = {std::int64_t(gen() % (std::uint64_t(1) << 20)) / 7 * 7, 0, modality::text};  // repeats
  tokens[5].pos = (std::int64_t(1) << 20) - 1;
  std::vector<std::int64_t> want(static_cast<std::size_t>(n));
  time_order_into(tokens, want.data());
  const score_spec spec{.source = score_source::accumulated};
  cpu::workspace ws(host_cuda_backend{}.scratch_bytes(spec, layer_shape{.n_slots = n}));
  const auto order_with = [&](int bits, cuda::status* st) {
    cuda::status_word word;
    host_cuda_backend be = with_status(host_cuda_backend{}, word);
    be.position_bits = bits;
    std::vector<std::int64_t> order(static_cast<std::size_t>(n), -1);
    be.time_order(tokens, order.data(), ws.span());
    *st = cuda::decode(word);
    return order;
  };
  for (const int bits : {20, 24, 31, 63}) {
    CAPTURE(bits);
    cuda::status st;
    CHECK(order_with(bits, &st) == want);
    CHECK(st.ok());
  }
  // A position past the promise is recorded (a = 2, e = the bits) and named.
  cuda::status st;
  (void)order_with(19, &st);
  CHECK(st.kind == cuda::fault::bad_position);
  CHECK(st.a == 2);
  CHECK(st.e == 19);
  CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains("at or above 2^19"), infkv::invalid_argument);
  for (const std::int64_t slice : {std::int64_t(0), std::int64_t(4097)}) {  // the selection's slices
    host_cuda_backend be;
    be.select_slice = slice;
    CHECK_THROWS_WITH_AS((void)be.scratch_bytes(spec, layer_shape{.n_slots = n}),
                         doctest::Contains("backend.select_slice"), infkv::invalid_argument);
  }
  for (const int bits : {0, 64}) {
    host_cuda_backend be;
    cuda::status_word word = cuda::status_ok;
    be.status = &word, be.position_bits = bits;
    std::vector<std::int64_t> order(static_cast<std::size_t>(n));
    CHECK_THROWS_WITH_AS(be.time_order(tokens, order.data(), ws.span()), doctest::Contains("backend.position_bits"),
                         infkv::invalid_argument);
  }
}

TEST_CASE("cuda steps (host): heavy ties, caps of the protected count and of all slots, odd slot counts") {
  const cpu::backend cpu_be{};
  std::mt19937_64 gen(29);
  for (const std::int64_t n : {1, 3, 31, 32, 33, 255, 257, 1000, 4099})
    for (int round = 0; round < 3; ++round) {
      CAPTURE(n);
      CAPTURE(round);
      const host_cuda_backend gpu_be{host_launcher{.block = 1 + std::int64_t(gen() % 300)}};
      const auto units = std::int64_t(1 + gen() % 6);
      const auto tokens = random_tokens(gen, n);
      const budget keep{.sinks = std::int64_t(gen() % 4), .recent = std::int64_t(gen() % 5)};
      const std::int64_t guarded = std::min(n, keep.sinks + keep.recent);
      std::vector<std::int64_t> caps(static_cast<std::size_t>(units));
      for (std::int64_t u = 0; u < units; ++u) {
        const std::int64_t pick[] = {guarded, n, guarded + std::int64_t(gen() % std::uint64_t(n - guarded + 1)),
                                     std::max(guarded, n - 1)};
        caps[std::size_t(u)] = pick[(u + round) % 4];
      }
      const score_matrix s = tied_scores(gen, units, n);
      cuda::status st;
      CHECK(select_direct(gpu_be, s, tokens, caps, keep, &st) == select_direct(cpu_be, s, tokens, caps, keep));
      CHECK(st.ok());
    }
  SUBCASE("a NaN score of a later unit is recorded as before") {
    const host_cuda_backend gpu_be{};
    const auto tokens = random_tokens(gen, 90);
    score_matrix s = tied_scores(gen, 3, 90);
    s(2, 61) = std::numeric_limits<float>::quiet_NaN();
    cuda::status st;
    select_direct(gpu_be, s, tokens, {40, 40, 40}, budget{.sinks = 2, .recent = 2}, &st);
    CHECK((st.kind == cuda::fault::nan_score && st.a == 2 && st.b == 61));
  }
}

TEST_CASE("cuda steps (host): the selection's blocks keep the CPU's sets whatever their buffer, size and slice") {
  // Buffers of 0 and 7 candidate keys send every radix pass through the candidates' regions in
  // global memory, 100 and 8,192 hold them; blocks of 32 to 256 threads; slices of 33 to 4,096
  // slots (one part to hundreds per unit); distinct scores (done within the score digits), heavy
  // ties (rank digits), -inf (the last first digit) and single levels.
  const cpu::backend cpu_be{};
  std::mt19937_64 gen(41);
  const float levels[] = {-std::numeric_limits<float>::infinity(), -0.f, 0.f, 1.f, 1.5f};
  for (int round = 0; round < 24; ++round) {
    CAPTURE(round);
    host_cuda_backend gpu_be{host_launcher{.block = 1 + std::int64_t(gen() % 300)}};
    gpu_be.select_buffer = std::vector<std::int64_t>{0, 7, 100, 8192}[std::size_t(round % 4)];
    gpu_be.select_threads = std::vector<int>{32, 64, 256}[std::size_t(round % 3)];
    gpu_be.select_slice = std::vector<std::int64_t>{33, 100, 1000, 4096, 250}[std::size_t(round % 5)];
    const std::int64_t n = std::vector<std::int64_t>{1, 40, 700, 1100, 5000, 9000}[std::size_t(round % 6)];
    CAPTURE(n);
    const auto units = std::int64_t(1 + gen() % 3);
    const auto tokens = random_tokens(gen, n);
    const budget keep{.sinks = std::int64_t(gen() % 4), .recent = std::int64_t(gen() % 9)};
    const std::int64_t guarded = std::min(n, keep.sinks + keep.recent);
    std::vector<std::int64_t> caps(static_cast<std::size_t>(units));
    for (auto& c : caps)
      c = std::vector<std::int64_t>{guarded, n, guarded + std::int64_t(gen() % std::uint64_t(n - guarded + 1)),
                                    std::max(guarded, n - 1)}[gen() % 4];
    score_matrix s(units, n);
    const int kind = round / 4 % 3;
    for (float& x : s.data)
      x = kind == 0   ? std::ldexp(float(gen() % 1'000'000) + 1.f, -int(gen() % 30))  // mostly distinct
          : kind == 1 ? levels[gen() % 5]
                      : 0.25f;
    cuda::status st;
    const std::int64_t before = host_launcher::block_launches, each = host_launcher::each_launches;
    CHECK(select_direct(gpu_be, s, tokens, caps, keep, &st) == select_direct(cpu_be, s, tokens, caps, keep));
    CHECK(st.ok());
    CHECK(host_launcher::block_launches - before == 4);  // histogram, gather, finish, emit
    CHECK(host_launcher::each_launches - each == 2);     // the time order's keys, the tie ranks
  }
}

TEST_CASE("cuda steps (host): AdaKV over many heads: capacities and keep sets are the CPU's, tied remainders too") {
  const cpu::backend cpu_be{};
  std::mt19937_64 gen(31);
  int decided_by_ties = 0;
  for (int round = 0; round < 30; ++round) {
    CAPTURE(round);
    const host_cuda_backend gpu_be = narrow_selection(host_cuda_backend{
        host_launcher{.block = std::int64_t(std::vector<int>{37, 1, 256, 5}[std::size_t(round % 4)])}});
    const std::int64_t n = 20 + std::int64_t(gen() % 300), rows = 8 + std::int64_t(gen() % 57);
    const auto tokens = random_tokens(gen, n);
    const budget keep{.sinks = std::int64_t(gen() % 3), .recent = std::int64_t(gen() % 4)};
    const std::int64_t prot = keep.sinks + keep.recent;
    const std::int64_t cap = prot + std::int64_t(gen() % std::uint64_t(n - prot));  // < n
    // alpha 0.5: remainders of 0 or 0.5 only, so many rows tie; equal scores send the wins to the lower rows
    const double alpha = std::vector<double>{0.5, 0.25, 0.0, 1.0, 0.3, 0.5}[std::size_t(round % 6)];
    const score_matrix s = round % 3 == 0 ? score_matrix(rows, n, 1.f) : tied_scores(gen, rows, n);
    const adakv a{.alpha = alpha};
    const auto want = allocate_direct(cpu_be, a, s, tokens, keep, cap);
    const auto got = allocate_direct(gpu_be, a, s, tokens, keep, cap);
    CHECK(got == want);
    CHECK(std::accumulate(got.begin(), got.end(), std::int64_t{0}) == rows * cap);
    // The shares by a sort on the host: do equal remainders decide which rows round up?
    const auto order = time_order(tokens);
    std::vector<std::tuple<double, std::int64_t, std::int64_t>> cand;  // (-score, row, -time index)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = keep.sinks; i < n - keep.recent; ++i)
        cand.emplace_back(-double(s(r, order[std::size_t(i)])), r, -i);
    std::ranges::sort(cand);
    std::vector<double> wins(std::size_t(rows), 0.0);
    for (std::int64_t k = 0; k < rows * (cap - prot); ++k) wins[std::size_t(std::get<1>(cand[std::size_t(k)]))] += 1;
    bool tie_decides = false;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t q = r + 1; q < rows; ++q) {
        const double sr = wins[std::size_t(r)] * (1 - alpha) + alpha * double(cap - prot),
                     sq = wins[std::size_t(q)] * (1 - alpha) + alpha * double(cap - prot);
        const double fr = std::floor(sr + 1e-9), fq = std::floor(sq + 1e-9);
        if (sr - fr == sq - fq && double(want[std::size_t(r)] - prot) - fr != double(want[std::size_t(q)] - prot) - fq)
          tie_decides = true;
      }
    decided_by_ties += tie_decides ? 1 : 0;
    CHECK(select_direct(gpu_be, s, tokens, got, keep) == select_direct(cpu_be, s, tokens, want, keep));
    const budget b{.capacity = cap, .sinks = keep.sinks, .recent = keep.recent};
    layer_inputs<> in;
    in.tokens = tokens, in.accumulated = const_score_view{s.data.data(), rows, n, n};
    const policy_spec spec{.name = "fixed", .score = {.source = score_source::accumulated}};
    const plan_options ada{.g = granularity::per_head, .adakv = a};
    CHECK(keep_of(gpu_be, spec, b, std::span<const layer_inputs<>>(&in, 1), ada) ==
          keep_of(cpu_be, spec, b, std::span<const layer_inputs<>>(&in, 1), ada));
  }
  CHECK(decided_by_ties >= 5);
}

TEST_CASE("cuda steps (host): the radix select's bound is the wanted key of a sort on the host, plus one") {
  // Score keys (order-preserving float bits written here, then a tie rank) against a float64
  // sort by (score descending, rank); plain keys of 1 to 64 bits against a uint64 sort.
  std::mt19937_64 gen(37);
  for (int round = 0; round < 48; ++round) {
    CAPTURE(round);
    const host_cuda_backend be{host_launcher{.block = 1 + std::int64_t(gen() % 100)}};
    const std::int64_t segments = 1 + std::int64_t(gen() % 5);
    const std::int64_t len = std::vector<std::int64_t>{1, 31, 32, 33, 200, 1025}[std::size_t(round % 6)];
    const bool scores = round % 2 == 0;
    const int rb = len <= 1 ? 0 : int(std::bit_width(std::uint64_t(len - 1)));
    const int bits = scores ? 32 + rb : 1 + int(gen() % 64);
    CAPTURE(bits);
    std::vector<std::uint64_t> keys(std::size_t(segments * len), cuda::detail::no_key), expect;
    std::vector<std::int64_t> wanted;
    for (std::int64_t g = 0; g < segments; ++g) {
      std::vector<std::int64_t> at(static_cast<std::size_t>(len));
      std::iota(at.begin(), at.end(), std::int64_t{0});
      std::shuffle(at.begin(), at.end(), gen);
      std::vector<std::uint64_t> sorted;  // the candidates' keys in the reference order
      if (scores) {
        const float levels[] = {
            -0.f,   0.f,   1.f, -2.5f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
            3e-39f, -1e30f};
        struct item {
          double score;
          std::int64_t rank;
          std::uint64_t key;
        };
        std::vector<item> items;
        for (std::int64_t j = 0; j < len; ++j) {
          if (gen() % 4 == 0) continue;  // not a candidate
          const float v = gen() % 2 ? levels[gen() % 8] : std::ldexp(float(int(gen() % 2001) - 1000), -int(gen() % 9));
          const std::int64_t rank = at[std::size_t(j)];
          const std::uint64_t key = (std::uint64_t(test_descending_bits(v)) << rb) | std::uint64_t(rank);
          keys[std::size_t(g * len + j)] = key;
          items.push_back({double(v), rank, key});
        }
        std::ranges::sort(items, [](const item& x, const item& y) {
          return x.score != y.score ? x.score > y.score : x.rank < y.rank;
        });
        for (const item& x : items) sorted.push_back(x.key);
      } else {
        const std::uint64_t mask = bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1;
        const std::uint64_t room =
            bits >= 20 ? std::uint64_t(len) : std::min<std::uint64_t>(std::uint64_t(len), mask + 1);
        const std::uint64_t count = gen() % (room + 1);
        std::set<std::uint64_t> unique;
        while (unique.size() < count) {
          std::uint64_t k = gen() & mask;
          if (gen() % 3 == 0) k = (mask - gen() % 4) & mask;  // the top of the range too
          if (k != cuda::detail::no_key) unique.insert(k);
        }
        std::size_t j = 0;
        for (const std::uint64_t k : unique) keys[std::size_t(g * len + at[j++])] = k;
        sorted.assign(unique.begin(), unique.end());
      }
      const auto count = std::int64_t(sorted.size());
      const std::int64_t choice[] = {-1, 0, 1, count, count + 1, std::int64_t(gen() % std::uint64_t(count + 1))};
      const std::int64_t w = choice[gen() % 6];
      wanted.push_back(w);
      expect.push_back(w <= 0 ? 0 : w > count ? cuda::detail::no_key : sorted[std::size_t(w - 1)] + 1);
    }
    infkv::detail::carver sizing;
    cuda::detail::radix_scratch::carve(sizing, segments);
    cpu::workspace ws(sizing.size());
    infkv::detail::carver c{ws.span().data()};
    const auto w = cuda::detail::radix_scratch::carve(c, segments);
    std::copy(wanted.begin(), wanted.end(), w.need);
    be.radix_select(keys.data(), segments, len, bits, w);
    for (std::int64_t g = 0; g < segments; ++g) {
      CAPTURE(g);
      CAPTURE(wanted[std::size_t(g)]);
      CHECK(w.bound[g] == expect[std::size_t(g)]);
    }
  }
}

TEST_CASE("cuda steps (host): whole runs of every policy keep the CPU's sets on well-separated scores") {
  // Recency and accumulated scores are computed exactly alike; attention and key scores differ by
  // rounding only, so the sets agree except at near-ties: at most a couple of slots per unit.
  const cpu::backend cpu_be{};
  const host_cuda_backend gpu_be{};
  const layer ly(make_problem(5, 400, 2, 2, 16, 6));
  const layer_inputs<> in = ly.in();
  const budget b{.capacity = 120, .sinks = 2, .recent = 8};
  for_each_policy(in, [&](const std::string& name, const auto& pol, const auto& with) {
    INFO(name);
    const auto inputs = with(in);
    for (const granularity g : {granularity::per_head, granularity::per_token}) {
      const std::span<const layer_inputs<>> one(&inputs, 1);
      const auto want = keep_of(cpu_be, pol.spec(), b, one, {.g = g}),
                 got = keep_of(gpu_be, pol.spec(), b, one, {.g = g});
      REQUIRE(got.n_units() == want.n_units());
      for (std::int64_t u = 0; u < got.n_units(); ++u) {
        std::vector<std::int64_t> diff;
        std::ranges::set_symmetric_difference(got.unit(u), want.unit(u), std::back_inserter(diff));
        const bool exact =
            pol.spec().score.source == score_source::recency || pol.spec().score.source == score_source::accumulated;
        CHECK(diff.size() <= (exact ? 0u : 4u));
      }
    }
  });
}

TEST_CASE("cuda steps (host): unions of two policies keep the CPU's sets (exactly where both scores are exact)") {
  const cpu::backend cpu_be{};
  const host_cuda_backend gpu_be{};
  const layer ly(make_problem(6, 300, 2, 2, 16, 6));
  const layer_inputs<> in = ly.in();
  cpu::h2o_state heavy(h2o{.forgetting = 0.9}, 2);
  heavy.append(ly.p.n);
  cpu::observe(heavy, in);
  const auto check = [&](const auto& u, const layer_inputs<>& inputs, bool exact) {
    for (const double share : {0.0, 0.3, 0.5, 1.0})
      for (const granularity g : {granularity::per_layer, granularity::per_token}) {
        CAPTURE(share);
        auto v = u;
        v.share = share;
        const std::span<const layer_inputs<>> one(&inputs, 1);
        const budget b{.capacity = 90, .sinks = 3, .recent = 5};
        cuda::status st{};
        const auto want = keep_of(cpu_be, v.spec(), b, one, {.g = g}),
                   got = keep_of(gpu_be, v.spec(), b, one, {.g = g}, &st);
        CHECK(st.ok());
        REQUIRE(got.n_units() == 1);
        CHECK(got.size(0) == want.size(0));
        std::vector<std::int64_t> diff;
        std::ranges::set_symmetric_difference(got.unit(0), want.unit(0), std::back_inserter(diff));
        CHECK(diff.size() <= (exact ? 0u : 4u));
      }
  };
  check(union_of<h2o, streaming_llm>{{.forgetting = 0.9}, {}}, heavy.attach(in), true);
  check(union_of<inf_mllm, keydiff>{{.window = 4, .bias = {.beta = 0.5}}, {}}, in, false);
  check(union_of<tova, snapkv>{{}, {.window = 3, .pool = pooling::max}}, in, false);
}

TEST_CASE("cuda steps (host): compaction moves exactly the CPU's bytes, contiguous and paged") {
  std::mt19937_64 gen(11);
  for (int round = 0; round < 48; ++round) {
    CAPTURE(round);
    const dtype t = dtype(round % 3);
    const layout lay = layout(round % 3);  // nhd, hnd, strided
    const std::int64_t n = 5 + std::int64_t(gen() % 90);
    const auto heads = std::int32_t(1 + gen() % 3), d = std::int32_t(1 + gen() % 9) * (round % 2 ? 2 : 1);
    const problem p = make_problem(300 + std::uint64_t(round), n, heads, 1, d, 1, t);
    stored k1 = store(p.k, n, heads, d, t, lay), v1 = store(p.k, n, heads, d, t, lay);
    stored k2 = store(p.k, n, heads, d, t, lay), v2 = store(p.k, n, heads, d, t, lay);
    const std::int64_t m = 1 + std::int64_t(gen() % std::uint64_t(n));
    const bool per_head = heads > 1 && round % 2 == 0;
    keep_set keep(n);
    for (std::int32_t u = 0; u < (per_head ? heads : 1); ++u) keep.add_unit(random_slots(gen, n, m));
    std::vector<token> tok1 = p.tokens;
    if (per_head) {  // one token list per head
      tok1.clear();
      for (std::int32_t h = 0; h < heads; ++h) tok1.insert(tok1.end(), p.tokens.begin(), p.tokens.end());
      for (std::size_t i = 0; i < tok1.size(); ++i) tok1[i].segment = std::int32_t(i);
    }
    std::vector<token> tok2 = tok1;
    kv_view kv{k1.tensor, v1.tensor};
    cpu::compact(kv, tok1, keep);
    // A small scratch bound (round 0: the real one) cuts the move into many chunks, some of
    // whose sources overlap their destinations (staged) and some not (direct).
    const std::int64_t limit = round == 0 ? cuda::compact_scratch_limit : 16 * (1 + std::int64_t(gen() % 40));
    std::vector<std::byte> ws(cuda::compact_scratch_bytes(m, heads, d * std::int64_t(size_of(t)), limit));
    cuda::status_word word = cuda::status_ok;
    cuda::compact_steps(host_launcher{}, &word, k2.tensor, v2.tensor, tok2.data(), std::int64_t(tok2.size()),
                        keep.view(), m, {ws.data(), ws.size()}, limit);
    CHECK(cuda::decode(word).ok());
    CHECK(k1.bytes == k2.bytes);
    CHECK(v1.bytes == v2.bytes);
    tok1.resize(tok1.size() / std::size_t(n) * std::size_t(m));
    tok2.resize(tok1.size());
    for (std::size_t i = 0; i < tok1.size(); ++i)
      CHECK((tok1[i].pos == tok2[i].pos && tok1[i].segment == tok2[i].segment));
  }
  for (int round = 0; round < 12; ++round) {  // paged: sequence 1 behind a decoy sequence
    CAPTURE(round);
    const dtype t = dtype(round % 3);
    const std::int64_t n = 4 + std::int64_t(gen() % 60);
    const problem p = make_problem(400 + std::uint64_t(round), n, 2, 1, 6, 1, t);
    stored a = store(p.k, n, 2, 6, t, layout::paged), c = store(p.k, n, 2, 6, t, layout::paged);
    a.paged.v = a.paged.k, c.paged.v = c.paged.k;  // V shares K's storage here: moved once per tensor, as the CPU does
    a.paged.v.data = nullptr, c.paged.v.data = nullptr;
    const std::int64_t m = std::int64_t(gen() % std::uint64_t(n + 1));
    keep_set keep(n);
    keep.add_unit(random_slots(gen, n, m));
    std::vector<token> t1 = p.tokens, t2 = p.tokens;
    // Both backends move one sequence's rows and leave the table to the engine: the pages they
    // free are the last pages_freed of the sequence's list.
    const std::vector<std::int32_t> table = c.indices, starts = c.indptr, last = c.last;
    CHECK(cpu::compact(key_rows(a.paged, 1), paged_rows{}, t1, keep) == m);
    CHECK((a.indices == table && a.indptr == starts && a.last == last));
    const paged_rows rows = key_rows(c.paged, 1);
    const std::int64_t limit = round % 2 ? cuda::compact_scratch_limit : 12 * size_of(t);
    std::vector<std::byte> ws(cuda::compact_scratch_bytes(m, 2, 6 * std::int64_t(size_of(t)), limit));
    cuda::status_word word = cuda::status_ok;
    cuda::compact_steps(host_launcher{}, &word, rows, paged_rows{}, t2.data(), n, keep.view(), m,
                        {ws.data(), ws.size()}, limit);
    CHECK(cuda::decode(word).ok());
    CHECK(a.bytes == c.bytes);
    CHECK((c.indices == table && c.indptr == starts && c.last == last));
    for (std::int64_t i = 0; i < m; ++i) CHECK(t1[std::size_t(i)].pos == t2[std::size_t(i)].pos);
  }
}

TEST_CASE("cuda steps (host): re-rotation matches the CPU backend within rounding") {
  for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (const rope_style style : {rope_style::normal, rope_style::neox}) {
      const problem p = make_problem(21, 50, 3, 1, 16, 1, t);
      stored a = store(p.k, 50, 3, 16, t, layout::strided), b = store(p.k, 50, 3, 16, t, layout::strided);
      std::vector<std::int64_t> delta(50);
      for (std::size_t j = 0; j < delta.size(); ++j) delta[j] = std::int64_t(j % 7) * 1000 - 3000;
      const rope r{.theta = 10000.0, .dims = 12, .style = style};
      cpu::rerotate(a.tensor, delta, r);
      const cuda::status_word ok = cuda::status_ok;
      cuda::rerotate_steps(host_launcher{}, &ok, b.tensor, delta.data(), r);
      const double tol = t == dtype::f32 ? 1e-5 : t == dtype::f16 ? 2e-3 : 1.6e-2;
      for (std::int64_t j = 0; j < 50; ++j)
        for (std::int32_t h = 0; h < 3; ++h)
          for (std::int32_t e = 0; e < 16; ++e) {
            const float x = cuda::detail::load(t, a.tensor.row(j, h), e),
                        y = cuda::detail::load(t, b.tensor.row(j, h), e);
            CHECK(std::abs(x - y) <= tol * (1 + std::abs(x)));
          }
    }
}

TEST_CASE("cuda steps (host): KeyDiff refuses head_dim above 256 when planning, naming it") {
  const layer_shape shape{.n_slots = 100, .kv_heads = 2, .q_heads = 2, .head_dim = 264, .n_queries = 1};
  CHECK_THROWS_WITH_AS(make_plan(host_cuda_backend{}, keydiff{}.spec(), budget{.capacity = 50}, shape),
                       doctest::Contains("keys.head_dim"), invalid_argument);
  CHECK_NOTHROW(make_plan(host_cuda_backend{}, keydiff{}.spec(), budget{.capacity = 50},
                          layer_shape{.n_slots = 100, .kv_heads = 2, .q_heads = 2, .head_dim = 256, .n_queries = 1}));
}

TEST_CASE("cuda steps (host): a selection of 2^32 slots or more is refused when planning, naming the slots") {
  // The tie ranks are 32-bit with 2^32 - 1 marking protected slots: 2^32 slots would give the
  // newest slot that rank.
  const auto shape = [](std::int64_t n, std::int32_t heads) {
    return layer_shape{.n_slots = n, .kv_heads = heads, .q_heads = 0, .head_dim = 8, .n_queries = 0};
  };
  const score_spec spec{.source = score_source::accumulated};
  CHECK_THROWS_WITH_AS((void)host_cuda_backend{}.scratch_bytes(spec, shape(std::int64_t(1) << 32, 1), {}),
                       doctest::Contains("shape.n_slots"), invalid_argument);
  CHECK_THROWS_WITH_AS((void)host_cuda_backend{}.scratch_bytes(spec, shape(std::int64_t(1) << 31, 4), {}),
                       doctest::Contains("shape.n_slots"), invalid_argument);
  CHECK_NOTHROW(host_cuda_backend::check_sort_bits(1, (std::int64_t(1) << 32) - 1));
  CHECK_NOTHROW(host_cuda_backend::check_sort_bits(2, std::int64_t(1) << 31));
}

TEST_CASE("cuda steps (host): device faults are recorded, named, and leave the cache as it was") {
  const host_cuda_backend be{};
  const layer ly(make_problem(9, 80, 2, 2, 8, 4));
  SUBCASE("a NaN key names slot, head and element") {
    problem p = ly.p;
    p.k[std::size_t((41 * 2 + 1) * 8 + 5)] = std::numeric_limits<float>::quiet_NaN();
    const layer bad(p);
    const layer_inputs<> in = bad.in();
    for (const policy_spec& spec : {snapkv{.window = 4}.spec(), keydiff{}.spec(), tova{}.spec()}) {
      cuda::status st;
      keep_of(be, spec, budget{.capacity = 30, .recent = 4}, std::span<const layer_inputs<>>(&in, 1), {}, &st);
      CHECK(st.kind == cuda::fault::key_not_finite);
      CHECK((st.b == 41 && st.a == 1 && st.e == 5));
      CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains("keys[slot 41, head 1][5] is not finite"),
                           invalid_argument);
    }
  }
  SUBCASE("an Inf query names the query as the caller counts it") {
    problem p = ly.p;
    p.q[std::size_t((3 * 4 + 2) * 8 + 1)] = std::numeric_limits<float>::infinity();
    const layer bad(p);
    const layer_inputs<> in = bad.in();
    cuda::status st;
    keep_of(be, snapkv{.window = 2}.spec(), budget{.capacity = 30, .recent = 2},
            std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK(st.kind == cuda::fault::query_not_finite);
    CHECK((st.b == 3 && st.a == 2 && st.e == 1));
  }
  SUBCASE("a NaN value names slot and head, before the NaN scores it makes") {
    std::vector<float> v(std::size_t(80 * 2 * 8), 1.f);
    v[std::size_t((29 * 2 + 1) * 8 + 2)] = std::numeric_limits<float>::quiet_NaN();
    const stored values = store(v, 80, 2, 8, dtype::f32, layout::nhd);
    layer_inputs<> in = ly.in();
    in.values = values.tensor;
    cuda::status st;
    keep_of(be, expected_attention{.window = 4}.spec(), budget{.capacity = 30, .sinks = 4},
            std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK((st.kind == cuda::fault::value_not_finite && st.b == 29 && st.a == 1));
    CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains("values[slot 29, head 1] is not finite"),
                         invalid_argument);
  }
  SUBCASE("a finite key so large that Expected Attention's logit overflows names the key, not a NaN score") {
    problem p = ly.p;
    const auto slot =
        std::int64_t(std::find_if(p.tokens.begin(), p.tokens.end(), [](const token& t) { return t.pos == 40; }) -
                     p.tokens.begin());  // not a sink
    for (std::int32_t e = 0; e < 8; ++e) p.k[std::size_t((slot * 2 + 1) * 8 + e)] = 1e30f;
    const layer big(p);
    const layer_inputs<> in = big.in();
    cuda::status st;
    keep_of(be, expected_attention{.window = 4, .value_norm = false}.spec(), budget{.capacity = 30, .sinks = 4},
            std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK((st.kind == cuda::fault::logit_overflow && st.a == 1 && st.b == slot));
    const std::string named = "keys[slot " + std::to_string(slot) + ", head 1]: expected_attention's logit";
    CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains(named.c_str()), invalid_argument);
  }
  SUBCASE("a query position past 2^62 is recorded for Expected Attention, not overflowed") {
    std::vector<std::int64_t> qpos = ly.p.qpos;
    qpos[1] = std::numeric_limits<std::int64_t>::max();
    layer_inputs<> in = ly.in();
    in.query_pos = qpos;
    cuda::status st;
    keep_of(be, expected_attention{.window = 4, .value_norm = false}.spec(), budget{.capacity = 30, .sinks = 4},
            std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK((st.kind == cuda::fault::bad_position && st.a == 1 && st.b == 1));
    CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains("query_pos[1]: query positions must be in"),
                         invalid_argument);
  }
  SUBCASE("a negative position and a NaN score") {
    std::vector<token> t = ly.p.tokens;
    t[17].pos = -4;
    score_matrix acc(1, 80, 1.f);
    acc(0, 33) = std::numeric_limits<float>::quiet_NaN();
    layer_inputs<> in;
    in.tokens = t, in.accumulated = acc.view();
    const policy_spec spec{.name = "fixed", .score = {.source = score_source::accumulated}};
    cuda::status st;
    keep_of(be, spec, budget{.capacity = 30}, std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK((st.kind == cuda::fault::bad_position && st.b == 17));
    t[17].pos = 4000;
    keep_of(be, spec, budget{.capacity = 30}, std::span<const layer_inputs<>>(&in, 1), {}, &st);
    CHECK((st.kind == cuda::fault::nan_score && st.b == 33));
    CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::run"), doctest::Contains("scores[0, 33] = nan"), invalid_argument);
  }
  SUBCASE("a keep set out of order moves nothing") {
    stored k = store(ly.p.k, 80, 2, 8, dtype::f32, layout::nhd);
    const auto before = k.bytes;
    std::vector<token> t = ly.p.tokens;
    std::vector<std::int64_t> slots{3, 9, 9, 20}, offsets{0, 4};
    std::vector<std::byte> ws(cuda::compact_scratch_bytes(4, 2, 32));
    cuda::status_word word = cuda::status_ok;
    cuda::compact_steps(host_launcher{}, &word, k.tensor, tensor_view{}, t.data(), 80,
                        keep_view{slots.data(), offsets.data(), 1, 80}, 4, {ws.data(), ws.size()});
    const cuda::status st = cuda::decode(word);
    CHECK((st.kind == cuda::fault::bad_keep && st.b == 2));
    CHECK(k.bytes == before);
    CHECK(t[0].pos == ly.p.tokens[0].pos);
    CHECK_THROWS_WITH_AS(cuda::raise_if(st, "cuda::compact"), doctest::Contains("nothing was moved"), invalid_argument);
  }
  SUBCASE("after a fault (a NaN score of the run that chose the keep set) no cache step changes anything") {
    stored k = store(ly.p.k, 80, 2, 8, dtype::f32, layout::nhd), v = store(ly.p.k, 80, 2, 8, dtype::f32, layout::hnd);
    const auto kb = k.bytes, vb = v.bytes;
    std::vector<token> t = ly.p.tokens;
    std::vector<std::int64_t> slots{0, 7, 30, 79}, offsets{0, 4}, delta(80, 500);
    std::vector<std::byte> ws(cuda::compact_scratch_bytes(4, 2, 32));
    cuda::status_word word = cuda::encode(cuda::fault::nan_score, 0, 0, 12);
    cuda::compact_steps(host_launcher{}, &word, k.tensor, v.tensor, t.data(), 80,
                        keep_view{slots.data(), offsets.data(), 1, 80}, 4, {ws.data(), ws.size()});
    cuda::rerotate_steps(host_launcher{}, &word, k.tensor, delta.data(), rope{});
    std::vector<float> acc(2 * 80, 1.f), life(acc.size(), 2.f), score(acc.size(), 3.f);
    const cuda::h2o_state_view state{acc.data(), life.data(), score.data(), 2, 80, 80};
    std::vector<std::byte> hws(cuda::h2o_scratch_bytes<host_launcher>(shape_of(ly.in())));
    cuda::h2o_observe_steps(host_launcher{}, &word, state, h2o{}, ly.in(), {hws.data(), hws.size()});
    CHECK((k.bytes == kb && v.bytes == vb));
    CHECK(t[1].pos == ly.p.tokens[1].pos);
    CHECK((acc[5] == 1.f && life[5] == 2.f && score[5] == 3.f));
    CHECK(cuda::decode(word).kind == cuda::fault::nan_score);  // the first fault stays
  }
}

TEST_CASE("cuda steps (host): H2O's accumulation step and eviction follow cpu::h2o_state") {
  for (const h2o cfg : {h2o{}, h2o{.normalize_lifetime = true, .forgetting = 0.8}}) {
    CAPTURE(cfg.normalize_lifetime);
    const std::int64_t n = 300;
    cpu::h2o_state want(cfg, 2);
    want.append(n);
    std::vector<float> acc(std::size_t(2 * (n + 5)), 0.f), life(acc.size(), 0.f), score(acc.size(), -1.f);
    cuda::h2o_state_view got{acc.data(), life.data(), score.data(), 2, n, n + 5};
    for (int step = 0; step < 3; ++step) {  // three decode steps of different queries, same cache
      const layer ly(make_problem(40, n, 2, 3, 16, 2 + step));
      layer_inputs<> in = ly.in();
      cpu::observe(want, in);
      std::vector<std::byte> ws(cuda::h2o_scratch_bytes<host_launcher>(shape_of(in)));
      cuda::status_word word = cuda::status_ok;
      cuda::h2o_observe_steps(host_launcher{}, &word, got, cfg, in, {ws.data(), ws.size()});
      CHECK(cuda::decode(word).ok());
      score_matrix g(2, n);
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t j = 0; j < n; ++j) g(h, j) = got.scores()(h, j);
      check_close(g, as_ref(want.scores()), 1e-4, 1e-6, "h2o step " + std::to_string(step));
    }
    keep_set keep(n);
    std::vector<std::int64_t> kept;
    for (std::int64_t j = 0; j < n; j += 3) kept.push_back(j);
    keep.add_unit(kept);
    want.evict(keep);
    std::vector<std::byte> ws(cuda::compact_scratch_bytes(std::int64_t(kept.size()), 2, 4));
    cuda::status_word word = cuda::status_ok;
    cuda::h2o_evict_steps(host_launcher{}, &word, got, keep.view(), std::int64_t(kept.size()), {ws.data(), ws.size()});
    CHECK(cuda::decode(word).ok());
    REQUIRE(got.n_slots == std::int64_t(kept.size()));
    score_matrix g(2, got.n_slots);
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t j = 0; j < got.n_slots; ++j) g(h, j) = got.scores()(h, j);
    check_close(g, as_ref(want.scores()), 1e-4, 1e-6, "h2o after eviction");
  }
}

TEST_CASE("cuda steps (host): the GEMM stand-in computes cuBLAS's strided batched GEMM (float64 reference)") {
  std::mt19937_64 gen(77);
  std::uniform_int_distribution<int> size(1, 9), pad(0, 4), coin(0, 1);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int trial = 0; trial < 200; ++trial) {
    const dtype t = std::array{dtype::f32, dtype::f16, dtype::bf16}[std::size_t(trial % 3)];
    const auto ta = coin(gen) ? cuda::blas_op::t : cuda::blas_op::n,
               tb = coin(gen) ? cuda::blas_op::t : cuda::blas_op::n;
    const std::int64_t m = size(gen), n = size(gen), k = trial % 17 == 0 ? 0 : size(gen), batch = 1 + trial % 3;
    const std::int64_t ar = ta == cuda::blas_op::n ? m : k, ac = ta == cuda::blas_op::n ? k : m;
    const std::int64_t br = tb == cuda::blas_op::n ? k : n, bc = tb == cuda::blas_op::n ? n : k;
    const std::int64_t lda = std::max<std::int64_t>(ar, 1) + pad(gen), ldb = std::max<std::int64_t>(br, 1) + pad(gen),
                       ldc = m + pad(gen);
    // Strides: past the matrix by a few elements, or (sometimes) 0, every batch entry reading the same A.
    const std::int64_t sa = trial % 7 == 0 ? 0 : lda * ac + pad(gen), sb = ldb * bc + pad(gen), sc = ldc * n + pad(gen);
    const float alpha = 0.5f + float(trial % 4), beta = trial % 5 == 0 ? 0.f : 0.25f * float(trial % 3);
    const auto es = std::size_t(size_of(t));
    // At least one element each (k = 0 leaves A or B empty; no element is read then).
    std::vector<float> a_val(std::size_t(std::max<std::int64_t>(1, sa * (batch - 1) + lda * ac))),
        b_val(std::size_t(std::max<std::int64_t>(1, sb * (batch - 1) + ldb * bc)));
    for (float& x : a_val) x = round_to(t, normal(gen));
    for (float& x : b_val) x = round_to(t, normal(gen));
    std::vector<std::byte> a(a_val.size() * es), b(b_val.size() * es);
    from_f32(t, a_val.data(), a.data(), a_val.size());
    from_f32(t, b_val.data(), b.data(), b_val.size());
    std::vector<float> c(std::size_t(sc * (batch - 1) + ldc * n));
    for (float& x : c) x = normal(gen);
    std::vector<float> want = c;
    for (std::int64_t x = 0; x < batch; ++x)
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (std::int64_t l = 0; l < k; ++l) {
            const double av = ta == cuda::blas_op::n ? a_val[std::size_t(x * sa + l * lda + i)]
                                                     : a_val[std::size_t(x * sa + i * lda + l)];
            const double bv = tb == cuda::blas_op::n ? b_val[std::size_t(x * sb + j * ldb + l)]
                                                     : b_val[std::size_t(x * sb + l * ldb + j)];
            s += av * bv;
          }
          float& w = want[std::size_t(x * sc + j * ldc + i)];
          w = float(double(alpha) * s + (beta == 0.f ? 0.0 : double(beta) * double(w)));
        }
    host_gemm_strided_batched(ta, tb, m, n, k, alpha, a.data(), t, lda, sa, b.data(), t, ldb, sb, beta, c.data(),
                              dtype::f32, ldc, sc, batch);
    INFO("trial ", trial, " ", to_string(t), " m ", m, " n ", n, " k ", k, " lda ", lda, " ldb ", ldb, " ldc ", ldc);
    for (std::size_t i = 0; i < c.size(); ++i) CHECK(c[i] == doctest::Approx(want[i]).epsilon(1e-5).scale(10.0));
  }
  // cuBLAS's argument checks: a leading dimension below the rows stored, a C that is not f32.
  std::vector<float> a(64), b(64), c(64);
  CHECK_THROWS_WITH_AS(
      host_gemm_strided_batched(cuda::blas_op::t, cuda::blas_op::n, 4, 4, 4, 1.f, a.data(), dtype::f32, 3, 16, b.data(),
                                dtype::f32, 4, 16, 0.f, c.data(), dtype::f32, 4, 16, 1),
      doctest::Contains("lda"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      host_gemm_strided_batched(cuda::blas_op::n, cuda::blas_op::t, 4, 4, 4, 1.f, a.data(), dtype::f32, 4, 16, b.data(),
                                dtype::f32, 3, 16, 0.f, c.data(), dtype::f32, 4, 16, 1),
      doctest::Contains("ldb"), invalid_argument);
  CHECK_THROWS_WITH_AS(
      host_gemm_strided_batched(cuda::blas_op::n, cuda::blas_op::n, 4, 4, 4, 1.f, a.data(), dtype::f32, 4, 16, b.data(),
                                dtype::f32, 4, 16, 0.f, c.data(), dtype::f16, 4, 16, 1),
      doctest::Contains("Ctype"), invalid_argument);
}

TEST_CASE("cuda steps (host): window attention through GEMM tiles matches the CPU, several tiles, scalar paths too") {
  const cpu::backend cpu_be{};
  int i = 0;
  for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (const layout lay : {layout::nhd, layout::hnd, layout::strided, layout::paged}) {
      // 1100 keys, 2 KV heads of 3 query heads each: 4096 bytes of logits per tile is the least,
      // one 256-key tile; 40000 bytes give 256 keys for 6 x 5 rows too; 1 << 20 one tile of all.
      const problem p = make_problem(900 + std::uint64_t(i++), 1100, 2, 3, 16, 7, t);
      const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay), queries = store_queries(p);
      for (const std::int64_t limit : {std::int64_t(4096), std::int64_t(1) << 20}) {
        host_cuda_backend gpu_be{host_launcher{.block = 29}};
        gpu_be.window_tile_limit = limit;
        keys.visit([&](const auto& k) {
          using R = std::decay_t<decltype(k)>;
          const layer_inputs<R> in{k, {}, queries.tensor, p.qpos, p.tokens, 0.f};
          for (const policy_spec& spec :
               {snapkv{.window = 5, .kernel = 3}.spec(), tova{}.spec(), inf_mllm{.window = 7, .kernel = 1}.spec()}) {
            const std::int64_t before = host_launcher::gemm_calls, blocks_before = host_launcher::block_launches;
            const auto got = finished(gpu_be, spec, in);
            const std::int64_t calls = host_launcher::gemm_calls - before;
            const std::int64_t w = std::min<std::int64_t>(spec.score.queries, p.nq), rows = p.hq * w;
            const std::int64_t tile = cuda::detail::window_tile_keys(rows, p.n, limit), tiles = (p.n + tile - 1) / tile;
            const std::string what =
                std::string(spec.name) + " " + to_string(t) + " " + to_string(lay) + " limit " + std::to_string(limit);
            INFO(what);
            // 16-bit keys: the fused steps, any layout; f32: GEMM tiles, paged keys the scalar path.
            // Every path combines its rows' statistics in one block-level step; pooling's tail
            // fill sums its pieces in another.
            const bool fused = t != dtype::f32;
            CHECK(host_launcher::block_launches - blocks_before == (fused ? 3 : 1) + (spec.score.pools() ? 1 : 0));
            CHECK(calls == (fused || lay == layout::paged ? 0 : 2 * tiles));
            if (limit == 4096) CHECK(tiles >= 4);
            check_close(got, as_ref(finished(cpu_be, spec, in)), 2e-4, 2e-6, what);
          }
        });
      }
    }
  SUBCASE("queries of another type than the keys take the scalar path, with the same result") {
    const problem p = make_problem(950, 700, 2, 2, 16, 6, dtype::f16);
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd),
                 q32 = store(p.q, p.nq, p.hq, p.d, dtype::f32, layout::nhd);  // the f16 values, exactly, as f32
    const layer_inputs<> in{keys.tensor, {}, q32.tensor, p.qpos, p.tokens, 0.f};
    host_cuda_backend gpu_be{};
    gpu_be.window_tile_limit = 4096;
    const std::int64_t before = host_launcher::gemm_calls;
    const auto got = finished(gpu_be, snapkv{.window = 6}.spec(), in);
    CHECK(host_launcher::gemm_calls == before);
    check_close(got, as_ref(finished(cpu_be, snapkv{.window = 6}.spec(), in)), 2e-4, 2e-6, "mixed types");
  }
}

TEST_CASE("cuda steps (host): the fused window attention matches the CPU: 16-bit keys, every layout, rows up to 128") {
  const cpu::backend cpu_be{};
  struct shape {
    std::int64_t n;
    std::int32_t hkv, group, d;
    std::int64_t window;
    bool fused;
  };
  // 128 query rows per KV head (4 x 32) over 2,500 keys: three blocks of 1,024 per head, the last
  // one and its last tile partial; 15 rows padded to 16 at head_dim 128; 130 rows, or head_dim 24,
  // take the GEMM.
  for (const shape sh : {shape{2500, 2, 4, 16, 32, true}, shape{300, 1, 3, 128, 5, true},
                         shape{700, 2, 5, 16, 26, false}, shape{400, 2, 2, 24, 8, false}})
    for (const dtype t : {dtype::f16, dtype::bf16})
      for (const layout lay : {layout::nhd, layout::strided, layout::paged}) {
        if (sh.n > 1000 && lay == layout::strided) continue;  // time under ASan: the small shapes cover it
        const problem p = make_problem(7000 + std::uint64_t(sh.n + sh.d), sh.n, sh.hkv, sh.group, sh.d, 40, t);
        const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay), queries = store_queries(p);
        keys.visit([&](const auto& k) {
          using R = std::decay_t<decltype(k)>;
          const layer_inputs<R> in{k, {}, queries.tensor, p.qpos, p.tokens, 0.f};
          // Average pooling scores per KV head, max pooling per query head first.
          for (const policy_spec& spec : {snapkv{.window = sh.window, .kernel = 3}.spec(),
                                          snapkv{.window = sh.window, .kernel = 3, .pool = pooling::max}.spec()}) {
            const std::int64_t before = host_launcher::block_launches;
            const auto got = finished(host_cuda_backend{}, spec, in);
            const std::string what = to_string(t) + std::string(" ") + to_string(lay) + " n " + std::to_string(sh.n) +
                                     " d " + std::to_string(sh.d) + " rows " + std::to_string(sh.group * sh.window);
            INFO(what);
            CHECK(host_launcher::block_launches - before == (sh.fused ? 3 : 1) + 1);  // + the tail fill's sums
            check_close(got, as_ref(finished(cpu_be, spec, in)), 2e-4, 2e-6, what);
          }
        });
      }
}

TEST_CASE("cuda steps (host): window rows combine more partial statistics than a warp has lanes, fused and GEMM") {
  // 33,500 keys: 33 fused blocks of 1,024 per KV head, 131 GEMM tiles of 256: every lane of the
  // warp that combines a row holds parts, and some two.
  const cpu::backend cpu_be{};
  for (const dtype t : {dtype::f32, dtype::f16}) {
    const problem p = make_problem(7300, 33500, 1, 2, 16, 4, t);
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd), queries = store_queries(p);
    keys.visit([&](const auto& k) {
      using R = std::decay_t<decltype(k)>;
      const layer_inputs<R> in{k, {}, queries.tensor, p.qpos, p.tokens, 0.f};
      const policy_spec spec = snapkv{.window = 4, .kernel = 3}.spec();
      check_close(finished(host_cuda_backend{}, spec, in), as_ref(finished(cpu_be, spec, in)), 2e-4, 2e-6,
                  to_string(t));
    });
  }
}

TEST_CASE(
    "cuda steps (host): KeyDiff's anchor adds more chunks than its block has warps, head_dim not a multiple of 32") {
  // 3,000 keys: 12 chunks of 256, so every warp of the anchor's blocks adds some and 4 add two;
  // head_dim 40: the second slice of 32 elements is partly empty.
  const cpu::backend cpu_be{};
  for (const dtype t : {dtype::f32, dtype::bf16}) {
    const problem p = make_problem(7400, 3000, 2, 1, 40, 1, t);
    const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd);
    keys.visit([&](const auto& k) {
      using R = std::decay_t<decltype(k)>;
      const layer_inputs<R> in{k, {}, {}, {}, p.tokens, 0.f};
      const policy_spec spec = keydiff{}.spec();
      check_close(finished(host_cuda_backend{}, spec, in), as_ref(finished(cpu_be, spec, in)), 2e-4, 2e-6,
                  to_string(t));
    });
  }
}

TEST_CASE("cuda steps (host): the fused window attention records a non-finite key as the other paths do") {
  for (const dtype t : {dtype::f16, dtype::bf16}) {
    problem p = make_problem(7100, 1500, 2, 2, 32, 8, t);
    p.k[std::size_t((1234 * 2 + 1) * 32 + 17)] =
        std::numeric_limits<float>::infinity();  // slot 1234, head 1, element 17
    p.k[std::size_t((1300 * 2 + 1) * 32 + 3)] = std::numeric_limits<float>::quiet_NaN();
    const layer ly(p);
    cuda::status_word word;
    const auto be = with_status(host_cuda_backend{}, word);
    const policy_spec spec = snapkv{.window = 8}.spec();
    const plan pl = make_plan(be, spec, budget{.ratio = 1.0}, shape_of(ly.in()));
    cpu::workspace ws(pl.workspace_bytes);
    const std::int64_t before = host_launcher::block_launches;
    (void)run_scores(pl, be, ly.in(), ws.span());
    CHECK(host_launcher::block_launches - before == 4);  // the passes, the rows' statistics, the tail's sums
    const cuda::status st = cuda::decode(word);
    CHECK(st.kind == cuda::fault::key_not_finite);
    CHECK(st.a == 1);
    CHECK(st.e == 3);  // the smallest code: element 3 of slot 1300 before element 17 of slot 1234
    CHECK(st.b == 1300);
  }
}

TEST_CASE("cuda steps (host): Expected Attention's logits through GEMM tiles match the CPU, every layout and form") {
  const cpu::backend cpu_be{};
  int i = 0;
  for (const dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (const layout lay : {layout::nhd, layout::hnd, layout::strided, layout::paged}) {
      // 1100 keys, 2 KV heads of 3 query heads each, 7 queries: 4096 bytes per tile is the least,
      // one 256-key tile (5 tiles); 1 << 20 bytes hold every key in one tile.
      const problem p = make_problem(960 + std::uint64_t(i++), 1100, 2, 3, 16, 7, t);
      const stored keys = store(p.k, p.n, p.hkv, p.d, p.type, lay), queries = store_queries(p);
      for (const std::int64_t limit : {std::int64_t(4096), std::int64_t(1) << 20}) {
        host_cuda_backend gpu_be{host_launcher{.block = 31}};
        gpu_be.window_tile_limit = limit;
        keys.visit([&](const auto& k) {
          using R = std::decay_t<decltype(k)>;
          const layer_inputs<R> in{k, {}, queries.tensor, p.qpos, p.tokens, 0.f};
          for (const bool cov : {false, true})
            for (const auto form : {covariance_form::projections, covariance_form::matrix}) {
              if (!cov && form == covariance_form::matrix) continue;
              policy_spec spec = expected_attention{.window = 7, .sinks = 3, .covariance = cov}.spec();
              spec.score.expect.form = form;
              spec.score.value_norm = false;
              const bool matrix = cov && form == covariance_form::matrix;
              const std::int64_t rq = matrix ? p.d + 1 : cov ? p.nq + 1 : 1;
              const std::int64_t tile = cuda::detail::window_tile_keys(p.hkv * ((p.hq / p.hkv) * rq + p.d), p.n, limit);
              const std::int64_t tiles = (p.n + tile - 1) / tile, before = host_launcher::gemm_calls;
              const auto got = finished(gpu_be, spec, in);
              const std::string what = std::string(to_string(t)) + " " + to_string(lay) + " limit " +
                                       std::to_string(limit) +
                                       (cov ? matrix ? " matrix" : " projections" : " mean only");
              INFO(what);
              CHECK(host_launcher::gemm_calls - before == tiles + (matrix ? 1 : 0));  // Sigma': one more
              if (limit == 4096) CHECK(tiles >= 4);
              check_close(got, as_ref(finished(cpu_be, spec, in)), 2e-5, 2e-6, what);
            }
        });
      }
    }
}

TEST_CASE("cuda steps (host): archive pages quantize, dequantize and bound exactly as the CPU's") {
  std::mt19937 gen(41);
  for (const dtype t : {dtype::f32, dtype::f16})
    for (const std::int32_t bits : {2, 4, 8})
      for (const std::int32_t n : {5, 8}) {  // a partial page and a full one
        CAPTURE(to_string(t));
        CAPTURE(bits);
        CAPTURE(n);
        const std::int32_t L = 2, H = 2, d = 16, P = 8;
        const archive_shape shape{L, H, d, granularity::per_token};
        const archive_options o{.page_tokens = P,
                                .key_bits = bits,
                                .value_bits = bits,
                                .value_group = bits == 4 ? 4 : 0,
                                .capacity_bytes = std::size_t(1) << 20};
        // n tokens of every layer, nhd, the type t
        std::vector<std::vector<std::uint8_t>> K, V;
        std::uniform_real_distribution<float> u(-3.f, 3.f);
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> k(std::size_t(n * H * d)), v(k.size());
          for (auto& x : k) x = u(gen);
          for (auto& x : v) x = u(gen);
          std::vector<std::uint8_t> kb(k.size() * size_of(t)), vb(kb.size());
          from_f32(t, k.data(), kb.data(), std::int64_t(k.size()));
          from_f32(t, v.data(), vb.data(), std::int64_t(v.size()));
          K.push_back(std::move(kb)), V.push_back(std::move(vb));
        }
        std::vector<token> tok(static_cast<std::size_t>(n));
        for (std::int32_t i = 0; i < n; ++i) tok[std::size_t(i)] = {100 + i, 0, modality::text};
        std::vector<layer_inputs<>> in(static_cast<std::size_t>(L));
        for (std::int32_t l = 0; l < L; ++l) {
          in[std::size_t(l)].keys = nhd(static_cast<const void*>(K[std::size_t(l)].data()), t, n, H, d);
          in[std::size_t(l)].values = nhd(static_cast<const void*>(V[std::size_t(l)].data()), t, n, H, d);
          in[std::size_t(l)].tokens = tok;
        }
        archive a(shape, o);
        keep_set none(n);
        none.add_unit({});
        cpu::workspace ws(cpu::archive_scratch_bytes(a, n));
        REQUIRE(cpu::archive_evicted(a, std::span<const layer_inputs<>>(in), none, ws.span()) == 1);
        const std::int32_t page = a.held()[0];
        // the steps: row r = l * H + h reads token j's row at K[l] + (j * H + h) * d
        std::vector<const void*> kr, vr;
        for (std::int32_t l = 0; l < L; ++l)
          for (std::int32_t h = 0; h < H; ++h) {
            kr.push_back(K[std::size_t(l)].data() + std::size_t(h * d) * size_of(t));
            vr.push_back(V[std::size_t(l)].data() + std::size_t(h * d) * size_of(t));
          }
        const cuda::page_rows rows{kr.data(), vr.data(), t, std::int64_t(H) * d, n};
        std::vector<std::uint8_t> bytes(a.layout().bytes, 0);
        cuda::status_word word = cuda::status_ok;
        cuda::quantize_page_steps(host_launcher{}, &word, a.layout(), rows, bytes.data());
        CHECK(cuda::decode(word).ok());
        CHECK(std::equal(bytes.begin(), bytes.end(), a.row(page, 0)));  // the CPU's bytes, exactly
        std::vector<float> dk(std::size_t(L * H * n * d)), dv(dk.size());
        cuda::dequantize_page_steps(host_launcher{}, a.layout(), bytes.data(), n, dk.data(), dv.data());
        std::vector<float> ck(static_cast<std::size_t>(d)), cv(ck.size());
        bool same = true;
        for (std::int32_t r = 0; r < L * H; ++r)
          for (std::int32_t j = 0; j < n; ++j) {
            cpu::dequantize(a, page, r, j, false, ck.data());
            cpu::dequantize(a, page, r, j, true, cv.data());
            for (std::int32_t c = 0; c < d; ++c)
              same = same && dk[std::size_t((r * n + j) * d + c)] == ck[std::size_t(c)] &&
                     dv[std::size_t((r * n + j) * d + c)] == cv[std::size_t(c)];
          }
        CHECK(same);
        // bounds of this page and of two more, for random queries of 4 query heads
        for (std::int32_t more = 0; more < 2; ++more)
          REQUIRE(cpu::archive_evicted(a, std::span<const layer_inputs<>>(in), none, ws.span()) == 1);
        std::vector<std::vector<float>> qs;
        std::vector<const_tensor_view> qv;
        for (std::int32_t l = 0; l < L; ++l) {
          std::vector<float> q(std::size_t(3 * 4 * d));
          for (auto& x : q) x = u(gen);
          qs.push_back(std::move(q));
        }
        for (std::int32_t l = 0; l < L; ++l)
          qv.push_back(nhd(static_cast<const void*>(qs[std::size_t(l)].data()), dtype::f32, 3, 4, d));
        std::vector<float> want(static_cast<std::size_t>(a.capacity_pages()));
        cpu::page_bounds(a, qv, 0.25f, want);
        const auto held = a.held();
        std::vector<const std::uint8_t*> pages;
        std::vector<std::int32_t> first(held.size(), 0), heads(held.size(), 0);
        for (const auto p : held) pages.push_back(a.row(p, 0));
        std::vector<float> scratch(held.size() * std::size_t(L)), got(held.size());
        cuda::page_bounds_steps(host_launcher{}, shape, a.layout(), pages.data(), first.data(), heads.data(),
                                std::int64_t(held.size()), qv.data(), 0.25f, scratch.data(), got.data());
        for (std::size_t i = 0; i < held.size(); ++i) CHECK(got[i] == want[std::size_t(held[i])]);
        // an element beyond f16's range is recorded, named, and raised
        if (t == dtype::f32 && bits == 4 && n == 5) {
          reinterpret_cast<float*>(K[1].data())[(3 * H + 1) * d + 7] = 1e6f;  // layer 1, token 3, head 1, channel 7
          word = cuda::status_ok;
          cuda::quantize_page_steps(host_launcher{}, &word, a.layout(), rows, bytes.data());
          const cuda::status st = cuda::decode(word);
          CHECK(st.kind == cuda::fault::not_archivable);
          CHECK(st.a == 3);  // row l * H + h
          CHECK(st.e == 7);
          CHECK(st.b == 3);
          CHECK_THROWS_WITH(cuda::raise_if(st, "quantize_page"),
                            doctest::Contains("page row 3, token 3, channel 7: an archived element must be finite"));
        }
      }
}

TEST_CASE("cuda steps (host): a batch plan keeps, for every sequence and policy, what the sequence's own run keeps") {
  for (std::uint64_t seed = 200; seed < 216; ++seed) {
    CAPTURE(seed);
    const batch_case c = draw_batch(seed);
    std::mt19937_64 gen(seed + 99);
    const batch_keys keys(gen, c);
    cuda::status_word word = cuda::status_ok;
    const host_cuda_backend be = with_status(narrow_selection(host_cuda_backend{}), word);
    check_batch_equals_runs(be, c, keys.tensor_rows);
    check_batch_equals_runs(be, c, keys.paged_rows);
    CHECK(cuda::decode(word).ok());
  }
}
