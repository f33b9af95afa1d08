// The synthetic workload generator: determinism, labels, and the attention structure it plants
// (checked with a plain double-precision softmax written here, independent of any backend).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include "synthetic.hpp"

using namespace infkv;
using synthetic::role;

namespace {

/// Softmax probabilities of query head `qh` of token t over keys [0, t] (its KV head's keys).
std::vector<double> attention(const synthetic::workload& w, std::int64_t t, std::int32_t qh) {
  const std::int32_t d = w.cfg.head_dim, hkv = w.cfg.kv_heads, hq = w.query_heads(), h = qh / w.cfg.group;
  const float* q = w.queries.data() + (t * hq + qh) * d;
  std::vector<double> p(static_cast<std::size_t>(t + 1));
  double mx = -1e300, sum = 0.0;
  for (std::int64_t j = 0; j <= t; ++j) {
    const float* k = w.keys.data() + (j * hkv + h) * d;
    double s = 0.0;
    for (std::int32_t e = 0; e < d; ++e) s += double(q[e]) * k[e];
    p[std::size_t(j)] = s / std::sqrt(double(d));
    mx = std::max(mx, p[std::size_t(j)]);
  }
  for (auto& x : p) sum += x = std::exp(x - mx);
  for (auto& x : p) x /= sum;
  return p;
}

/// Mean attention per token of a class, accumulated over many (query, head) pairs.
struct tally {
  double sum = 0.0;
  std::int64_t count = 0;
  void add(double x) { sum += x, ++count; }
  double mean() const { return count ? sum / double(count) : 0.0; }
};

synthetic::config small() {
  return {.tokens = 2400,
          .kv_heads = 2,
          .group = 2,
          .head_dim = 32,
          .round_tokens = 600,
          .video_every = 2,
          .frame_tokens = 100,
          .seed = 11};
}

}  // namespace

TEST_CASE("synthetic: the same seed gives the same stream, another seed a different one") {
  const auto a = synthetic::generate(small()), b = synthetic::generate(small());
  auto other_cfg = small();
  other_cfg.seed = 12;
  const auto c = synthetic::generate(other_cfg);
  const std::int64_t t = 2400;
  REQUIRE(std::int64_t(a.keys.size()) == t * 2 * 32);
  REQUIRE(std::int64_t(a.values.size()) == t * 2 * 32);
  REQUIRE(std::int64_t(a.queries.size()) == t * 4 * 32);
  CHECK(a.keys == b.keys);
  CHECK(a.values == b.values);
  CHECK(a.queries == b.queries);
  CHECK(a.roles == b.roles);
  CHECK(a.round_of == b.round_of);
  CHECK(a.long_lived == b.long_lived);
  CHECK(a.keys != c.keys);
  CHECK(a.queries != c.queries);
  for (float x : a.keys) REQUIRE(std::isfinite(x));
  for (float x : a.queries) REQUIRE(std::isfinite(x));
}

