// The archive against float64 references of its definitions: f16 parameters rounded outward,
// group-wise codes and their error bound per bit width, pages cut from a keep set's evictions
// and restored, page bounds, the displacement rule with ties, and recall end to end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

using namespace infkv;

namespace {

/// Every finite f16 value, decoded from its bits by the format's definition, increasing.
const std::vector<double>& f16_values() {
  static const std::vector<double> v = [] {
    std::vector<double> out;
    for (std::uint32_t b = 0; b < 0x10000; ++b) {
      const std::uint32_t e = (b >> 10) & 31, m = b & 1023;
      if (e == 31) continue;
      const double mag = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + double(m) / 1024.0, int(e) - 15);
      out.push_back((b & 0x8000) ? -mag : mag);
    }
    std::sort(out.begin(), out.end());
    return out;
  }();
  return v;
}
double ref_down(double x) { return *(std::upper_bound(f16_values().begin(), f16_values().end(), x) - 1); }
double ref_up(double x) { return *std::lower_bound(f16_values().begin(), f16_values().end(), x); }

struct ref_params {
  double lo, step;
};
/// The code of x: round((x - lo) / step) clamped to [0, 2^b - 1]; -1 when x sits within 1e-4 of
/// a half step (f32 and f64 may round it either way).
int ref_code(double x, const ref_params& p, int bits) {
  if (p.step == 0) return 0;
  const double r = (x - p.lo) / p.step;
  if (std::fabs(r - std::floor(r) - 0.5) < 1e-4) return -1;
  return int(std::clamp(std::nearbyint(r), 0.0, double((1 << bits) - 1)));
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float sd = 2.f) {
  std::normal_distribution<float> dist(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// A cache of n slots, H heads of d, L layers, f32 NHD.
struct cache {
  std::int32_t L, H, d;
  std::int64_t n;
  std::vector<std::vector<float>> k, v;
  std::vector<token> tokens;
  cache(std::int32_t L_, std::int32_t H_, std::int32_t d_, std::int64_t n_, std::mt19937& rng)
      : L(L_), H(H_), d(d_), n(n_), tokens(text_tokens(n_)) {
    for (std::int32_t l = 0; l < L; ++l) {
      k.push_back(random_floats(std::size_t(n * H * d), rng));
      v.push_back(random_floats(std::size_t(n * H * d), rng));
    }
  }
  float key(std::int32_t l, std::int64_t j, std::int32_t h, std::int32_t c) const {
    return k[std::size_t(l)][std::size_t((j * H + h) * d + c)];
  }
  float value(std::int32_t l, std::int64_t j, std::int32_t h, std::int32_t c) const {
    return v[std::size_t(l)][std::size_t((j * H + h) * d + c)];
  }
  std::vector<layer_inputs<>> inputs() const {
    std::vector<layer_inputs<>> out{std::size_t(L)};
    for (std::int32_t l = 0; l < L; ++l) {
      out[std::size_t(l)].keys = nhd(static_cast<const void*>(k[std::size_t(l)].data()), dtype::f32, n, H, d);
      out[std::size_t(l)].values = nhd(static_cast<const void*>(v[std::size_t(l)].data()), dtype::f32, n, H, d);
      out[std::size_t(l)].tokens = tokens;
    }
    return out;
  }
};

archive_options opts(std::int32_t page, std::int32_t kb, std::int32_t vb, std::size_t capacity, std::int32_t vg = 0) {
  archive_options o;
  o.page_tokens = page, o.key_bits = kb, o.value_bits = vb, o.capacity_bytes = capacity, o.value_group = vg;
  return o;
}

std::int64_t archive_all(archive& a, const cache& c, const keep_set& keep, std::int32_t layer = 0) {
  const auto in = c.inputs();
  cpu::workspace ws(cpu::archive_scratch_bytes(a, c.n));
  const std::span<const layer_inputs<>> layers = a.shape().g == granularity::per_token
                                                     ? std::span<const layer_inputs<>>(in)
                                                     : std::span<const layer_inputs<>>(&in[std::size_t(layer)], 1);
  return cpu::archive_evicted(a, layers, keep, ws.span(), layer);
}

}  // namespace

TEST_CASE("archive: f16 parameters round outward, exactly as the format defines") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int i = 0; i < 20000; ++i) {
    const float x = u(rng) * std::ldexp(1.f, int(rng() % 40) - 24);
    CHECK(double(f16_to_f32(f16_round_down(x, "x"))) == ref_down(double(x)));
    CHECK(double(f16_to_f32(f16_round_up(x, "x"))) == ref_up(double(x)));
  }
  for (const float x : {0.f, -0.f, 65504.f, -65504.f, 6e-8f, -6e-8f, 1e-9f, -1e-9f}) {
    CHECK(double(f16_to_f32(f16_round_down(x, "x"))) == ref_down(double(x)));
    CHECK(double(f16_to_f32(f16_round_up(x, "x"))) == ref_up(double(x)));
  }
  CHECK_THROWS_WITH(f16_round_down(-70000.f, "lo"), doctest::Contains("lo = -70000"));
  CHECK_THROWS_WITH(f16_round_up(std::numeric_limits<float>::quiet_NaN(), "step"), doctest::Contains("step = nan"));
}

TEST_CASE("archive: group codes are within half a step of every value, per bit width") {
  std::mt19937 rng(11);
  for (const int bits : {2, 4, 8}) {
    double worst = 0.0;  // the largest error in steps
    int near_ties = 0;
    for (int g = 0; g < 400; ++g) {
      const float sd = std::ldexp(1.f, int(rng() % 16) - 8);
      auto x = random_floats(32, rng, sd);
      if (g % 50 == 0) std::fill(x.begin(), x.end(), x[0]);  // a constant group
      const auto [mn, mx] = std::minmax_element(x.begin(), x.end());
      const quant_params q = make_quant_params(*mn, *mx, bits);
      const double lo = f16_to_f32(q.lo), step = f16_to_f32(q.step);
      CHECK(lo == ref_down(*mn));
      CHECK(lo <= *mn);
      CHECK(lo + step * ((1 << bits) - 1) >= *mx);  // the range covers the group
      CHECK(step == ref_up((double(*mx) - lo) / ((1 << bits) - 1)));
      for (const float xi : x) {
        const auto c = quant_code(xi, float(lo), float(step), bits);
        const int rc = ref_code(xi, {lo, step}, bits);
        if (rc < 0)
          ++near_ties;
        else
          CHECK(int(c) == rc);
        const double err = std::fabs(double(xi) - (lo + double(c) * step));
        CHECK(err <= step / 2 * (1 + 1e-5) + 1e-7 * std::fabs(xi));
        if (step > 0) worst = std::max(worst, err / step);
      }
    }
    MESSAGE("bits " << bits << ": worst error " << worst << " steps, near ties " << near_ties);
    CHECK(worst <= 0.5 + 1e-5);
  }
}

