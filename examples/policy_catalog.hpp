// Shared by infkv's example programs: the policies they run by name, the tokens each protects,
// and the policy object behind each name.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include <infkv/infkv.hpp>

#include "errors.hpp"

namespace infkv_examples {

/// The policies the example programs know (infkv-compare runs all but `recompute`).
enum class policy_kind {
  full, window, streaming_llm, h2o, tova, snapkv, keydiff, inf_mllm, inf_mllm_bias, inf_mllm_v, expected_attention, recompute,
  context_shift, recent_keydiff
};

/// A policy's name on the command line and a one-line description.
struct policy_entry {
  std::string_view name;
  policy_kind k;
  std::string_view about;
};

/// Every policy, in `policy_kind` order.
inline constexpr std::array<policy_entry, 14> policy_catalog{{
    {"full", policy_kind::full, "reference: keeps every token (no eviction)"},
    {"window", policy_kind::window, "the most recent tokens only (StreamingLLM without sinks)"},
    {"streaming_llm", policy_kind::streaming_llm, "sinks (--sinks) + the most recent tokens"},
    {"h2o", policy_kind::h2o, "accumulated attention of every query seen (heavy hitters) + recent"},
    {"tova", policy_kind::tova, "attention of the last query, mean over the heads"},
    {"snapkv", policy_kind::snapkv, "attention of the last --window queries, avg-pooled, + the window"},
    {"keydiff", policy_kind::keydiff, "keys least similar to the mean key (query-agnostic), + sinks/recent"},
    {"inf_mllm", policy_kind::inf_mllm, "sinks + recent + saddles (local attention sum of the window), no bias"},
    {"inf_mllm_bias", policy_kind::inf_mllm_bias, "inf_mllm with attention bias toward newer tokens (--beta)"},
    {"inf_mllm_v", policy_kind::inf_mllm_v, "inf_mllm_bias with attention times |v| (value-aware saddles)"},
    {"expected_attention", policy_kind::expected_attention,
     "attention expected from the next queries (mean + covariance of --ea-window queries) x |v|"},
    {"recompute", policy_kind::recompute, "oracle: per block, a fresh cache fed the last --budget tokens (slow)"},
    {"context_shift", policy_kind::context_shift,
     "llama.cpp's own context shift, no infkv: keep --sinks, drop half the rest when full"},
    {"recent_keydiff", policy_kind::recent_keydiff,
     "budget split: sinks + a recency region (--recent-share of the budget) + KeyDiff saddles for the rest"},
}};

/// True for the runs only an engine can make (the recompute oracle, llama.cpp's context shift):
/// no policy object, nothing to compare on a recorded trace.
constexpr bool engine_only(policy_kind k) { return k == policy_kind::recompute || k == policy_kind::context_shift; }

/// The entry of `name`, or nullopt.
inline std::optional<policy_entry> find_policy(std::string_view name) {
  for (const auto& p : policy_catalog)
    if (p.name == name) return p;
  return std::nullopt;
}

/// The knobs the policies share.
struct policy_knobs {
  std::int64_t sinks = 4;   ///< protected first tokens (streaming_llm, keydiff, inf_mllm*, expected_attention)
  std::int64_t recent = 32; ///< protected last tokens (h2o, snapkv, keydiff, inf_mllm*, expected_attention)
  std::int64_t window = 32; ///< queries that score the cache (snapkv, inf_mllm*)
  double beta = 8.0;        ///< attention bias of inf_mllm_bias (linear, age in ranks)
  std::int64_t ea_window = 128;  ///< queries whose statistics expected_attention uses
  double recent_share = 0.75;    ///< recent_keydiff: share of the budget that is the recency region (tuned)
  std::int32_t keydiff_kernel = 1;  ///< recent_keydiff: max pooling width of the KeyDiff scores (odd; 1: none)
  std::optional<infkv::rope> rotary{};  ///< the model's RoPE (expected_attention); nullopt: none
};

/// What is wrong with knobs a command line set that its range checks cannot see (naming the flag),
/// or empty.
inline std::string knobs_problem(const policy_knobs& s) {
  if (s.keydiff_kernel % 2 == 0)
    return "--keydiff-kernel = " + std::to_string(s.keydiff_kernel) +
           ": must be odd (a slot and the same number of neighbours on each side)";
  return {};
}

/// The queries a policy reads: what a session must keep per layer.
inline std::int64_t policy_window(policy_kind k, const policy_knobs& s) {
  switch (k) {
    case policy_kind::snapkv: case policy_kind::inf_mllm: case policy_kind::inf_mllm_bias: case policy_kind::inf_mllm_v:
      return s.window;
    case policy_kind::expected_attention: return s.ea_window;
    default: return 1;
  }
}

/// True when the policy weights scores by value norms (its inputs need the values).
inline bool policy_reads_values(policy_kind k) {
  return k == policy_kind::inf_mllm_v || k == policy_kind::expected_attention;
}

/// True when the policy reads anything a session copies out of the graph (queries, keys, values,
/// attention): false for streaming_llm and window, whose sessions then install no callback.
inline bool policy_observes(policy_kind k, const policy_knobs& s);

/// The budget (with its protected tokens) a policy evicts to; nullopt for full and recompute.
inline std::optional<infkv::budget> policy_budget(policy_kind k, std::int64_t capacity, const policy_knobs& s) {
  infkv::budget b{.capacity = capacity};
  switch (k) {
    case policy_kind::full: case policy_kind::recompute: case policy_kind::context_shift: return std::nullopt;
    case policy_kind::window: case policy_kind::tova: break;
    case policy_kind::streaming_llm: b.sinks = s.sinks; break;
    case policy_kind::h2o: b.recent = s.recent; break;
    case policy_kind::snapkv:
      b = infkv::protect(infkv::snapkv{.window = s.window}, {.capacity = capacity, .recent = s.recent});
      break;
    case policy_kind::keydiff: case policy_kind::inf_mllm: case policy_kind::inf_mllm_bias: case policy_kind::inf_mllm_v:
    case policy_kind::expected_attention:
      b.sinks = s.sinks, b.recent = s.recent;
      break;
    case policy_kind::recent_keydiff:
      b.sinks = s.sinks, b.recent = std::max(s.recent, std::int64_t(std::llround(s.recent_share * double(capacity))));
      break;
  }
  return b;
}

/// Calls `f` with the policy object of `k` (window: streaming_llm, whose budget has no sinks;
/// h2o: its configuration) and returns what `f` returns; full and recompute evict nothing and
/// are refused.
template <class F>
decltype(auto) with_policy(policy_kind k, const policy_knobs& s, F&& f) {
  switch (k) {
    case policy_kind::window: case policy_kind::streaming_llm: return f(infkv::streaming_llm{});
    case policy_kind::h2o: return f(infkv::h2o{});
    case policy_kind::tova: return f(infkv::tova{});
    case policy_kind::snapkv: return f(infkv::snapkv{.window = s.window});
    case policy_kind::keydiff: return f(infkv::keydiff{});
    case policy_kind::recent_keydiff:
      return f(infkv::keydiff{.pool = s.keydiff_kernel > 1 ? infkv::pooling::max : infkv::pooling::none,
                              .kernel = s.keydiff_kernel});
    case policy_kind::inf_mllm: return f(infkv::inf_mllm{.window = s.window});
    case policy_kind::inf_mllm_bias:  // ranks: with compacted positions the same as positions; also right in keep mode
      return f(infkv::inf_mllm{.window = s.window, .bias = {.beta = s.beta, .unit = infkv::age_unit::ranks}});
    case policy_kind::inf_mllm_v:
      return f(infkv::inf_mllm{.window = s.window, .bias = {.beta = s.beta, .unit = infkv::age_unit::ranks},
                               .value_norm = true});
    case policy_kind::expected_attention:  // kvpress's defaults; its n_sink = the protected sinks
      return f(infkv::expected_attention{.window = s.ea_window, .rotary = s.rotary, .sinks = s.sinks});
    case policy_kind::full: case policy_kind::recompute: case policy_kind::context_shift: break;
  }
  fail("policy {}: full, recompute and context_shift have no policy object", int(k));
}

inline bool policy_observes(policy_kind k, const policy_knobs& s) {
  if (k == policy_kind::full || engine_only(k)) return false;
  return with_policy(k, s, [](const auto& p) {
    if constexpr (std::is_same_v<std::decay_t<decltype(p)>, infkv::h2o>) return true;  // every decode's attention
    else return p.spec().needs() != infkv::needs_nothing;
  });
}

}  // namespace infkv_examples