TEST_CASE("synthetic: rounds, segments, modalities and planted roles are labelled consistently") {
  const auto cfg = small();
  const auto w = synthetic::generate(cfg);
  REQUIRE(w.size() == cfg.tokens);
  REQUIRE(!w.rounds.empty());
  CHECK(w.rounds.front().begin == 0);
  CHECK(w.rounds.back().end == cfg.tokens);
  bool saw_video = false, saw_text = false;
  for (std::size_t r = 0; r < w.rounds.size(); ++r) {
    const auto& ri = w.rounds[r];
    if (r) CHECK(ri.begin == w.rounds[r - 1].end);
    CHECK(ri.end > ri.begin);
    CHECK(ri.video == ((r + 1) % 2 == 0));
    if (ri.video && ri.end < cfg.tokens) CHECK((ri.end - ri.begin) % cfg.frame_tokens == 0);
    (ri.video ? saw_video : saw_text) = true;
    for (std::int64_t t = ri.begin; t < ri.end; ++t) {
      REQUIRE(w.round_of[std::size_t(t)] == std::int32_t(r));
      REQUIRE(w.tokens[std::size_t(t)].kind == (ri.video ? modality::video : modality::text));
    }
  }
  CHECK(saw_video);
  CHECK(saw_text);
  CHECK(w.tokens[0].segment == 0);
  for (std::int64_t t = 0; t < w.size(); ++t) {
    REQUIRE(w.tokens[std::size_t(t)].pos == t);
    if (t == 0) continue;
    const auto& ri = w.rounds[std::size_t(w.round_of[std::size_t(t)])];
    const bool boundary = t == ri.begin || (ri.video && (t - ri.begin) % cfg.frame_tokens == 0);
    REQUIRE(w.tokens[std::size_t(t)].segment - w.tokens[std::size_t(t - 1)].segment == (boundary ? 1 : 0));
  }
  // Planted roles.
  for (std::int64_t t = 0; t < w.size(); ++t) REQUIRE((w.roles[std::size_t(t)] == role::sink) == (t < cfg.sinks));
  std::vector<std::int64_t> per_round(w.rounds.size(), 0);
  std::int64_t saddle_tokens = 0;
  for (std::size_t i = 0; i < w.saddles.size(); ++i) {
    const auto& s = w.saddles[i];
    const auto& ri = w.rounds[std::size_t(s.round)];
    CHECK(s.begin >= std::max(ri.begin, cfg.sinks));
    CHECK(s.end <= ri.end);
    CHECK(s.end - s.begin >= 1);
    CHECK(s.end - s.begin <= cfg.saddle_span);
    for (std::int64_t t = s.begin; t < s.end; ++t) REQUIRE(w.roles[std::size_t(t)] == role::saddle);
    saddle_tokens += s.end - s.begin;
    ++per_round[std::size_t(s.round)];
  }
  CHECK(std::count(w.roles.begin(), w.roles.end(), role::saddle) == saddle_tokens);  // spans do not overlap
  for (std::size_t r = 0; r < w.rounds.size(); ++r) CHECK(per_round[r] == cfg.saddles_per_round);
  CHECK(std::int64_t(w.long_lived.size()) == cfg.long_lived);
  CHECK(std::is_sorted(w.long_lived.begin(), w.long_lived.end()));
  for (auto t : w.long_lived) CHECK(w.roles[std::size_t(t)] == role::long_lived);
  CHECK(std::count(w.roles.begin(), w.roles.end(), role::long_lived) == cfg.long_lived);
}

TEST_CASE("synthetic: saddles, sinks, long-lived saddles and recent tokens draw the planted attention") {
  const auto cfg = small();
  const auto w = synthetic::generate(cfg);
  tally own_saddle, old_saddle, ordinary, sink, long_lived, recent;
  for (std::size_t r = 0; r < w.rounds.size(); ++r) {
    const auto& ri = w.rounds[r];
    for (std::int64_t k = 0; k < 8; ++k) {  // queries spread over the round's second half
      const std::int64_t t = ri.begin + (ri.end - ri.begin) / 2 + k * (ri.end - ri.begin) / 16;
      for (std::int32_t qh = 0; qh < w.query_heads(); ++qh) {
        const auto p = attention(w, t, qh);
        for (std::int64_t j = 0; j < t; ++j) {
          const double x = p[std::size_t(j)];
          switch (w.roles[std::size_t(j)]) {
            case role::sink: sink.add(x); break;
            case role::long_lived: long_lived.add(x); break;
            case role::saddle: (w.round_of[std::size_t(j)] == std::int32_t(r) ? own_saddle : old_saddle).add(x); break;
            case role::ordinary:
              if (t - j <= 4)
                recent.add(x);
              else if (t - j > 128)
                ordinary.add(x);
          }
        }
      }
    }
  }
  REQUIRE(ordinary.count > 0);
  REQUIRE(old_saddle.count > 0);
  const double base = ordinary.mean();
  INFO("mean attention per token: ordinary ", base, ", own-round saddle ", own_saddle.mean(), ", older saddle ",
       old_saddle.mean(), ", sink ", sink.mean(), ", long-lived ", long_lived.mean(), ", recent ", recent.mean());
  CHECK(own_saddle.mean() > 20 * base);
  CHECK(own_saddle.mean() > 10 * old_saddle.mean());  // the attended region moves with the rounds
  CHECK(old_saddle.mean() < 10 * base);
  CHECK(sink.mean() > 20 * base);
  CHECK(long_lived.mean() > 20 * base);
  CHECK(recent.mean() > 20 * base);
}