TEST_CASE("archive: codes pack least significant bits first") {
  for (const int bits : {2, 4, 8}) {
    std::vector<std::uint8_t> buf(64, 0xa5);
    std::mt19937 rng(bits);
    std::vector<std::uint32_t> c(64 * 8 / std::size_t(bits));
    for (std::size_t i = 0; i < c.size(); ++i) set_code(buf.data(), std::int64_t(i), bits, c[i] = rng() % (1u << bits));
    for (std::size_t i = 0; i < c.size(); ++i) {
      CHECK(code_at(buf.data(), std::int64_t(i), bits) == c[i]);
      const std::size_t bit = i * std::size_t(bits);
      CHECK(((buf[bit / 8] >> (bit % 8)) & ((1u << bits) - 1)) == c[i]);
    }
  }
}

TEST_CASE("archive: evicted slots become pages in time order, restored within each group's bound") {
  std::mt19937 rng(3);
  for (const auto g : {granularity::per_token, granularity::per_layer, granularity::per_head})
    for (const int bits : {2, 4, 8}) {
      CAPTURE(to_string(g));
      CAPTURE(bits);
      const std::int32_t L = 2, H = 2, d = 8, P = 5;
      const std::int64_t n = 40;
      cache c(L, H, d, n, rng);
      std::shuffle(c.tokens.begin(), c.tokens.end(), rng);  // slot order is not time order
      const archive_shape s{L, H, d, g};
      archive a(s, opts(P, bits, bits, 1 << 20, 4));
      const std::int32_t units = s.units(), layer = g == granularity::per_token ? 0 : 1;
      keep_set keep(n);
      std::vector<std::vector<std::int64_t>> evicted{std::size_t(units)};
      for (std::int32_t u = 0; u < units; ++u) {
        std::vector<std::int64_t> kept;
        for (std::int64_t j = 0; j < n; ++j) (rng() % 3 == 0 ? kept : evicted[std::size_t(u)]).push_back(j);
        keep.add_unit(kept);
        std::sort(evicted[std::size_t(u)].begin(), evicted[std::size_t(u)].end(),
                  [&](auto x, auto y) { return c.tokens[std::size_t(x)].pos < c.tokens[std::size_t(y)].pos; });
      }
      const std::int64_t pages = archive_all(a, c, keep, layer);
      std::int64_t want = 0;
      for (auto& e : evicted) want += (std::int64_t(e.size()) + P - 1) / P;
      REQUIRE(pages == want);
      REQUIRE(a.held_pages() == want);
      const auto held = a.held();
      std::size_t pi = 0;
      for (std::int32_t u = 0; u < units; ++u)
        for (std::size_t first = 0; first < evicted[std::size_t(u)].size(); first += P, ++pi) {
          const std::int32_t p = held[pi];
          const auto& e = evicted[std::size_t(u)];
          const std::size_t cnt = std::min<std::size_t>(P, e.size() - first);
          REQUIRE(a.info(p).unit == u);
          REQUIRE(a.info(p).layer == layer);
          REQUIRE(a.tokens(p).size() == cnt);
          for (std::size_t t = 0; t < cnt; ++t) CHECK(a.tokens(p)[t].pos == c.tokens[std::size_t(e[first + t])].pos);
          // restore into a scratch cache and check every element against the reference parameters
          const std::int32_t LP = s.layers_per_page();
          std::vector<std::vector<float>> rk(std::size_t(LP), std::vector<float>(std::size_t(P * H * d), 0.f)), rv = rk;
          std::vector<kv_view> out;
          for (std::int32_t l = 0; l < LP; ++l)
            out.push_back(contiguous_nhd(rk[std::size_t(l)].data(), rv[std::size_t(l)].data(), dtype::f32, P, H, d));
          cpu::restore(a, p, out, 0);
          for (std::int32_t l = 0; l < LP; ++l)
            for (std::int32_t h = 0; h < H; ++h) {
              if (g == granularity::per_head && h != u) continue;
              for (std::int32_t ch = 0; ch < d; ++ch) {  // keys: one group per channel over the page
                double mn = 1e300, mx = -1e300;
                for (std::size_t t = 0; t < cnt; ++t)
                  mn = std::min(mn, double(c.key(layer + l, e[first + t], h, ch))),
                  mx = std::max(mx, double(c.key(layer + l, e[first + t], h, ch)));
                const ref_params rp{ref_down(mn), ref_up((mx - ref_down(mn)) / ((1 << bits) - 1))};
                for (std::size_t t = 0; t < cnt; ++t) {
                  const double x = c.key(layer + l, e[first + t], h, ch);
                  const double got =
                      rk[std::size_t(l)][(t * std::size_t(H) + std::size_t(h)) * std::size_t(d) + std::size_t(ch)];
                  const int rc = ref_code(x, rp, bits);
                  if (rc >= 0) CHECK(got == doctest::Approx(rp.lo + rc * rp.step).epsilon(1e-6).scale(1.0));
                  CHECK(std::fabs(got - x) <= rp.step / 2 * (1 + 1e-5) + 1e-6);
                }
              }
              for (std::size_t t = 0; t < cnt; ++t)  // values: groups of 4 channels per token
                for (std::int32_t g0 = 0; g0 < d; g0 += 4) {
                  double mn = 1e300, mx = -1e300;
                  for (std::int32_t ch = g0; ch < g0 + 4; ++ch)
                    mn = std::min(mn, double(c.value(layer + l, e[first + t], h, ch))),
                    mx = std::max(mx, double(c.value(layer + l, e[first + t], h, ch)));
                  const ref_params rp{ref_down(mn), ref_up((mx - ref_down(mn)) / ((1 << bits) - 1))};
                  for (std::int32_t ch = g0; ch < g0 + 4; ++ch) {
                    const double x = c.value(layer + l, e[first + t], h, ch);
                    const double got =
                        rv[std::size_t(l)][(t * std::size_t(H) + std::size_t(h)) * std::size_t(d) + std::size_t(ch)];
                    CHECK(std::fabs(got - x) <= rp.step / 2 * (1 + 1e-5) + 1e-6);
                  }
                }
            }
        }
    }
}

