// RoPE re-rotation of cached keys against a naive double-precision RoPE, and the compact
// position mode: after eviction and re-rotation, logits depend on relative positions only.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

/// Naive RoPE of one head row at `pos`, in double: pairs (2i, 2i+1) (normal) or (i, i + dims/2)
/// (NeoX) rotate by pos * freq_scale * theta^(-2i/dims); dimensions past `dims` pass through.
std::vector<double> naive_rope(const std::vector<double>& x, double pos, const cpu::rope& r) {
  const auto d = std::int32_t(x.size());
  const std::int32_t dims = r.dims == 0 ? d : r.dims, half = dims / 2;
  std::vector<double> y = x;
  for (std::int32_t i = 0; i < half; ++i) {
    const double a = pos * r.freq_scale * std::pow(r.theta, -2.0 * i / dims);
    const std::size_t p = r.style == cpu::rope_style::normal ? std::size_t(2 * i) : std::size_t(i);
    const std::size_t q = r.style == cpu::rope_style::normal ? p + 1 : std::size_t(i + half);
    y[p] = x[p] * std::cos(a) - x[q] * std::sin(a);
    y[q] = x[p] * std::sin(a) + x[q] * std::cos(a);
  }
  return y;
}

std::vector<double> random_row(std::int32_t d, std::mt19937& rng) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> x(static_cast<std::size_t>(d));
  for (auto& v : x) v = dist(rng);
  return x;
}

void store(const tensor_view& t, std::int64_t slot, std::int32_t head, const std::vector<double>& x) {
  std::vector<float> f(x.begin(), x.end());
  from_f32(t.type, f.data(), t.row(slot, head), t.head_dim);
}

std::vector<float> load(const tensor_view& t, std::int64_t slot, std::int32_t head) {
  std::vector<float> f(static_cast<std::size_t>(t.head_dim));
  to_f32(t.type, t.row(slot, head), f.data(), t.head_dim);
  return f;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

/// Relative error bound of one stored element: two roundings of the type plus f32 arithmetic.
double tolerance(dtype t) { return t == dtype::f32 ? 1e-6 : t == dtype::f16 ? 2e-3 : 1.6e-2; }

}  // namespace

TEST_CASE("rerotate by delta equals RoPE applied at p + delta") {
  std::mt19937 rng(31);
  const std::int32_t d = 64, heads = 3;
  const std::int64_t n = 24;
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16})
    for (cpu::rope_style style : {cpu::rope_style::normal, cpu::rope_style::neox})
      for (std::int32_t dims : {0, 32, 16})
        for (bool hnd_layout : {false, true}) {
          CAPTURE(to_string(t));
          CAPTURE(int(style));
          CAPTURE(dims);
          CAPTURE(hnd_layout);
          const cpu::rope r{.theta = dims == 16 ? 500000.0 : 10000.0,
                            .dims = dims,
                            .style = style,
                            .freq_scale = dims == 32 ? 0.25 : 1.0};
          std::vector<std::uint8_t> buf(static_cast<std::size_t>((n + 2) * heads * d) * size_of(t));
          const tensor_view keys =
              hnd_layout ? hnd(buf.data(), t, n, heads, d, n + 2) : nhd(buf.data(), t, n, heads, d);
          std::vector<std::int64_t> pos(static_cast<std::size_t>(n)), delta(static_cast<std::size_t>(n));
          std::vector<std::vector<double>> raw;
          std::uniform_int_distribution<std::int64_t> small(-3000, 3000);
          for (std::int64_t j = 0; j < n; ++j) {
            // small positions, around 1e6, and deltas of both signs (and zero)
            pos[std::size_t(j)] = j % 3 == 0 ? 1000000 + 37 * j : j % 3 == 1 ? 5000 + j : 7 * j;
            delta[std::size_t(j)] = j % 4 == 0 ? 0 : j % 4 == 1 ? -pos[std::size_t(j)] + j : small(rng);
            if (j == 3) delta[std::size_t(j)] = -999990;
            for (std::int32_t h = 0; h < heads; ++h) {
              raw.push_back(random_row(d, rng));
              store(keys, j, h, naive_rope(raw.back(), double(pos[std::size_t(j)]), r));
            }
          }
          const std::vector<std::uint8_t> before = buf;
          cpu::rerotate(keys, delta, r);
          const std::int32_t rot = dims == 0 ? d : dims;
          for (std::int64_t j = 0; j < n; ++j)
            for (std::int32_t h = 0; h < heads; ++h) {
              const auto& x = raw[std::size_t(j * heads + h)];
              const auto want = naive_rope(x, double(pos[std::size_t(j)] + delta[std::size_t(j)]), r);
              const auto got = load(keys, j, h);
              const double scale = std::sqrt(dot(x, x) / d) + 1.0;
              for (std::int32_t e = 0; e < rot; ++e)
                REQUIRE(std::abs(got[std::size_t(e)] - want[std::size_t(e)]) <= tolerance(t) * scale);
              // dimensions past the rotary ones and rows with delta 0 are left bit for bit
              const std::size_t row_bytes = std::size_t(d) * size_of(t), el = size_of(t);
              const auto offset = static_cast<const std::uint8_t*>(keys.row(j, h)) - buf.data();
              if (delta[std::size_t(j)] == 0)
                CHECK(std::memcmp(buf.data() + offset, before.data() + offset, row_bytes) == 0);
              else
                CHECK(std::memcmp(buf.data() + offset + rot * el, before.data() + offset + rot * el,
                                  std::size_t(d - rot) * el) == 0);
            }
        }
}

