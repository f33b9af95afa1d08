// Shared by infkv's tools: the policies they run by name, the budget knobs each takes, and the
// policy object behind each name (what it captures and protects comes from the object itself).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include <infkv/infkv.hpp>

#include "errors.hpp"

namespace infkv_tools {

/// The policies the example programs know (infkv-compare runs all but `recompute`).
enum class policy_kind {
  full,
  window,
  streaming_llm,
  h2o,
  tova,
  snapkv,
  keydiff,
  inf_mllm,
  inf_mllm_bias,
  inf_mllm_v,
  expected_attention,
  recompute,
  context_shift,
  recent_keydiff,
  saddle_union
};

/// The knobs the policies share.
struct policy_knobs {
  std::int64_t sinks = 4;           ///< protected first tokens (streaming_llm, keydiff, inf_mllm*, expected_attention)
  std::int64_t recent = 32;         ///< protected last tokens (h2o, snapkv, keydiff, inf_mllm*, expected_attention)
  std::int64_t window = 32;         ///< queries that score the cache (snapkv, inf_mllm*)
  double beta = 8.0;                ///< attention bias of inf_mllm_bias (linear, age in ranks)
  std::int64_t ea_window = 128;     ///< queries whose statistics expected_attention uses
  double recent_share = 0.75;       ///< recent_keydiff, saddle_union: share of the budget that is the recency region
  double union_share = 0.5;         ///< saddle_union: share of the saddles chosen by attention (the rest: KeyDiff)
  std::int32_t keydiff_kernel = 1;  ///< recent_keydiff: max pooling width of the KeyDiff scores (odd; 1: none)
  std::optional<infkv::rope> rotary{};  ///< the model's RoPE (expected_attention); nullopt: none
};

/// A tool's policy object: one of the library's (infkv::policy_variant), or the union saddle_union runs.
using tool_policy = infkv::policy_variant<infkv::union_of<infkv::inf_mllm, infkv::keydiff>>;

/// A policy's name on the command line, a one-line description, which of the protected-token
/// knobs (--sinks, --recent) its budget takes, and how its object is made from the knobs (none
/// for the runs that evict nothing themselves: full, recompute, context_shift).
struct policy_entry {
  std::string_view name;
  policy_kind k;
  std::string_view about;
  bool sinks = false;   ///< the budget protects --sinks first tokens
  bool recent = false;  ///< the budget protects --recent newest tokens
  tool_policy (*make)(const policy_knobs&) = nullptr;
};

namespace detail {
// ranks: with compacted positions the same as positions; also right in keep mode
inline infkv::inf_mllm biased(const policy_knobs& s) {
  return {.window = s.window, .bias = {.beta = s.beta, .unit = infkv::age_unit::ranks}};
}
inline infkv::keydiff pooled(const policy_knobs& s) {
  return {.pool = s.keydiff_kernel > 1 ? infkv::pooling::max : infkv::pooling::none, .kernel = s.keydiff_kernel};
}
}  // namespace detail

/// Every policy, in `policy_kind` order.
inline constexpr std::array<policy_entry, 15> policy_catalog{{
    {"full", policy_kind::full, "reference: keeps every token (no eviction)"},
    {"window", policy_kind::window, "the most recent tokens only (StreamingLLM without sinks)", false, false,
     [](const policy_knobs&) -> tool_policy { return infkv::streaming_llm{}; }},
    {"streaming_llm", policy_kind::streaming_llm, "sinks (--sinks) + the most recent tokens", true, false,
     [](const policy_knobs&) -> tool_policy { return infkv::streaming_llm{}; }},
    {"h2o", policy_kind::h2o, "accumulated attention of every query seen (heavy hitters) + recent", false, true,
     [](const policy_knobs&) -> tool_policy { return infkv::h2o{}; }},
    {"tova", policy_kind::tova, "attention of the last query, mean over the heads", false, false,
     [](const policy_knobs&) -> tool_policy { return infkv::tova{}; }},
    {"snapkv", policy_kind::snapkv, "attention of the last --window queries, avg-pooled, + the window", false, true,
     [](const policy_knobs& s) -> tool_policy { return infkv::snapkv{.window = s.window}; }},
    {"keydiff", policy_kind::keydiff, "keys least similar to the mean key (query-agnostic), + sinks/recent", true, true,
     [](const policy_knobs&) -> tool_policy { return infkv::keydiff{}; }},
    {"inf_mllm", policy_kind::inf_mllm, "sinks + recent + saddles (local attention sum of the window), no bias", true,
     true, [](const policy_knobs& s) -> tool_policy { return infkv::inf_mllm{.window = s.window}; }},
    {"inf_mllm_bias", policy_kind::inf_mllm_bias, "inf_mllm with attention bias toward newer tokens (--beta)", true,
     true, [](const policy_knobs& s) -> tool_policy { return detail::biased(s); }},
    {"inf_mllm_v", policy_kind::inf_mllm_v, "inf_mllm_bias with attention times |v| (value-aware saddles)", true, true,
     [](const policy_knobs& s) -> tool_policy {
       infkv::inf_mllm v = detail::biased(s);
       v.value_norm = true;
       return v;
     }},
    {"expected_attention", policy_kind::expected_attention,
     "attention expected from the next queries (mean + covariance of --ea-window queries) x |v|", true, true,
     [](const policy_knobs& s) -> tool_policy {  // kvpress's defaults; its n_sink = the protected sinks
       return infkv::expected_attention{.window = s.ea_window, .rotary = s.rotary, .sinks = s.sinks};
     }},
    {"recompute", policy_kind::recompute, "oracle: per block, a fresh cache fed the last --budget tokens (slow)"},
    {"context_shift", policy_kind::context_shift,
     "llama.cpp's own context shift, no infkv: keep --sinks, drop half the rest when full"},
    {"recent_keydiff", policy_kind::recent_keydiff,
     "budget split: sinks + a recency region (--recent-share of the budget) + KeyDiff saddles for the rest", true, true,
     [](const policy_knobs& s) -> tool_policy { return detail::pooled(s); }},
    {"saddle_union", policy_kind::saddle_union,
     "recent_keydiff's split, saddles the union of attention (inf_mllm_bias, --beta: --union-share of them) and "
     "KeyDiff",
     true, true,
     [](const policy_knobs& s) -> tool_policy {
       return infkv::union_of<infkv::inf_mllm, infkv::keydiff>{
           .first = detail::biased(s), .second = detail::pooled(s), .share = s.union_share};
     }},
}};
static_assert(
    [] {
      for (std::size_t i = 0; i < policy_catalog.size(); ++i)
        if (std::size_t(policy_catalog[i].k) != i) return false;
      return true;
    }(),
    "policy_catalog lists the policies in policy_kind order (with_policy indexes it by kind)");

/// True for the runs only an engine can make (the recompute oracle, llama.cpp's context shift):
/// no policy object, nothing to compare on a recorded trace.
constexpr bool engine_only(policy_kind k) { return k == policy_kind::recompute || k == policy_kind::context_shift; }

/// The entry of `name`, or nullopt.
inline std::optional<policy_entry> find_policy(std::string_view name) {
  for (const auto& p : policy_catalog)
    if (p.name == name) return p;
  return std::nullopt;
}

/// What is wrong with knobs a command line set that its range checks cannot see (naming the flag),
/// or empty.
inline std::string knobs_problem(const policy_knobs& s) {
  if (s.keydiff_kernel % 2 == 0)
    return "--keydiff-kernel = " + std::to_string(s.keydiff_kernel) +
           ": must be odd (a slot and the same number of neighbours on each side)";
  return {};
}

/// The budget a policy evicts to, from --budget (`capacity`) and the knobs its entry takes (the
/// policy's own protection, e.g. SnapKV's window, is applied by the pipeline); nullopt for the
/// runs that evict nothing themselves (full, recompute, context_shift).
inline std::optional<infkv::budget> policy_budget(policy_kind k, std::int64_t capacity, const policy_knobs& s) {
  if (k == policy_kind::full || engine_only(k)) return std::nullopt;
  const policy_entry& e = policy_catalog[std::size_t(k)];
  infkv::budget b{.capacity = capacity, .sinks = e.sinks ? s.sinks : 0, .recent = e.recent ? s.recent : 0};
  if (k == policy_kind::recent_keydiff || k == policy_kind::saddle_union)  // the recency region: a share
    b.recent = std::max(b.recent, std::int64_t(std::llround(s.recent_share * double(capacity))));
  return b;
}

/// Calls `f` with the policy object of `k` (window: streaming_llm, whose budget has no sinks;
/// saddle_union: an infkv::union_of) and returns what `f` returns; full, recompute and
/// context_shift evict nothing themselves and are refused.
template <class F>
decltype(auto) with_policy(policy_kind k, const policy_knobs& s, F&& f) {
  const policy_entry& e = policy_catalog[std::size_t(k)];
  if (e.make == nullptr) fail("policy {}: full, recompute and context_shift have no policy object", e.name);
  return std::visit([&](const auto& p) -> decltype(auto) { return f(p); }, e.make(s));
}

/// What policy `k` reads from the engine (infkv::capture_needs_of its object); nothing for the
/// runs without one.
inline infkv::capture_needs policy_capture(policy_kind k, const policy_knobs& s) {
  if (k == policy_kind::full || engine_only(k)) return {};
  return with_policy(k, s, [](const auto& p) { return infkv::capture_needs_of(p); });
}

/// Why --budget = `capacity` cannot serve policy `k` (it must exceed the tokens the policy keeps
/// whatever their scores: the budget's sinks and recent tokens after the policy's own
/// protection), or empty when it can.
inline std::string budget_problem(policy_kind k, std::int64_t capacity, const policy_knobs& s) {
  auto b = policy_budget(k, capacity, s);
  if (!b) return {};
  with_policy(k, s, [&](const auto& p) { b = infkv::protect(p, *b); });
  if (capacity > b->sinks + b->recent) return {};
  return fmt::format("--budget = {}: must exceed the tokens {} protects (sinks {} + recent {})", capacity,
                     policy_catalog[std::size_t(k)].name, b->sinks, b->recent);
}

}  // namespace infkv_tools