TEST_CASE("archive: a byte capacity in whole pages, drop_oldest drops the earliest, error changes nothing") {
  std::mt19937 rng(5);
  const archive_shape s{1, 1, 8, granularity::per_token};
  const page_layout lay(s, opts(4, 4, 4, 1));
  // docs/design.md's figure: 4 bits, 32 tokens, value groups of head_dim 64
  CHECK(page_layout(archive_shape{1, 1, 64, granularity::per_token}, opts(32, 4, 4, 1)).row_bytes == 2432);
  cache c(1, 1, 8, 12, rng);
  archive a(s, opts(4, 4, 4, 3 * lay.bytes + 7));
  CHECK(a.capacity_pages() == 3);
  CHECK(a.memory() >= 3 * lay.bytes);
  keep_set first(12);
  first.add_unit(std::vector<std::int64_t>{8, 9, 10, 11});  // evicts 0..7: two pages
  CHECK(archive_all(a, c, first) == 2);
  CHECK(a.held_tokens() == 8);
  CHECK(a.held_bytes() == 2 * (lay.bytes + 4 * sizeof(token)));
  keep_set second(12);
  second.add_unit(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7});  // evicts 8..11: a third page
  archive_all(a, c, second);
  archive_all(a, c, second);  // a fourth: the earliest (positions 0..3) leaves
  CHECK(a.held_pages() == 3);
  CHECK(a.stats().dropped_pages == 1);
  CHECK(a.stats().dropped_tokens == 4);
  std::vector<std::int64_t> firsts;
  for (auto p : a.held()) firsts.push_back(a.tokens(p)[0].pos);
  CHECK(firsts == std::vector<std::int64_t>{4, 8, 8});

  archive_options eo = opts(4, 4, 4, 2 * lay.bytes);
  eo.full = when_full::error;
  archive e(s, eo);
  archive_all(e, c, second);
  CHECK_THROWS_WITH(archive_all(e, c, first), doctest::Contains("has room for 1 pages; this eviction archives 2"));
  CHECK(e.held_pages() == 1);
  CHECK(e.stats().archived_pages == 1);
  e.release(e.held()[0]);
  CHECK(e.held_pages() == 0);
  CHECK(e.stats().released_tokens == 4);
  CHECK_THROWS_WITH(e.release(0), doctest::Contains("page = 0: is not a page the archive holds"));
}

TEST_CASE("archive: bad input names the argument, a failing archive call changes nothing") {
  std::mt19937 rng(9);
  const archive_shape s{2, 2, 8, granularity::per_token};
  CHECK_THROWS_WITH(archive(s, opts(4, 3, 4, 1 << 20)), doctest::Contains("archive_options.key_bits = 3"));
  CHECK_THROWS_WITH(archive(s, opts(4, 4, 4, 1 << 20, 3)), doctest::Contains("archive_options.value_group = 3"));
  CHECK_THROWS_WITH(archive(s, opts(4, 4, 4, 10)),
                    doctest::Contains("archive_options.capacity_bytes = 10: holds no page"));
  CHECK_THROWS_WITH(archive(s, opts(0, 4, 4, 1 << 20)), doctest::Contains("archive_options.page_tokens = 0"));
  archive a(s, opts(4, 4, 4, 1 << 20));
  cache c(2, 2, 8, 10, rng);
  keep_set keep(10);
  keep.add_unit(std::vector<std::int64_t>{0, 9});
  c.k[1][std::size_t((5 * 2 + 1) * 8 + 3)] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(archive_all(a, c, keep), doctest::Contains("layers[1].keys at slot 5, head 1, channel 3 = inf"));
  CHECK(a.held_pages() == 0);
  CHECK(a.stats().archived_pages == 0);
  c.k[1][std::size_t((5 * 2 + 1) * 8 + 3)] = 1e5f;
  CHECK_THROWS_WITH(archive_all(a, c, keep), doctest::Contains("|x| <= 65504"));
  c.k[1][std::size_t((5 * 2 + 1) * 8 + 3)] = 1.f;
  archive other(archive_shape{2, 4, 8, granularity::per_token}, opts(4, 4, 4, 1 << 20));
  CHECK_THROWS_WITH(archive_all(other, c, keep), doctest::Contains("the archive holds 4 heads of 8"));
  archive heads(archive_shape{2, 2, 8, granularity::per_head}, opts(4, 4, 4, 1 << 20));
  CHECK_THROWS_WITH(archive_all(heads, c, keep, 0),
                    doctest::Contains("keep.n_units = 1: the archive's per_head pages take 2"));
}

namespace {

/// The page bound's definition in double, from the reference dequantized key range.
double ref_bound(const archive& a, std::int32_t p, const std::vector<std::vector<float>>& q, std::int32_t qh,
                 std::int64_t nq, double scale) {
  const auto& s = a.shape();
  const auto& info = a.info(p);
  double total = 0;
  for (std::int32_t lp = 0; lp < s.layers_per_page(); ++lp) {
    double best = -1e300;
    for (std::int32_t hp = 0; hp < s.heads_per_page(); ++hp) {
      const std::int32_t h = s.g == granularity::per_head ? info.unit : hp;
      const auto hd = static_cast<std::size_t>(s.head_dim);
      std::vector<float> mn(hd, 1e30f), mx(hd, -1e30f), row(hd);
      for (std::int32_t t = 0; t < info.n_tokens; ++t) {
        cpu::dequantize(a, p, lp * s.heads_per_page() + hp, t, false, row.data());
        for (std::int32_t c = 0; c < s.head_dim; ++c)
          mn[std::size_t(c)] = std::min(mn[std::size_t(c)], row[std::size_t(c)]),
          mx[std::size_t(c)] = std::max(mx[std::size_t(c)], row[std::size_t(c)]);
      }
      const std::int32_t G = qh / s.kv_heads;
      for (std::int64_t i = 0; i < nq; ++i)
        for (std::int32_t g = 0; g < G; ++g) {
          double sum = 0;
          for (std::int32_t c = 0; c < s.head_dim; ++c) {
            const double qc = q[std::size_t(info.layer + lp)][std::size_t((i * qh + h * G + g) * s.head_dim + c)];
            sum += std::max(qc * mn[std::size_t(c)], qc * mx[std::size_t(c)]);
          }
          best = std::max(best, scale * sum);
        }
    }
    total += best;
  }
  return total;
}

}  // namespace

TEST_CASE("archive: a page's bound is at least its logits and no looser than the codes' range") {
  std::mt19937 rng(21);
  for (const auto g : {granularity::per_token, granularity::per_layer, granularity::per_head}) {
    const std::int32_t L = 2, H = 2, d = 16, qh = 4;
    const std::int64_t n = 30, nq = 3;
    cache c(L, H, d, n, rng);
    const archive_shape s{L, H, d, g};
    archive a(s, opts(6, 4, 4, 1 << 20));
    keep_set keep(n);
    for (std::int32_t u = 0; u < s.units(); ++u) keep.add_unit(std::vector<std::int64_t>{0, 1, 29});
    archive_all(a, c, keep, g == granularity::per_token ? 0 : 1);
    std::vector<std::vector<float>> q;
    std::vector<const_tensor_view> qv;
    for (std::int32_t l = 0; l < L; ++l) q.push_back(random_floats(std::size_t(nq * qh * d), rng));
    for (std::int32_t l = 0; l < L; ++l)
      qv.push_back(nhd(static_cast<const void*>(q[std::size_t(l)].data()), dtype::f32, nq, qh, d));
    std::vector<float> b(static_cast<std::size_t>(a.capacity_pages()));
    const float scale = 0.25f;
    cpu::page_bounds(a, qv, scale, b);
    for (std::int32_t p = 0; p < a.capacity_pages(); ++p) {
      if (!a.holds(p)) {
        CHECK(b[std::size_t(p)] == -std::numeric_limits<float>::infinity());
        continue;
      }
      // the dequantized range of the codes may be narrower than [lo, lo + rmax step]: the bound
      // from the parameters is at least the bound from the values, which is at least every logit
      const double from_values = ref_bound(a, p, q, qh, nq, scale);
      CHECK(double(b[std::size_t(p)]) >= from_values - 1e-4 * (1 + std::fabs(from_values)));
      const auto& info = a.info(p);
      for (std::int32_t lp = 0; lp < s.layers_per_page(); ++lp) {
        double best = -1e300;
        for (std::int32_t hp = 0; hp < s.heads_per_page(); ++hp) {
          const std::int32_t h = g == granularity::per_head ? info.unit : hp;
          std::vector<float> k(static_cast<std::size_t>(d));
          for (std::int32_t t = 0; t < info.n_tokens; ++t) {
            cpu::dequantize(a, p, lp * s.heads_per_page() + hp, t, false, k.data());
            for (std::int64_t i = 0; i < nq; ++i)
              for (std::int32_t gq = 0; gq < qh / H; ++gq) {
                double dot = 0;
                for (std::int32_t ch = 0; ch < d; ++ch)
                  dot += double(k[std::size_t(ch)]) *
                         q[std::size_t(info.layer + lp)][std::size_t((i * qh + h * (qh / H) + gq) * d + ch)];
                best = std::max(best, scale * dot);
              }
          }
        }
        CHECK(best <= from_values + 1e-4);  // per layer the bound covers the layer's best logit
      }
    }
  }
}