TEST_CASE("synthetic: sinks carry small values") {
  const auto cfg = small();
  const auto w = synthetic::generate(cfg);
  const auto norm = [&](std::int64_t t) {
    const std::int64_t row = cfg.kv_heads * cfg.head_dim;
    double s = 0.0;
    for (std::int64_t e = 0; e < row; ++e) s += std::pow(double(w.values[std::size_t(t * row + e)]), 2);
    return std::sqrt(s);
  };
  for (std::int64_t t = 0; t < cfg.sinks; ++t) CHECK(norm(t) < 0.3 * norm(cfg.sinks + 10 + t));
}

TEST_CASE("synthetic: views and conversions address the generated data") {
  auto w = synthetic::generate(small());
  const auto kv = w.kv(100);
  CHECK(kv.k.n_slots == 100);
  CHECK(kv.k.n_heads == 2);
  CHECK(kv.k.row(7, 1) == static_cast<void*>(w.keys.data() + (7 * 2 + 1) * 32));
  CHECK(kv.v.row(7, 1) == static_cast<void*>(w.values.data() + (7 * 2 + 1) * 32));
  const auto q = w.query_rows(5, 9);
  CHECK(q.n_slots == 4);
  CHECK(q.n_heads == 4);
  CHECK(q.row(1, 3) == static_cast<void*>(w.queries.data() + (6 * 4 + 3) * 32));
  CHECK(synthetic::workload::positions(5, 9) == std::vector<std::int64_t>{5, 6, 7, 8});
  CHECK_THROWS_AS(w.kv(w.size() + 1), infkv::error);
  CHECK_THROWS_AS(w.query_rows(9, 5), infkv::error);

  const auto half = synthetic::convert(std::span<const float>(w.keys).first(64), dtype::f16);
  REQUIRE(half.size() == 128);
  const auto bf = synthetic::convert(std::span<const float>(w.keys).first(64), dtype::bf16);
  for (std::size_t i = 0; i < 64; ++i) {
    std::uint16_t h, b;
    std::memcpy(&h, half.data() + 2 * i, 2);
    std::memcpy(&b, bf.data() + 2 * i, 2);
    CHECK(h == f32_to_f16(w.keys[i]));
    CHECK(b == f32_to_bf16(w.keys[i]));
  }
}

TEST_CASE("synthetic: invalid parameters raise infkv::error naming the field") {
  const auto message = [](synthetic::config c) {
    try {
      (void)synthetic::generate(c);
    } catch (const infkv::error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(message({.tokens = 0}).find("config.tokens = 0") != std::string::npos);
  CHECK(message({.head_dim = 2}).find("config.head_dim = 2") != std::string::npos);
  CHECK(message({.round_jitter = 1.0}).find("config.round_jitter = 1") != std::string::npos);
  CHECK(message({.sink_logit = -1.0}).find("config.sink_logit = -1") != std::string::npos);
  CHECK(message({.local_tokens = 0.0}).find("config.local_tokens = 0") != std::string::npos);
  CHECK(message({.tokens = 8, .sinks = 9}).find("config.sinks = 9") != std::string::npos);
  CHECK(message({.tokens = 64}) == "no error");
}