TEST_CASE("rerotate composes: +delta then -delta returns the keys") {
  std::mt19937 rng(32);
  const std::int32_t d = 32;
  const std::int64_t n = 40;
  std::vector<float> k(static_cast<std::size_t>(n * d));
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& v : k) v = dist(rng);
  const auto k0 = k;
  const auto view = nhd(k.data(), dtype::f32, n, 1, d);
  std::vector<std::int64_t> delta(static_cast<std::size_t>(n)), back(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j)
    delta[std::size_t(j)] = (j - 20) * 12345, back[std::size_t(j)] = -delta[std::size_t(j)];
  for (auto style : {cpu::rope_style::normal, cpu::rope_style::neox}) {
    cpu::rerotate(view, delta, {.style = style}, cpu::executor{.threads = 2});
    CHECK(k != k0);
    cpu::rerotate(view, back, {.style = style});
    for (std::size_t i = 0; i < k.size(); ++i) REQUIRE(k[i] == doctest::Approx(k0[i]).epsilon(1e-5).scale(1.0));
  }
}

TEST_CASE("rerotate rejects bad arguments naming them") {
  std::vector<float> k(64);
  const auto view = nhd(k.data(), dtype::f32, 2, 1, 32);
  const std::vector<std::int64_t> delta{1, 2}, short_delta{1};
  CHECK_THROWS_WITH_AS(cpu::rerotate(view, short_delta, {}), doctest::Contains("delta.size() = 1"), error);
  CHECK_THROWS_WITH_AS(cpu::rerotate(view, delta, {.dims = 7}), doctest::Contains("rope.dims = 7"), error);
  CHECK_THROWS_WITH_AS(cpu::rerotate(view, delta, {.dims = 34}), doctest::Contains("rope.dims = 34"), error);
  CHECK_THROWS_WITH_AS(cpu::rerotate(view, delta, {.theta = -1.0}), doctest::Contains("rope.theta = -1"), error);
  CHECK_THROWS_WITH_AS(cpu::rerotate(view, delta, {.freq_scale = 0.0}), doctest::Contains("rope.freq_scale = 0"),
                       error);
}

TEST_CASE("after eviction, compact positions and re-rotation keep logits relative") {
  std::mt19937 rng(33);
  const std::int32_t d = 64;
  const std::int64_t n = 48, P = 5000;
  for (auto style : {cpu::rope_style::normal, cpu::rope_style::neox}) {
    CAPTURE(int(style));
    const cpu::rope r{.dims = 48, .style = style};
    // keys at scattered positions (with holes) before P, stored post-RoPE as an engine caches them
    std::vector<float> k(static_cast<std::size_t>(n * d));
    const auto keys = nhd(k.data(), dtype::f32, n, 1, d);
    std::vector<token> tokens(static_cast<std::size_t>(n));
    std::vector<std::vector<double>> raw;
    std::int64_t p = 100;
    for (std::int64_t j = 0; j < n; ++j) {
      p += j < 24 ? 1 + std::int64_t(rng() % 5) : 1;  // holes among the oldest, then consecutive
      tokens[std::size_t(j)] = {p, std::int32_t(j / 8), modality::text};
      raw.push_back(random_row(d, rng));
      store(keys, j, 0, naive_rope(raw.back(), double(p), r));
    }
    const auto qraw = random_row(d, rng);
    std::vector<float> q(static_cast<std::size_t>(d));
    const auto query = nhd(q.data(), dtype::f32, 1, 1, d);
    store(query, 0, 0, naive_rope(qraw, double(P), r));
    const auto logits = [&](std::int64_t count) {
      std::vector<double> out;
      const auto qf = load(query, 0, 0);
      for (std::int64_t j = 0; j < count; ++j) {
        const auto kf = load(keys, j, 0);
        double s = 0;
        for (std::int32_t e = 0; e < d; ++e) s += double(qf[std::size_t(e)]) * kf[std::size_t(e)];
        out.push_back(s);
      }
      return out;
    };
    const auto before = logits(n);
    for (std::int64_t j = 0; j < n; ++j)  // sanity: the stored keys and query realise the RoPE logits
      REQUIRE(before[std::size_t(j)] ==
              doctest::Approx(dot(naive_rope(qraw, double(P), r),
                                  naive_rope(raw[std::size_t(j)], double(tokens[std::size_t(j)].pos), r)))
                  .epsilon(1e-4)
                  .scale(1.0));

    // evict the 20 oldest but the first 4 (sinks): the kept tail keeps its mutual spacing
    std::vector<std::int64_t> kept_slots{0, 1, 2, 3};
    for (std::int64_t j = 24; j < n; ++j) kept_slots.push_back(j);
    keep_set keep(n);
    keep.add_unit(kept_slots);
    kv_view kv{keys, {}};
    const std::int64_t m = cpu::compact(kv, tokens, keep);
    tokens.resize(std::size_t(m));
    const auto old_tokens = tokens;
    const auto delta = cpu::compact_positions(tokens, 0);
    for (std::int64_t i = 0; i < m; ++i) {
      CHECK(tokens[std::size_t(i)].pos == i);
      CHECK(delta[std::size_t(i)] == i - old_tokens[std::size_t(i)].pos);
    }
    cpu::rerotate(kv.k, delta, r);
    // the query moves by the shift of the newest key: the distance to it is unchanged
    const std::int64_t shift = delta.back();
    std::vector<std::int64_t> qdelta{shift};
    cpu::rerotate(query, qdelta, r);
    const auto after = logits(m);
    for (std::int64_t i = 0; i < m; ++i) {
      const auto src = kept_slots[std::size_t(i)];
      const double want_rel = dot(naive_rope(qraw, double(P + shift), r),
                                  naive_rope(raw[std::size_t(src)], double(tokens[std::size_t(i)].pos), r));
      CHECK(after[std::size_t(i)] == doctest::Approx(want_rel).epsilon(1e-4).scale(1.0));
      if (delta[std::size_t(i)] == shift)  // same shift as the query: logit unchanged
        CHECK(after[std::size_t(i)] == doctest::Approx(before[std::size_t(src)]).epsilon(1e-4).scale(1.0));
    }
    // the consecutive tail all got the query's shift ...
    for (std::int64_t i = 4; i < m; ++i) CHECK(delta[std::size_t(i)] == shift);
    // ... and the sinks, moved by a different amount, see their distance to the query change
    CHECK(delta[0] != shift);
    CHECK(after[0] != doctest::Approx(before[0]).epsilon(1e-3));
  }
}