namespace {

/// The displacement rule's definition, step by step in double with plain scans.
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> ref_decide(
    const std::vector<float>& sc, const std::vector<token>& tok, std::int64_t n_cache,
    const std::vector<cpu::recall_candidate>& cands, std::int64_t sinks, std::int64_t recent, std::int64_t budget,
    std::int64_t neighbours) {
  std::vector<std::int64_t> byt(static_cast<std::size_t>(n_cache));
  std::iota(byt.begin(), byt.end(), 0);
  std::stable_sort(byt.begin(), byt.end(),
                   [&](auto a, auto b) { return tok[std::size_t(a)].pos < tok[std::size_t(b)].pos; });
  std::vector<std::int64_t> pool;
  for (std::int64_t i = 0; i < n_cache; ++i)
    if (i >= sinks && i < n_cache - recent) pool.push_back(byt[std::size_t(i)]);
  // worse(a, b): a is displaced before b
  const auto worse = [&](std::int64_t a, std::int64_t b) {
    if (sc[std::size_t(a)] != sc[std::size_t(b)]) return sc[std::size_t(a)] < sc[std::size_t(b)];
    if (tok[std::size_t(a)].pos != tok[std::size_t(b)].pos) return tok[std::size_t(a)].pos < tok[std::size_t(b)].pos;
    return a > b;
  };
  std::vector<bool> taken(cands.size(), false), considered(cands.size(), false);  // brought back; tested
  std::vector<std::int64_t> chosen, displaced;
  std::int64_t used = 0;
  std::vector<bool> gone(static_cast<std::size_t>(n_cache), false);
  for (std::size_t round = 0; round < cands.size(); ++round) {
    // the next candidate by mean, then newer first position, then lower page
    std::int64_t best = -1;
    double bm = 0;
    for (std::size_t c = 0; c < cands.size(); ++c) {
      if (taken[c] || considered[c]) continue;
      double m = 0;
      for (auto j = cands[c].begin; j < cands[c].end; ++j) m += sc[std::size_t(j)];
      m /= double(cands[c].end - cands[c].begin);
      const bool better =
          best < 0 || m > bm ||
          (m == bm && (tok[std::size_t(cands[c].begin)].pos > tok[std::size_t(cands[std::size_t(best)].begin)].pos ||
                       (tok[std::size_t(cands[c].begin)].pos == tok[std::size_t(cands[std::size_t(best)].begin)].pos &&
                        cands[c].page < cands[std::size_t(best)].page)));
      if (better) best = std::int64_t(c), bm = m;
    }
    if (best < 0) break;
    considered[std::size_t(best)] = true;
    // the m worst slots left, by repeated scans
    const auto victims_of = [&](std::int64_t m) {
      std::vector<std::int64_t> left, victims;
      for (auto j : pool)
        if (!gone[std::size_t(j)]) left.push_back(j);
      if (m > std::int64_t(left.size())) return std::optional<std::vector<std::int64_t>>{};
      for (std::int64_t i = 0; i < m; ++i) {
        std::int64_t w = -1;
        for (auto j : left)
          if (std::find(victims.begin(), victims.end(), j) == victims.end() && (w < 0 || worse(j, w))) w = j;
        victims.push_back(w);
      }
      return std::optional<std::vector<std::int64_t>>{victims};
    };
    const auto size = [&](std::int64_t c) { return cands[std::size_t(c)].end - cands[std::size_t(c)].begin; };
    const auto bring = [&](std::int64_t c, const std::vector<std::int64_t>& victims) {
      taken[std::size_t(c)] = true;
      chosen.push_back(c);
      for (auto j : victims) gone[std::size_t(j)] = true, displaced.push_back(j);
      used += size(c);
    };
    const auto& x = cands[std::size_t(best)];
    const std::int64_t m = size(best);
    const auto victims = victims_of(m);
    if (used + m > budget || !victims) continue;
    double vs = 0, cs = 0;
    for (auto j : *victims) vs += sc[std::size_t(j)];
    for (auto j = x.begin; j < x.end; ++j) cs += sc[std::size_t(j)];
    if (!(cs > vs)) continue;
    bring(best, *victims);
    // its neighbours: joined candidates, nearest first, the next before the previous
    for (std::int64_t step = 1; step <= neighbours; ++step)
      for (const std::int64_t dir : {1, -1}) {
        const std::int64_t c = best + dir * step;
        if (c < 0 || c >= std::int64_t(cands.size())) continue;
        bool joined = true;  // every candidate from best to c joins its previous
        for (std::int64_t e = std::min(best, c) + 1; e <= std::max(best, c); ++e)
          joined = joined && cands[std::size_t(e)].joins_previous;
        if (!joined || taken[std::size_t(c)] || used + size(c) > budget) continue;
        if (const auto v = victims_of(size(c))) bring(c, *v);
      }
  }
  std::sort(displaced.begin(), displaced.end());
  return {chosen, displaced};
}

}  // namespace

