// infkv-compare: a recorded trace (examples/trace_io.hpp) as the workload the streaming loop of
// compare_stream.hpp runs on, and where the built-in trace is found.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include <infkv/error.hpp>
#include <infkv/rope.hpp>
#include "synthetic.hpp"

#include "trace_io.hpp"

namespace compare {

/// The RoPE a trace's queries and keys carry, from the metadata infkv-capture writes (rope_type,
/// rope_theta, rope_dims, rope_freq_scale); nullopt for "none" or a trace that does not say.
/// Expected Attention turns the queries back to before RoPE with it.
inline std::optional<infkv::rope> trace_rope(const trace_io::trace& t) {
  const auto get = [&](const char* k) { return t.metadata.count(k) ? t.metadata.at(k) : std::string(); };
  const std::string kind = get("rope_type");
  if (kind.empty() || kind == "none") return std::nullopt;
  INFKV_REQUIRE(kind == "norm" || kind == "neox", "trace metadata rope_type", kind,
                "expected_attention can turn back normal and NeoX RoPE only");
  const auto number = [&](const char* k, double fallback) {
    const std::string v = get(k);
    char* end = nullptr;
    const double x = v.empty() ? fallback : std::strtod(v.c_str(), &end);
    INFKV_REQUIRE(v.empty() || (end && *end == '\0'), std::string("trace metadata ") + k, v, "must be a number");
    return x;
  };
  return infkv::rope{.theta = number("rope_theta", 10000.0),
                     .dims = std::int32_t(number("rope_dims", 0.0)),
                     .style = kind == "neox" ? infkv::rope_style::neox : infkv::rope_style::normal,
                     .freq_scale = number("rope_freq_scale", 1.0)};
}

/// The first `tokens` tokens of one recorded layer as a workload: keys and values per KV head,
/// queries per query head (head h * group + g belongs to KV head h, as llama.cpp groups them),
/// token i at position i. Segments come from the trace, or are `segment_tokens` long when it has
/// none. A recorded `attention_scale` is folded into the queries (the loop scales by 1/sqrt(d)).
inline synthetic::workload to_workload(const trace_io::trace& t, std::int32_t layer, std::int64_t tokens,
                                       std::int64_t segment_tokens) {
  const auto& l = t.layer(layer);
  INFKV_REQUIRE(tokens >= 1 && tokens <= t.n_tokens, "--tokens", tokens, "must be in [1, ", t.n_tokens,
                "] (the trace's tokens)");
  INFKV_REQUIRE(segment_tokens >= 1, "segment_tokens", segment_tokens, "must be >= 1");
  synthetic::workload w;
  w.cfg.tokens = tokens;
  w.cfg.kv_heads = l.n_head_kv;
  w.cfg.group = l.n_head / l.n_head_kv;
  w.cfg.head_dim = l.head_dim;
  w.cfg.seed = 0;
  const auto n = std::size_t(tokens);
  w.keys.assign(l.k.begin(), l.k.begin() + std::ptrdiff_t(n * std::size_t(l.n_head_kv * l.head_dim)));
  w.values.assign(l.v.begin(), l.v.begin() + std::ptrdiff_t(n * std::size_t(l.n_head_kv * l.head_dim)));
  w.queries.assign(l.q.begin(), l.q.begin() + std::ptrdiff_t(n * std::size_t(l.n_head * l.head_dim)));
  if (const auto it = t.metadata.find("attention_scale"); it != t.metadata.end()) {
    char* end = nullptr;
    const double scale = std::strtod(it->second.c_str(), &end);
    INFKV_REQUIRE(end != it->second.c_str() && *end == '\0' && std::isfinite(scale) && scale > 0,
                  "__metadata__.attention_scale", it->second, "must be a positive number");
    const auto gain = float(scale * std::sqrt(double(l.head_dim)));
    if (gain != 1.0f)
      for (auto& x : w.queries) x *= gain;
  }
  w.tokens.resize(n);
  w.round_of.resize(n);
  w.roles.assign(n, synthetic::role::ordinary);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int32_t seg =
        t.segments.empty() ? std::int32_t(std::int64_t(i) / segment_tokens) : t.segments[i] - t.segments[0];
    w.tokens[i] = {std::int64_t(i), seg, infkv::modality::text};
    w.round_of[i] = seg;
    if (i == 0 || seg != w.tokens[i - 1].segment) w.rounds.push_back({std::int64_t(i), std::int64_t(i), false});
    w.rounds.back().end = std::int64_t(i) + 1;
  }
  return w;
}

/// Where the built-in trace may be, in lookup order: next to the installed program
/// (<bin>/../share/infkv), the install prefix, the source tree.
inline std::vector<std::string> default_trace_candidates() {
  std::vector<std::string> c;
#ifdef INFKV_TRACE_NAME
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) c.push_back((exe.parent_path().parent_path() / INFKV_TRACE_DATADIR / INFKV_TRACE_NAME).string());
  c.push_back(INFKV_TRACE_INSTALLED);
  c.push_back(INFKV_TRACE_SOURCE);
#endif
  return c;
}

/// The first existing built-in trace, or empty.
inline std::string find_default_trace() {
  for (const auto& p : default_trace_candidates()) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(p, ec)) return p;
  }
  return {};
}

}  // namespace compare