TEST_CASE("compact_positions gives consecutive positions in time order and keeps shared ones shared") {
  // slot order is not time order; positions 5 and 9 are each held by several slots
  std::vector<token> t{{9, 2, modality::image}, {5, 0, modality::image}, {12, 3, modality::text},
                       {9, 2, modality::image}, {5, 0, modality::image}, {7, 1, modality::text},
                       {9, 2, modality::image}};
  const auto delta = cpu::compact_positions(t, 100);
  const std::vector<std::int64_t> want_pos{102, 100, 103, 102, 100, 101, 102};
  const std::vector<std::int64_t> want_delta{93, 95, 91, 93, 95, 94, 93};
  for (std::size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].pos == want_pos[i]);
    CHECK(delta[i] == want_delta[i]);
  }
  CHECK(t[0].segment == 2);  // metadata other than the position is kept
  CHECK(t[2].kind == modality::text);
  std::vector<token> empty;
  CHECK(cpu::compact_positions(empty).empty());
  auto again = t;  // already compact from 100: no movement
  const auto zero = cpu::compact_positions(again, 100);
  CHECK(std::all_of(zero.begin(), zero.end(), [](std::int64_t x) { return x == 0; }));
}

TEST_CASE("compact_positions with max_gap narrows each gap to at most max_gap free positions") {
  // slot order is not time order; origins 0 1 2 | gap 7 | 10 11 | gap 1 | 13 | gap 2 | 16 16 (shared)
  std::vector<token> t{{13, 0, modality::text}, {0, 0, modality::text}, {16, 1, modality::image},
                       {10, 0, modality::text}, {1, 0, modality::text}, {16, 1, modality::image},
                       {2, 0, modality::text},  {11, 0, modality::text}};
  auto gapped = t;
  const auto delta = cpu::compact_positions(gapped, 0, 3);
  // by hand: 0 1 2, then 10 -> 2 + min(8, 4) = 6, 11 -> 7, 13 -> 7 + min(2, 4) = 9, 16 -> 9 + min(3, 4) = 12
  const std::vector<std::int64_t> want_pos{9, 0, 12, 6, 1, 12, 2, 7};
  for (std::size_t i = 0; i < t.size(); ++i) {
    CHECK(gapped[i].pos == want_pos[i]);
    CHECK(delta[i] == want_pos[i] - t[i].pos);
  }
  auto again = gapped;  // every gap now at most 3: nothing moves
  const auto zero = cpu::compact_positions(again, 0, 3);
  CHECK(std::all_of(zero.begin(), zero.end(), [](std::int64_t x) { return x == 0; }));
  auto closed = t;  // max_gap 0 closes every gap, as without it
  cpu::compact_positions(closed, 0, 0);
  auto plain = t;
  cpu::compact_positions(plain, 0);
  for (std::size_t i = 0; i < t.size(); ++i) CHECK(closed[i].pos == plain[i].pos);
  auto bad = t;
  CHECK_THROWS_WITH_AS(cpu::compact_positions(bad, 0, -1), doctest::Contains("max_gap"), infkv::error);
  CHECK(bad[0].pos == 13);  // refused before anything moved
}