TEST_CASE("archive: the displacement rule equals its definition, ties and neighbours included") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 400; ++trial) {
    const std::int64_t n_cache = 5 + rng() % 30, nc = 1 + rng() % 6;
    std::vector<token> tok = text_tokens(n_cache, 100);
    std::shuffle(tok.begin(), tok.end(), rng);
    std::vector<cpu::recall_candidate> cands;
    std::int64_t at = n_cache;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(nc));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (std::int64_t c = 0; c < nc; ++c) {
      const std::int64_t m = 1 + rng() % 4;
      const std::int64_t p0 = trial % 3 == 0 ? 10 : std::int64_t(rng() % 90);  // equal first positions, sometimes
      for (std::int64_t t = 0; t < m; ++t) tok.push_back({p0 + t, 0, modality::text});
      cands.push_back({ids[std::size_t(c)], at, at + m, c > 0 && rng() % 3 != 0});
      at += m;
    }
    std::vector<float> sc(static_cast<std::size_t>(at));
    for (auto& x : sc) x = float(rng() % 5) * 0.25f;  // few distinct values: many ties
    const std::int64_t sinks = rng() % 3, recent = rng() % 4, bud = 1 + rng() % 12;
    const std::int32_t neighbours = std::int32_t(trial % 3);
    std::vector<std::int64_t> work(static_cast<std::size_t>(2 * n_cache + 2 * nc)),
        chosen(static_cast<std::size_t>(nc)), displaced(static_cast<std::size_t>(n_cache));
    budget protect;
    protect.capacity = n_cache, protect.sinks = sinks, protect.recent = recent;
    const auto [nch, nd] =
        cpu::decide_recall(sc, tok, n_cache, cands, protect, bud, neighbours, work, chosen, displaced);
    const auto [rc, rd] = ref_decide(sc, tok, n_cache, cands, std::min(sinks, n_cache),
                                     std::min(recent, n_cache - std::min(sinks, n_cache)), bud, neighbours);
    CHECK(std::vector<std::int64_t>(chosen.begin(), chosen.begin() + nch) == rc);
    CHECK(std::vector<std::int64_t>(displaced.begin(), displaced.begin() + nd) == rd);
  }
}

TEST_CASE("archive: recall brings back the page a question asks for and displaces the cache's worst") {
  std::mt19937 rng(17);
  const std::int32_t L = 2, H = 2, d = 16, qh = 4;
  const std::int64_t n = 96, kept = 48, nq = 4;
  cache full(L, H, d, n, rng);
  // the "needle": positions 20..23 hold keys along the question's direction
  std::vector<float> dir = random_floats(std::size_t(d), rng, 1.f);
  for (std::int32_t l = 0; l < L; ++l)
    for (std::int64_t j = 20; j < 24; ++j)
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t c = 0; c < d; ++c)
          full.k[std::size_t(l)][std::size_t((j * H + h) * d + c)] = 3.f * dir[std::size_t(c)];
  // the cache kept sinks 0..3 and the last 44 positions; 4..51 went to the archive
  std::vector<std::int64_t> keep_slots{0, 1, 2, 3};
  for (std::int64_t j = n - (kept - 4); j < n; ++j) keep_slots.push_back(j);
  keep_set keep(n);
  keep.add_unit(keep_slots);
  archive a(archive_shape{L, H, d, granularity::per_token}, opts(4, 4, 4, 1 << 20));
  archive_all(a, full, keep);
  CHECK(a.held_pages() == 12);
  cache cached(L, H, d, kept, rng);
  for (std::int32_t l = 0; l < L; ++l)
    for (std::int64_t i = 0; i < kept; ++i) {
      const std::int64_t j = keep_slots[std::size_t(i)];
      std::copy_n(full.k[std::size_t(l)].begin() + j * H * d, H * d, cached.k[std::size_t(l)].begin() + i * H * d);
      std::copy_n(full.v[std::size_t(l)].begin() + j * H * d, H * d, cached.v[std::size_t(l)].begin() + i * H * d);
    }
  for (std::int64_t i = 0; i < kept; ++i)
    cached.tokens[std::size_t(i)] = full.tokens[std::size_t(keep_slots[std::size_t(i)])];
  std::vector<std::vector<float>> q;
  std::vector<const_tensor_view> qv;
  for (std::int32_t l = 0; l < L; ++l) {
    auto x = random_floats(std::size_t(nq * qh * d), rng, 0.1f);
    for (std::int64_t i = 0; i < nq; ++i)
      for (std::int32_t hh = 0; hh < qh; ++hh)
        for (std::int32_t c = 0; c < d; ++c) x[std::size_t((i * qh + hh) * d + c)] += dir[std::size_t(c)];
    q.push_back(std::move(x));
  }
  for (std::int32_t l = 0; l < L; ++l)
    qv.push_back(nhd(static_cast<const void*>(q[std::size_t(l)].data()), dtype::f32, nq, qh, d));
  const std::vector<std::int64_t> qpos{100, 101, 102, 103};
  snapkv policy;
  policy.window = 4, policy.kernel = 1;
  budget b;
  b.capacity = kept, b.sinks = 4, b.recent = 8;
  cpu::recaller r(a, policy, b, {.budget_tokens = 8, .candidates = 3}, 64, qh, 8);
  const auto in = cached.inputs();
  const auto res = r.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 1.f / 4.f);
  REQUIRE(res.pages.size() >= 1);
  CHECK(a.tokens(res.pages[0])[0].pos == 20);  // the needle's page first
  CHECK(res.tokens == std::int64_t(res.displaced.size()));
  CHECK(res.tokens <= 8);
  for (auto j : res.displaced) {  // never the sinks or the recent window
    CHECK(cached.tokens[std::size_t(j)].pos >= 4);
    CHECK(cached.tokens[std::size_t(j)].pos < n - 8);
  }

  SUBCASE("recall can score without the policy's recency bias: as the policy with beta 0") {
    infkv::inf_mllm biased;
    biased.window = 4, biased.kernel = 1, biased.bias.beta = 8.0;
    infkv::inf_mllm plain = biased;
    plain.bias.beta = 0.0;
    cpu::recaller without(a, biased, b, {.budget_tokens = 8, .candidates = 3, .recency_bias = false}, 64, qh, 8);
    cpu::recaller zero(a, plain, b, {.budget_tokens = 8, .candidates = 3}, 64, qh, 8);
    const auto o = without.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f);
    const std::vector<std::int32_t> op(o.pages.begin(), o.pages.end());
    const std::vector<std::int64_t> od(o.displaced.begin(), o.displaced.end());
    const auto z = zero.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f);
    CHECK(op == std::vector<std::int32_t>(z.pages.begin(), z.pages.end()));
    CHECK(od == std::vector<std::int64_t>(z.displaced.begin(), z.displaced.end()));
    REQUIRE(!op.empty());
    CHECK(a.tokens(op[0])[0].pos == 20);
  }

  SUBCASE("only pages wholly below recall_options::below come back") {
    // the needle's page (positions 20-23) first without a bound; a bound at 22 or 23 excludes it
    // (a page straddling the bound is not recalled), at 24 it is recalled again
    for (const std::int64_t below : {22, 23, 24}) {
      CAPTURE(below);
      cpu::recaller lim(a, policy, b, {.budget_tokens = 8, .candidates = 3, .below = below}, 64, qh, 8);
      const auto o = lim.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 1.f / 4.f);
      bool needle = false;
      for (const auto& t : o.recalled) {
        const auto pos = a.tokens(t.page)[std::size_t(t.index)].pos;
        CHECK(pos < below);
        needle = needle || (pos >= 20 && pos < 24);
      }
      CHECK(needle == (below == 24));
    }
  }

  SUBCASE("recall_options::layers: as the recall over an archive and a cache of those layers alone") {
    cache full1(1, H, d, n, rng), cached1(1, H, d, kept, rng);
    full1.k[0] = full.k[1], full1.v[0] = full.v[1], full1.tokens = full.tokens;
    cached1.k[0] = cached.k[1], cached1.v[0] = cached.v[1], cached1.tokens = cached.tokens;
    archive one(archive_shape{1, H, d, granularity::per_token}, opts(4, 4, 4, 1 << 20));
    archive_all(one, full1, keep);
    cpu::recaller r1(one, policy, b, {.budget_tokens = 8, .candidates = 3}, 64, qh, 8);
    const auto in1 = cached1.inputs();
    const auto want = r1.recall(one, std::span<const layer_inputs<>>(in1), std::span(qv).subspan(1, 1), qpos, 0.25f);
    const std::vector<std::int64_t> wd(want.displaced.begin(), want.displaced.end());
    std::vector<std::int64_t> wp;
    for (const auto& t : want.recalled) wp.push_back(one.tokens(t.page)[std::size_t(t.index)].pos);
    cpu::recaller rl(a, policy, b, {.budget_tokens = 8, .candidates = 3, .layers = {1}}, 64, qh, 8);
    const auto got = rl.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f);
    std::vector<std::int64_t> gp;
    for (const auto& t : got.recalled) gp.push_back(a.tokens(t.page)[std::size_t(t.index)].pos);
    REQUIRE(!wp.empty());
    CHECK(gp == wp);
    CHECK(std::vector<std::int64_t>(got.displaced.begin(), got.displaced.end()) == wd);
    CHECK_THROWS_WITH(cpu::recaller(a, policy, b, {.budget_tokens = 8, .layers = {1, 1}}, 64, qh, 8),
                      doctest::Contains("recall_options.layers[1] = 1: must be ascending in [0, 2)"));
    CHECK_THROWS_WITH(cpu::recaller(a, policy, b, {.budget_tokens = 8, .layers = {2}}, 64, qh, 8),
                      doctest::Contains("recall_options.layers[0] = 2"));
  }

  SUBCASE("bad input") {
    CHECK_THROWS_WITH(cpu::recaller(a, policy, b, {.budget_tokens = 0}, 64, qh, 8),
                      doctest::Contains("recall_options.budget_tokens = 0"));
    CHECK_THROWS_WITH(cpu::recaller(a, keydiff{}, b, {.budget_tokens = 4}, 64, qh, 8),
                      doctest::Contains("recall scores candidates against the queries"));
    archive heads(archive_shape{L, H, d, granularity::per_head}, opts(4, 4, 4, 1 << 20));
    CHECK_THROWS_WITH(cpu::recaller(heads, policy, b, {.budget_tokens = 4}, 64, qh, 8),
                      doctest::Contains("a per_head archive's heads hold different positions"));
    cpu::recaller big(a, policy, b, {.budget_tokens = 40}, 64, qh, 8);
    CHECK_THROWS_WITH(
        big.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f),
        doctest::Contains(
            "recall_options.budget_tokens = 40: exceeds what the cache's budget lets recall displace: 36"));
    archive empty(archive_shape{L, H, d, granularity::per_token}, opts(4, 4, 4, 1 << 20));
    CHECK_THROWS_WITH(r.recall(empty, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f),
                      doctest::Contains("recall needs archived pages"));
    archive other(archive_shape{L, H, 8, granularity::per_token}, opts(4, 4, 4, 1 << 20));
    CHECK_THROWS_WITH(r.recall(other, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f),
                      doctest::Contains("archive.shape() = differs"));
    CHECK_THROWS_WITH(cpu::recaller(a, policy, b, {.budget_tokens = 4, .neighbours = -1}, 64, qh, 8),
                      doctest::Contains("recall_options.neighbours = -1"));
  }

  SUBCASE("written through: the archive holds the cached tokens too, recall brings back only the others") {
    archive all(archive_shape{L, H, d, granularity::per_token}, opts(4, 4, 4, 1 << 20));
    keep_set none(n);
    none.add_unit({});
    archive_all(all, full, none);
    CHECK(all.held_tokens() == n);
    cpu::recaller wr(all, policy, b, {.budget_tokens = 8, .candidates = 3}, 64, qh, 8);
    const auto w = wr.recall(all, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f);
    REQUIRE(w.tokens >= 4);
    std::vector<std::int64_t> back;
    for (const auto& t : w.recalled) back.push_back(all.tokens(t.page)[std::size_t(t.index)].pos);
    for (std::int64_t p = 20; p < 24; ++p) CHECK(std::count(back.begin(), back.end(), p) == 1);  // the needle
    for (const auto p : back)
      CHECK(std::none_of(cached.tokens.begin(), cached.tokens.end(), [&](const token& t) { return t.pos == p; }));
    CHECK(std::int64_t(w.displaced.size()) == w.tokens);
    const cache& everything = full;  // a cache that holds every archived token: nothing to recall
    const auto ein = everything.inputs();
    cpu::recaller er(all, policy, b, {.budget_tokens = 8, .candidates = 3}, n, qh, 8);
    CHECK(er.recall(all, std::span<const layer_inputs<>>(ein), qv, qpos, 0.25f).tokens == 0);
  }
}

