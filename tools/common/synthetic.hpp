// infkv tools: a synthetic attention workload for one layer (infkv-compare --synthetic, infkv-soak).
// A stream of tokens cut into rounds (multi-round use: each round has its own query topic, so the
// attended region moves forward); some rounds are video-like, cut into frames. Attention has the
// features seen in real models: sinks (the first tokens draw attention from every query), local
// recency (queries resemble recent keys), attention saddles (scattered short spans whose keys
// align with their round's topic) and long-lived saddles (attended by every later query).
// Keys, values and queries are f32 (post-RoPE by construction; no rotation is applied); `convert`
// gives f16/bf16 copies. Header-only, std only, deterministic for a given seed on every platform.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <infkv/dtype.hpp>
#include <infkv/error.hpp>
#include <infkv/kv_view.hpp>
#include <infkv/tokens.hpp>

namespace synthetic {

using infkv::dtype, infkv::kv_view, infkv::modality, infkv::tensor_view, infkv::token;

/// Generator parameters. Logit parameters are the extra pre-softmax logit (scale 1/sqrt(d)) a
/// feature adds for a query that targets it; the unstructured part of every logit has std ~1.
struct config {
  std::int64_t tokens = 8192;        ///< stream length T
  std::int32_t kv_heads = 4;         ///< KV heads (each with its own random geometry)
  std::int32_t group = 2;            ///< query heads per KV head (GQA)
  std::int32_t head_dim = 64;        ///< d
  std::int64_t round_tokens = 1024;  ///< mean round length
  double round_jitter = 0.25;        ///< round lengths uniform in round_tokens * (1 +- jitter)
  std::int32_t video_every = 3;      ///< rounds 3, 6, ... (1-based) are video; 0: none
  std::int64_t frame_tokens = 196;   ///< tokens per video frame (one segment each)
  double frame_logit = 2.0;          ///< same spatial location in another frame of the round
  std::int64_t sinks = 4;            ///< attention sinks at the start of the stream
  double sink_logit = 8.0;
  double sink_value_scale = 0.1;       ///< sinks carry small values, as in real models
  std::int64_t saddles_per_round = 8;  ///< planted saddle spans per round (fewer if it is short)
  std::int64_t saddle_span = 3;        ///< tokens per saddle span: uniform in [1, saddle_span]
  double saddle_logit = 6.0;           ///< for the queries of the saddle's own round
  std::int64_t long_lived = 6;         ///< single-token saddles attended by every later query
  double long_lived_logit = 6.0;
  double round_logit = 1.0;  ///< any token of the current round (the attended region)
  double local_logit = 6.0;  ///< recency: at distance a, local_logit * exp(-a / local_tokens)
  double local_tokens = 64.0;
  double query_gain_spread = 0.25;  ///< per-query topic gain uniform in 1 +- spread
  std::uint64_t seed = 1;

  /// Throws `infkv::error` naming the first invalid field.
  void validate() const {
    const auto finite_ge0 = [](const char* n, double v) {
      INFKV_REQUIRE(std::isfinite(v) && v >= 0.0, n, v, "must be finite and >= 0");
    };
    INFKV_REQUIRE(tokens >= 1, "config.tokens", tokens, "must be >= 1");
    INFKV_REQUIRE(kv_heads >= 1, "config.kv_heads", kv_heads, "must be >= 1");
    INFKV_REQUIRE(group >= 1, "config.group", group, "must be >= 1");
    INFKV_REQUIRE(head_dim >= 4, "config.head_dim", head_dim, "must be >= 4");
    INFKV_REQUIRE(round_tokens >= 1, "config.round_tokens", round_tokens, "must be >= 1");
    INFKV_REQUIRE(std::isfinite(round_jitter) && round_jitter >= 0.0 && round_jitter < 1.0, "config.round_jitter",
                  round_jitter, "must be in [0, 1)");
    INFKV_REQUIRE(video_every >= 0, "config.video_every", video_every, "must be >= 0");
    INFKV_REQUIRE(frame_tokens >= 1, "config.frame_tokens", frame_tokens, "must be >= 1");
    INFKV_REQUIRE(sinks >= 0 && sinks <= tokens, "config.sinks", sinks, "must be in [0, tokens = ", tokens, "]");
    INFKV_REQUIRE(saddles_per_round >= 0, "config.saddles_per_round", saddles_per_round, "must be >= 0");
    INFKV_REQUIRE(saddle_span >= 1, "config.saddle_span", saddle_span, "must be >= 1");
    INFKV_REQUIRE(long_lived >= 0, "config.long_lived", long_lived, "must be >= 0");
    INFKV_REQUIRE(std::isfinite(local_tokens) && local_tokens > 0.0, "config.local_tokens", local_tokens,
                  "must be finite and > 0");
    INFKV_REQUIRE(std::isfinite(query_gain_spread) && query_gain_spread >= 0.0 && query_gain_spread < 1.0,
                  "config.query_gain_spread", query_gain_spread, "must be in [0, 1)");
    finite_ge0("config.frame_logit", frame_logit);
    finite_ge0("config.sink_logit", sink_logit);
    finite_ge0("config.sink_value_scale", sink_value_scale);
    finite_ge0("config.saddle_logit", saddle_logit);
    finite_ge0("config.long_lived_logit", long_lived_logit);
    finite_ge0("config.round_logit", round_logit);
    finite_ge0("config.local_logit", local_logit);
  }
};

/// What a token was planted as.
enum class role : std::uint8_t { ordinary, sink, saddle, long_lived };

/// One round: tokens [begin, end), video-like or text.
struct round_info {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  bool video = false;
};

/// One planted saddle span: tokens [begin, end) of round `round`.
struct saddle_span_info {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int32_t round = 0;
};

/// A generated stream. Token t has position t. Keys and values: [T][kv_heads][d]; queries:
/// [T][kv_heads * group][d] (query head h * group + g belongs to KV head h).
struct workload {
  config cfg;
  std::vector<float> keys, values, queries;
  std::vector<token> tokens;           ///< segment = round (text) or frame (video), in stream order
  std::vector<std::int32_t> round_of;  ///< round index per token
  std::vector<role> roles;             ///< planted role per token
  std::vector<round_info> rounds;
  std::vector<saddle_span_info> saddles;
  std::vector<std::int64_t> long_lived;  ///< positions of the long-lived saddles, increasing