namespace {

/// x (head_dim floats) turned by `by` positions with RoPE `r`, in float64 (the definition:
/// rotary pair i turns by by * freq_scale * theta^(-2i / dims)).
std::vector<double> ref_turn(std::span<const float> x, const rope& r, std::int64_t by) {
  const std::int32_t d = std::int32_t(x.size()), dims = r.dims == 0 ? d : r.dims;
  std::vector<double> y(x.begin(), x.end());
  for (std::int32_t i = 0; i < dims / 2; ++i) {
    const double ang = double(by) * r.freq_scale * std::pow(r.theta, -2.0 * i / dims);
    const std::int32_t a = r.style == rope_style::normal ? 2 * i : i,
                       b = r.style == rope_style::normal ? a + 1 : i + dims / 2;
    y[std::size_t(a)] = x[std::size_t(a)] * std::cos(ang) - x[std::size_t(b)] * std::sin(ang);
    y[std::size_t(b)] = x[std::size_t(a)] * std::sin(ang) + x[std::size_t(b)] * std::cos(ang);
  }
  return y;
}

}  // namespace

TEST_CASE("archive: a page's bound with a turn is at least the logits of its keys turned so") {
  std::mt19937 rng(23);
  const std::int32_t L = 2, H = 2, d = 16, qh = 4;
  const std::int64_t n = 30, nq = 3;
  cache c(L, H, d, n, rng);
  archive a(archive_shape{L, H, d, granularity::per_token}, opts(6, 4, 4, 1 << 20));
  keep_set keep(n);
  keep.add_unit(std::vector<std::int64_t>{0, 1, 29});
  archive_all(a, c, keep);
  std::vector<std::vector<float>> q;
  std::vector<const_tensor_view> qv;
  for (std::int32_t l = 0; l < L; ++l) q.push_back(random_floats(std::size_t(nq * qh * d), rng));
  for (std::int32_t l = 0; l < L; ++l)
    qv.push_back(nhd(static_cast<const void*>(q[std::size_t(l)].data()), dtype::f32, nq, qh, d));
  const std::vector<std::optional<rope>> ropes{rope{.theta = 10000.0},
                                               rope{.theta = 500.0, .dims = 8, .style = rope_style::neox}};
  std::vector<std::int64_t> turn(static_cast<std::size_t>(a.capacity_pages()));
  for (std::int32_t p = 0; p < a.capacity_pages(); ++p) turn[std::size_t(p)] = std::int64_t(p) * 7919 - 20000;
  std::vector<float> plain(turn.size()), turned(turn.size());
  const float scale = 0.25f;
  cpu::page_bounds(a, qv, scale, plain);
  cpu::page_bounds(a, qv, scale, turned, -1, {}, turn, ropes);
  bool differs = false;
  std::vector<float> k(static_cast<std::size_t>(d));
  for (std::int32_t p = 0; p < a.capacity_pages(); ++p) {
    if (!a.holds(p)) continue;
    double total = 0;  // per layer the best logit of the turned keys, summed
    for (std::int32_t l = 0; l < L; ++l) {
      double best = -1e300;
      for (std::int32_t h = 0; h < H; ++h)
        for (std::int32_t t = 0; t < a.info(p).n_tokens; ++t) {
          cpu::dequantize(a, p, l * H + h, t, false, k.data());
          const auto kt = ref_turn(k, *ropes[std::size_t(l)], turn[std::size_t(p)]);
          for (std::int64_t i = 0; i < nq; ++i)
            for (std::int32_t g = 0; g < qh / H; ++g) {
              double dot = 0;
              for (std::int32_t ch = 0; ch < d; ++ch)
                dot += kt[std::size_t(ch)] * q[std::size_t(l)][std::size_t((i * qh + h * (qh / H) + g) * d + ch)];
              best = std::max(best, scale * dot);
            }
        }
      total += best;
    }
    CHECK(double(turned[std::size_t(p)]) >= total - 1e-3 * (1 + std::fabs(total)));
    differs = differs || turned[std::size_t(p)] != plain[std::size_t(p)];
  }
  CHECK(differs);
  CHECK_THROWS_WITH(cpu::page_bounds(a, qv, scale, turned, -1, {}, std::span(turn).first(1), ropes),
                    doctest::Contains("turn.size() = 1"));
  CHECK_THROWS_WITH(cpu::page_bounds(a, qv, scale, turned, -1, {}, turn, std::span(ropes).first(1)),
                    doctest::Contains("ropes.size() = 1"));
}

namespace {

/// A stream in compact positions: 96 tokens at positions 0-3, then 28800-28891 (far beyond the
/// cache's compact positions); pre-RoPE keys random, but the planted runs' (slots, magnitude),
/// which lie along `dir`, the question's direction in channels from `channel` (10: the slow
/// rotary pairs, 4: faster ones, along which distance matters). The cache holds
/// `keep_slots` (48), rotated at compact positions 0-47; the archive holds every token rotated at
/// its own position and pages of 4 what the cache does not. The queries sit at compact positions
/// 48-51 (stream positions 28892-28895). `compact` false: the cache's keys and the queries
/// rotated at their stream positions instead (keep mode).
struct compact_stream {
  static constexpr std::int32_t L = 2, H = 2, d = 16, qh = 4;
  static constexpr std::int64_t n = 96, kept = 48, nq = 4, base = 28796;
  const rope r{.theta = 10000.0};
  std::mt19937 rng{29};
  std::vector<float> dir = std::vector<float>(std::size_t(d), 0.f);
  cache full{L, H, d, n, rng}, cached{L, H, d, kept, rng};
  std::vector<std::int64_t> rotary_pos, qpos{base + 96, base + 97, base + 98, base + 99};
  archive a{archive_shape{L, H, d, granularity::per_token}, opts(4, 8, 8, 1 << 20)};
  std::vector<std::vector<float>> q;
  std::vector<const_tensor_view> qv;

  struct plant {
    std::int64_t first, count;
    float magnitude;
  };
  compact_stream(const std::vector<std::int64_t>& keep_slots, const std::vector<plant>& planted,
                 std::int32_t channel = 10, bool compact = true) {
    for (std::int32_t c = channel; c < channel + 6; ++c) dir[std::size_t(c)] = 1.f + 0.1f * float(c);
    for (std::int64_t j = 0; j < n; ++j) full.tokens[std::size_t(j)].pos = j < 4 ? j : base + j;
    for (const plant& pl : planted)
      for (std::int32_t l = 0; l < L; ++l)
        for (std::int64_t j = pl.first; j < pl.first + pl.count; ++j)
          for (std::int32_t h = 0; h < H; ++h)
            for (std::int32_t c = 0; c < d; ++c)
              full.k[std::size_t(l)][std::size_t((j * H + h) * d + c)] = pl.magnitude * dir[std::size_t(c)];
    REQUIRE(std::int64_t(keep_slots.size()) == kept);
    const auto rotated = [&](const std::vector<float>& u, std::int64_t j, std::int32_t h, std::int64_t at) {
      const auto y = ref_turn(std::span(u).subspan(std::size_t((j * H + h) * d), std::size_t(d)), r, at);
      return std::vector<float>(y.begin(), y.end());
    };
    cache archived = full;
    for (std::int64_t i = 0; i < kept; ++i)
      rotary_pos.push_back(compact ? i : full.tokens[std::size_t(keep_slots[std::size_t(i)])].pos);
    for (std::int32_t l = 0; l < L; ++l)
      for (std::int32_t h = 0; h < H; ++h) {
        for (std::int64_t j = 0; j < n; ++j) {
          const auto y = rotated(full.k[std::size_t(l)], j, h, full.tokens[std::size_t(j)].pos);
          std::copy(y.begin(), y.end(), archived.k[std::size_t(l)].begin() + (j * H + h) * d);
        }
        for (std::int64_t i = 0; i < kept; ++i) {
          const std::int64_t j = keep_slots[std::size_t(i)];
          const auto y = rotated(full.k[std::size_t(l)], j, h, rotary_pos[std::size_t(i)]);
          std::copy(y.begin(), y.end(), cached.k[std::size_t(l)].begin() + (i * H + h) * d);
          std::copy_n(full.v[std::size_t(l)].begin() + (j * H + h) * d, d,
                      cached.v[std::size_t(l)].begin() + (i * H + h) * d);
        }
      }
    for (std::int64_t i = 0; i < kept; ++i)
      cached.tokens[std::size_t(i)] = full.tokens[std::size_t(keep_slots[std::size_t(i)])];
    keep_set keep(n);
    keep.add_unit(keep_slots);
    archive_all(a, archived, keep);
    for (std::int32_t l = 0; l < L; ++l) {
      std::vector<float> x(static_cast<std::size_t>(nq * qh * d));
      const auto noise = random_floats(x.size(), rng, 0.1f);
      for (std::int64_t i = 0; i < nq; ++i)
        for (std::int32_t hh = 0; hh < qh; ++hh) {
          std::vector<float> u(static_cast<std::size_t>(d));
          for (std::int32_t c = 0; c < d; ++c)
            u[std::size_t(c)] = dir[std::size_t(c)] + noise[std::size_t((i * qh + hh) * d + c)];
          const auto y = ref_turn(u, r, compact ? kept + i : qpos[std::size_t(i)]);
          std::copy(y.begin(), y.end(), x.begin() + (i * qh + hh) * d);
        }
      q.push_back(std::move(x));
    }
    for (std::int32_t l = 0; l < L; ++l)
      qv.push_back(nhd(static_cast<const void*>(q[std::size_t(l)].data()), dtype::f32, nq, qh, d));
  }
  /// The stream positions of what a recall brings back.
  std::vector<std::int64_t> back(const cpu::recall_result& res) const {
    std::vector<std::int64_t> out;
    for (const auto& t : res.recalled) out.push_back(a.tokens(t.page)[std::size_t(t.index)].pos);
    return out;
  }
};

}  // namespace