  std::int64_t size() const { return std::int64_t(tokens.size()); }
  std::int32_t query_heads() const { return cfg.kv_heads * cfg.group; }

  /// Keys and values of tokens [0, n) as a contiguous NHD view (do not write through it).
  kv_view kv(std::int64_t n) {
    INFKV_REQUIRE(n >= 0 && n <= size(), "n", n, "must be in [0, tokens = ", size(), "]");
    return contiguous_nhd(keys.data(), values.data(), dtype::f32, n, cfg.kv_heads, cfg.head_dim);
  }
  /// Queries of tokens [begin, end) as an NHD view (do not write through it).
  tensor_view query_rows(std::int64_t begin, std::int64_t end) {
    INFKV_REQUIRE(begin >= 0 && begin <= end && end <= size(), "begin", begin, "with end = ", end,
                  " must satisfy 0 <= begin <= end <= tokens = ", size());
    const std::int64_t row = std::int64_t(query_heads()) * cfg.head_dim;
    return infkv::nhd(queries.data() + begin * row, dtype::f32, end - begin, query_heads(), cfg.head_dim);
  }
  /// Positions begin, begin + 1, ..., end - 1 (the query positions of `query_rows`).
  static std::vector<std::int64_t> positions(std::int64_t begin, std::int64_t end) {
    std::vector<std::int64_t> p;
    for (std::int64_t i = begin; i < end; ++i) p.push_back(i);
    return p;
  }
};

/// Copy of f32 data in element type t, rounded to nearest even (raw bytes, to wrap in a view of
/// that type).
inline std::vector<std::byte> convert(std::span<const float> x, dtype t) {
  std::vector<std::byte> out(x.size() * infkv::size_of(t));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t h = t == dtype::f16 ? infkv::f32_to_f16(x[i]) : infkv::f32_to_bf16(x[i]);
    if (t == dtype::f32)
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    else
      std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

namespace detail {

/// xoshiro256** seeded by splitmix64: the same stream on every platform.
class rng {
 public:
  explicit rng(std::uint64_t seed) {
    for (auto& s : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      std::uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      s = z ^ (z >> 31);
    }
  }
  std::uint64_t next() {
    const std::uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t, s_[3] = rotl(s_[3], 45);
    return r;
  }
  /// Uniform in [0, 1).
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [lo, hi] (hi - lo small against 2^64).
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {
    return lo + std::int64_t(next() % std::uint64_t(hi - lo + 1));
  }
  /// Standard normal (Box-Muller).
  double normal() {
    if (has_spare_) return has_spare_ = false, spare_;
    const double u = 1.0 - uniform(), v = uniform(), r = std::sqrt(-2.0 * std::log(u));
    spare_ = r * std::sin(6.283185307179586 * v), has_spare_ = true;
    return r * std::cos(6.283185307179586 * v);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4]{};
  double spare_ = 0.0;
  bool has_spare_ = false;
};

using vec = std::vector<double>;

inline vec gaussian(rng& g, std::int32_t d, double scale = 1.0) {
  vec v(static_cast<std::size_t>(d));
  for (auto& x : v) x = scale * g.normal();
  return v;
}
inline double dot(const vec& a, const vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}
/// Removes from v its components along the orthonormal vectors of `basis`.
inline void project_out(vec& v, const std::vector<vec>& basis) {
  for (const auto& b : basis) {
    const double c = dot(v, b);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= c * b[i];
  }
}
/// A unit vector orthogonal to `basis` (Gram-Schmidt on a Gaussian draw).
inline vec unit_orthogonal(rng& g, std::int32_t d, const std::vector<vec>& basis) {
  vec v = gaussian(g, d);
  project_out(v, basis);
  const double n = std::sqrt(dot(v, v));
  for (auto& x : v) x /= n;
  return v;
}

/// Per KV head geometry: sink and long-lived directions (orthonormal), one topic per round.
struct head_geometry {
  std::vector<vec> shared;  // {sink, long-lived}
  std::vector<vec> topic;   // per round, orthogonal to `shared`
};

}  // namespace detail

/// Generates a workload; the same config (seed included) gives the same bytes. O(T * Hq * d).
inline workload generate(const config& c) {
  c.validate();
  workload w;
  w.cfg = c;
  detail::rng g(c.seed);
  const std::int64_t T = c.tokens;
  const std::int32_t d = c.head_dim, hkv = c.kv_heads, hq = hkv * c.group;
  const auto sz = [](std::int64_t n) { return static_cast<std::size_t>(n); };

  // Rounds and segments.
  for (std::int64_t b = 0; b < T;) {
    const bool video = c.video_every > 0 && (std::int64_t(w.rounds.size()) + 1) % c.video_every == 0;
    std::int64_t len = std::max<std::int64_t>(
        1, std::llround(double(c.round_tokens) * g.uniform(1.0 - c.round_jitter, 1.0 + c.round_jitter)));
    if (video) len = std::max<std::int64_t>(1, std::llround(double(len) / double(c.frame_tokens))) * c.frame_tokens;
    w.rounds.push_back({b, std::min(T, b + len), video});
    b = w.rounds.back().end;
  }
  w.tokens.resize(sz(T));
  w.round_of.resize(sz(T));
  w.roles.assign(sz(T), role::ordinary);
  std::int32_t segment = 0;
  for (std::size_t r = 0; r < w.rounds.size(); ++r) {
    const auto& ri = w.rounds[r];
    for (std::int64_t t = ri.begin; t < ri.end; ++t) {
      if (t > ri.begin && ri.video && (t - ri.begin) % c.frame_tokens == 0) ++segment;
      w.tokens[sz(t)] = {t, segment, ri.video ? modality::video : modality::text};
      w.round_of[sz(t)] = std::int32_t(r);
    }
    ++segment;
  }

  // Planted roles: sinks, saddle spans (non-overlapping, after the sinks), long-lived saddles.
  for (std::int64_t t = 0; t < c.sinks; ++t) w.roles[sz(t)] = role::sink;
  std::vector<double> strength(sz(T), 0.0);  // per saddle token: fraction of saddle_logit
  for (std::size_t r = 0; r < w.rounds.size(); ++r) {
    const std::int64_t lo = std::max(w.rounds[r].begin, c.sinks), hi = w.rounds[r].end;
    for (std::int64_t k = 0, tries = 0; k < c.saddles_per_round && tries < 64 * c.saddles_per_round; ++tries) {
      const std::int64_t span = g.integer(1, c.saddle_span);
      if (hi - lo < span) break;
      const std::int64_t b = g.integer(lo, hi - span);
      bool free = true;
      for (std::int64_t t = std::max(lo, b - 1); t < std::min(hi, b + span + 1); ++t)
        free = free && w.roles[sz(t)] == role::ordinary;
      if (!free) continue;
      for (std::int64_t t = b; t < b + span; ++t) w.roles[sz(t)] = role::saddle, strength[sz(t)] = g.uniform(0.8, 1.2);
      w.saddles.push_back({b, b + span, std::int32_t(r)});
      ++k;
    }
  }
  for (std::int64_t k = 0, tries = 0; k < c.long_lived && tries < 64 * c.long_lived && c.sinks < T; ++tries) {
    const std::int64_t t = g.integer(c.sinks, T - 1);
    if (w.roles[sz(t)] != role::ordinary) continue;
    w.roles[sz(t)] = role::long_lived, ++k;
  }
  for (std::int64_t t = 0; t < T; ++t)
    if (w.roles[sz(t)] == role::long_lived) w.long_lived.push_back(t);

  // Geometry. A feature of logit L uses amplitude sqrt(L * sqrt(d)) on both key and query, so
  // that key . query / sqrt(d) = L; random parts are projected off the shared directions.
  const double sqrt_d = std::sqrt(double(d));
  const auto amp = [&](double logit) { return std::sqrt(logit * sqrt_d); };
  std::vector<detail::head_geometry> geo(sz(hkv));
  for (auto& h : geo) {
    h.shared.push_back(detail::unit_orthogonal(g, d, h.shared));
    h.shared.push_back(detail::unit_orthogonal(g, d, h.shared));
    for (std::size_t r = 0; r < w.rounds.size(); ++r) h.topic.push_back(detail::unit_orthogonal(g, d, h.shared));
  }
  const double rho = std::exp(-1.0 / c.local_tokens), lam = std::sqrt(c.local_logit / sqrt_d);
  const double zeta = std::sqrt(c.frame_logit / sqrt_d);
  const double a_sink = amp(c.sink_logit), a_long = amp(c.long_lived_logit), a_topic = amp(c.saddle_logit);
  const double round_share = c.saddle_logit > 0 ? c.round_logit / c.saddle_logit : 0.0;

  w.keys.resize(sz(T * hkv * d));
  w.values.resize(sz(T * hkv * d));
  w.queries.resize(sz(T * hq * d));
  std::vector<detail::vec> context(sz(hkv));
  std::vector<std::vector<detail::vec>> spatial(sz(hkv));  // per head: per frame location
  std::int32_t spatial_round = -1;
  for (auto& cx : context) cx = detail::gaussian(g, d);
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int32_t r = w.round_of[sz(t)];
    const auto& ri = w.rounds[sz(r)];
    if (ri.video && spatial_round != r) {  // fresh spatial pattern for each video round
      for (auto& sp : spatial) {
        sp.clear();
        for (std::int64_t k = 0; k < c.frame_tokens; ++k) sp.push_back(detail::gaussian(g, d, zeta));
      }
      spatial_round = r;
    }
    const role ro = w.roles[sz(t)];
    for (std::int32_t h = 0; h < hkv; ++h) {
      auto& cx = context[sz(h)];
      if (t > 0)
        for (auto& x : cx) x = rho * x + std::sqrt(1.0 - rho * rho) * g.normal();
      detail::vec common(sz(d));
      for (std::int32_t e = 0; e < d; ++e) common[sz(e)] = lam * cx[sz(e)];
      if (ri.video) {
        const auto& sp = spatial[sz(h)][sz((t - ri.begin) % c.frame_tokens)];
        for (std::int32_t e = 0; e < d; ++e) common[sz(e)] += sp[sz(e)];
      }
      const auto& topic = geo[sz(h)].topic[sz(r)];
      // Key.
      detail::vec k = detail::gaussian(g, d);
      for (std::int32_t e = 0; e < d; ++e) k[sz(e)] += common[sz(e)];
      detail::project_out(k, geo[sz(h)].shared);
      const double topic_k = ro == role::saddle ? strength[sz(t)] : round_share;
      for (std::int32_t e = 0; e < d; ++e) {
        double x = k[sz(e)] + a_topic * topic_k * topic[sz(e)];
        if (ro == role::sink) x += a_sink * geo[sz(h)].shared[0][sz(e)];
        if (ro == role::long_lived) x += a_long * geo[sz(h)].shared[1][sz(e)];
        w.keys[sz((t * hkv + h) * d + e)] = float(x);
      }
      // Value.
      const double vs = ro == role::sink ? c.sink_value_scale : 1.0;
      for (std::int32_t e = 0; e < d; ++e) w.values[sz((t * hkv + h) * d + e)] = float(vs * g.normal());
      // Queries of the group.
      for (std::int32_t q = 0; q < c.group; ++q) {
        detail::vec v = detail::gaussian(g, d);
        for (std::int32_t e = 0; e < d; ++e) v[sz(e)] += common[sz(e)];
        detail::project_out(v, geo[sz(h)].shared);
        const double gain = g.uniform(1.0 - c.query_gain_spread, 1.0 + c.query_gain_spread);
        for (std::int32_t e = 0; e < d; ++e) {
          const double x = v[sz(e)] + a_topic * gain * topic[sz(e)] + a_sink * geo[sz(h)].shared[0][sz(e)] +
                           a_long * geo[sz(h)].shared[1][sz(e)];
          w.queries[sz((t * hq + h * c.group + q) * d + e)] = float(x);
        }
      }
    }
  }
  return w;
}

}  // namespace synthetic