TEST_CASE("archive: recall with rotary_pos turns archived keys to where compact positions land them") {
  // The needle (28816-28819) planted at 5; the cache holds the sinks and the newest 44. Turned to
  // where it lands (position 4, after the sinks) the needle is 44 positions from the question, as
  // attention will see it after the recall.
  std::vector<std::int64_t> keep_slots{0, 1, 2, 3};
  for (std::int64_t j = 52; j < 96; ++j) keep_slots.push_back(j);
  compact_stream st(keep_slots, {{20, 4, 5.f}});
  const std::int64_t base = compact_stream::base, kept = compact_stream::kept;
  const archive& a = st.a;
  const auto& [rotary_pos, qpos, qv] = std::tie(st.rotary_pos, st.qpos, st.qv);
  snapkv policy;
  policy.window = 4, policy.kernel = 1;
  budget b;
  b.capacity = kept, b.sinks = 4, b.recent = 8;
  auto in = st.cached.inputs();
  for (auto& li : in) li.rotary = st.r;
  cpu::recaller rc(a, policy, b, {.budget_tokens = 4, .candidates = 3, .neighbours = 0}, 64, compact_stream::qh, 8);
  const auto res = rc.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f, 0, rotary_pos);
  REQUIRE(res.tokens == 4);
  for (const auto& t : res.recalled) {  // the needle, and only it
    const auto pos = a.tokens(t.page)[std::size_t(t.index)].pos;
    CHECK(pos >= base + 20);
    CHECK(pos < base + 24);
  }
  for (auto j : res.displaced) CHECK(rotary_pos[std::size_t(j)] >= 4);
  // scored where they were archived (28768 positions from the queries' rotation: dir . R(28768) dir
  // = -28.6 against dir . R(44) dir = +30.5) the needle is not what comes back
  const auto unturned = rc.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f);
  std::int64_t needle = 0;
  for (const auto& t : unturned.recalled) needle += a.tokens(t.page)[std::size_t(t.index)].pos / 4 == (base + 20) / 4;
  CHECK(needle == 0);

  SUBCASE("bad input") {
    CHECK_THROWS_WITH(
        rc.recall(a, std::span<const layer_inputs<>>(in), qv, qpos, 0.25f, 0, std::span(rotary_pos).first(3)),
        doctest::Contains("rotary_pos.size() = 3: must be 0 or the cache's 48 slots"));
    auto plain = st.cached.inputs();
    CHECK_THROWS_WITH(rc.recall(a, std::span<const layer_inputs<>>(plain), qv, qpos, 0.25f, 0, rotary_pos),
                      doctest::Contains("cache[0].rotary = unset"));
  }
}

TEST_CASE("archive: recall_options::distance ranks candidates at one distance, not where they land") {
  // Along faster rotary pairs (channels 4-9) distance matters: dir . R(t) dir = 16.5 at 0, 14.5
  // near 10, 6 near 44. The needle (28816-28819, magnitude 5) would land after the sinks, 41-47
  // positions from the queries (logit ~30); a weaker decoy (28880-28883, magnitude 4) between
  // cached slots near the end, 5-11 from them (~58). Where they land the decoy comes back; at one
  // common distance (the first token 8 before the newest cached one) the needle does (~72 against
  // ~58), brought back to where it lands all the same.
  std::vector<std::int64_t> keep_slots{0, 1, 2, 3};
  for (std::int64_t j = 48; j < 96; ++j)
    if (j < 84 || j >= 88) keep_slots.push_back(j);
  compact_stream st(keep_slots, {{20, 4, 5.f}, {84, 4, 4.f}}, 4);
  const std::int64_t base = compact_stream::base;
  snapkv policy;
  policy.window = 4, policy.kernel = 1;
  budget b;
  b.capacity = compact_stream::kept, b.sinks = 4, b.recent = 8;
  auto in = st.cached.inputs();
  for (auto& li : in) li.rotary = st.r;
  const auto recall = [&](std::optional<std::int64_t> distance, std::span<const std::int64_t> rotary_pos,
                          const std::vector<layer_inputs<>>& inputs) {
    cpu::recaller rc(st.a, policy, b, {.budget_tokens = 4, .candidates = 3, .neighbours = 0, .distance = distance}, 64,
                     compact_stream::qh, 8);
    return st.back(rc.recall(st.a, std::span<const layer_inputs<>>(inputs), st.qv, st.qpos, 0.25f, 0, rotary_pos));
  };
  const std::vector<std::int64_t> needle{base + 20, base + 21, base + 22, base + 23},
      decoy{base + 84, base + 85, base + 86, base + 87};
  CHECK(recall(std::nullopt, st.rotary_pos, in) == decoy);
  CHECK(recall(8, st.rotary_pos, in) == needle);
  // keep mode (keys and queries at the stream's positions, the needle 76 from the queries): the same
  compact_stream keep(keep_slots, {{20, 4, 5.f}, {84, 4, 4.f}}, 4, false);
  auto kin = keep.cached.inputs();
  for (auto& li : kin) li.rotary = keep.r;
  const auto recall_keep = [&](std::optional<std::int64_t> distance) {
    cpu::recaller rc(keep.a, policy, b, {.budget_tokens = 4, .candidates = 3, .neighbours = 0, .distance = distance},
                     64, compact_stream::qh, 8);
    return keep.back(rc.recall(keep.a, std::span<const layer_inputs<>>(kin), keep.qv, keep.qpos, 0.25f));
  };
  CHECK(recall_keep(std::nullopt) == decoy);
  CHECK(recall_keep(8) == needle);

  SUBCASE("bad input") {
    CHECK_THROWS_WITH(recall(-1, st.rotary_pos, in), doctest::Contains("recall_options.distance = -1: must be >= 0"));
    CHECK_THROWS_WITH(recall(8, {}, st.cached.inputs()),
                      doctest::Contains("cache[0].rotary = unset: recall_options.distance turns"));
  }
}
