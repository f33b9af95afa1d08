// infkv-soak: a long synthetic stream through the core, one policy at a time, as an engine's loop
// drives it: append a block of keys (f16, random), score the cache from the block's last queries
// with the policy, keep the budget, compact (K, V, tokens; H2O's state alike), repeat. Records the
// process RSS, the cached slots and the time of each eviction, and checks that nothing grows: the
// cache stays at budget + block, every container keeps its size after warm-up, the workspace is
// planned once, and the RSS stays within --rss-tolerance of its value after warm-up.
// Usage: infkv-soak [--tokens 10000000] [--policy a,b] [--csv FILE] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <infkv/cpu.hpp>
#include <nlohmann/json.hpp>

#include "cli_util.hpp"
#include "errors.hpp"
#include "policy_catalog.hpp"

namespace {

using infkv_tools::policy_kind;

/// Resident set size of this process in bytes (/proc/self/statm).
std::int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * std::int64_t(sysconf(_SC_PAGESIZE));
}

struct sample {
  std::int64_t tokens, slots, rss;
  double evict_us;
};

struct result {
  std::string policy;
  std::vector<sample> samples;
  std::int64_t rss_warm = 0, rss_max = 0, workspace = 0, evictions = 0;
  double us_first = 0, us_last = 0;  // median eviction time over the first and last tenth
  bool flat = true;
  std::string why;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct options {
  std::int64_t tokens = 10'000'000, budget = 1024, block = 128, sample_every = 64;
  std::int32_t kv_heads = 2, group = 3, head_dim = 64;
  double rss_tolerance = 0.05, warmup = 0.05;
  std::vector<std::string> policies;
  std::string csv, json;
};

template <class P>
result soak(const std::string& name, const P& policy, const infkv::budget& b, const options& o) {
  using namespace infkv;
  const std::int64_t cap = o.budget + o.block, d = o.head_dim, hkv = o.kv_heads, hq = hkv * o.group, w = 32;
  std::vector<std::uint16_t> k(std::size_t(cap * hkv * d)), v(k.size()), q(std::size_t(w * hq * d));
  std::vector<token> tokens;
  tokens.reserve(std::size_t(cap));
  std::vector<std::int64_t> qpos(static_cast<std::size_t>(w));
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  std::vector<float> row(std::size_t(std::max(hkv, hq) * d));
  const auto fill = [&](std::uint16_t* dst, std::int64_t rows, std::int64_t width) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t e = 0; e < width; ++e) row[std::size_t(e)] = normal(gen);
      from_f32(dtype::f16, row.data(), dst + r * width, width);
    }
  };
  const cpu::backend be{.ex = {.threads = 1}};
  std::optional<cpu::h2o_state> h2o_st;  // the state of a policy that reads accumulated attention
  if (const auto a = policy.spec().accumulates()) h2o_st.emplace(*a, hkv);
  std::optional<plan> pl;
  std::optional<cpu::workspace> ws;
  std::vector<std::int64_t> offsets, slots;
  result res;
  res.policy = name;
  // The soak's own records are allocated and touched up front, so that they do not show as growth.
  const std::int64_t expected = o.tokens / o.block + 1;
  std::vector<double> times(static_cast<std::size_t>(expected), 0.0);
  res.samples.assign(std::size_t(expected / o.sample_every + 1), sample{});
  std::size_t n_samples = 0;
  std::int64_t n = 0, pos = 0, blocks = 0;
  const auto warm_blocks = std::max<std::int64_t>(4, std::int64_t(o.warmup * double(o.tokens / o.block)));
  while (pos < o.tokens) {
    const std::int64_t add = std::min(o.block, o.tokens - pos);
    fill(k.data() + n * hkv * d, add, hkv * d);
    fill(v.data() + n * hkv * d, add, hkv * d);
    for (std::int64_t i = 0; i < add; ++i) tokens.push_back({pos + i, std::int32_t((pos + i) / 4096), modality::text});
    fill(q.data(), w, hq * d);
    for (std::int64_t i = 0; i < w; ++i) qpos[std::size_t(i)] = pos + add - w + i;
    n += add, pos += add, ++blocks;
    if (n <= o.budget) continue;
    const auto t0 = std::chrono::steady_clock::now();
    kv_view kv = contiguous_nhd(k.data(), v.data(), dtype::f16, n, std::int32_t(hkv), std::int32_t(d));
    layer_inputs<> in{kv.k, kv.v, nhd(q.data(), dtype::f16, w, std::int32_t(hq), std::int32_t(d)), qpos, tokens, 0.f};
    if (h2o_st) {
      h2o_st->append(n - h2o_st->n_slots());
      cpu::observe(*h2o_st, in);
      in = h2o_st->attach(in);
    }
    const auto& inputs = in;
    if (!pl || pl->shape.n_slots != n) {  // planned once the cache is full (every eviction sees budget + block)
      pl = make_plan(be, policy, b, shape_of(inputs), {.g = granularity::per_token});
      if (!ws || ws->span().size() < pl->workspace_bytes) ws.emplace(pl->workspace_bytes);
      offsets.assign(std::size_t(pl->offsets_size()), 0), slots.assign(std::size_t(pl->kept_total), 0);
    }
    run(*pl, be, std::span<const layer_inputs<>>(&inputs, 1), ws->span(), {slots.data(), offsets.data(), 1, n});
    const keep_set keep = keep_set::from_view({slots.data(), offsets.data(), 1, n});
    if (h2o_st) h2o_st->evict(keep);
    n = cpu::compact(kv, tokens, keep);
    tokens.resize(std::size_t(n));
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    times[std::size_t(res.evictions++)] = us;
    const std::int64_t rss = rss_bytes();
    if (blocks == warm_blocks || res.rss_warm == 0) res.rss_warm = rss, res.workspace = std::int64_t(ws->span().size());
    if (blocks > warm_blocks) res.rss_max = std::max(res.rss_max, rss);
    // Nothing may grow: the cache, the token list, H2O's state, the plan's workspace.
    const auto fail = [&](std::string why) {
      if (res.flat) res.why = std::move(why);
      res.flat = false;
    };
    if (n != o.budget) fail(fmt::format("cache kept {} slots, not the budget {}", n, o.budget));
    if (tokens.capacity() > std::size_t(cap)) fail(fmt::format("token list capacity grew to {}", tokens.capacity()));
    if (h2o_st && h2o_st->n_slots() != n) fail("h2o state out of step with the cache");
    if (blocks > warm_blocks && std::int64_t(ws->span().size()) != res.workspace)
      fail("the workspace was planned again");
    if (res.evictions % o.sample_every == 0) res.samples[n_samples++] = {pos, n + o.block, rss, us};
  }
  times.resize(std::size_t(res.evictions));
  res.samples.resize(n_samples);
  if (res.rss_warm > 0 && double(res.rss_max) > double(res.rss_warm) * (1 + o.rss_tolerance))
    res.flat = false, res.why = fmt::format("RSS grew from {} to {} bytes after warm-up", res.rss_warm, res.rss_max);
  const std::size_t tenth = std::max<std::size_t>(1, times.size() / 10);
  res.us_first = median({times.begin() + std::ptrdiff_t(std::min(times.size(), std::size_t(warm_blocks))),
                         times.begin() + std::ptrdiff_t(std::min(times.size(), std::size_t(warm_blocks) + tenth))});
  res.us_last = median({times.end() - std::ptrdiff_t(tenth), times.end()});
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "infkv-soak: a long synthetic stream through the core, one policy at a time; checks that memory and "
      "every container stay flat"};
  app.name("infkv-soak");
  options o;
  using infkv_tools::at_least;
  app.add_option("--tokens", o.tokens, "stream length")->check(at_least(1));
  app.add_option("--budget", o.budget, "slots kept after each eviction")->check(at_least(64));
  app.add_option("--block", o.block, "tokens appended between two evictions")->check(at_least(1));
  app.add_option("--policy", o.policies, "policies (comma list; default: every evicting policy)")->delimiter(',');
  app.add_option("--sample-every", o.sample_every, "evictions between two recorded samples")->check(at_least(1));
  app.add_option("--rss-tolerance", o.rss_tolerance, "allowed RSS growth after warm-up (fraction)")
      ->check(at_least(0, false, 1e6));
  app.add_option("--warmup", o.warmup, "fraction of the stream before memory must stay flat")
      ->check(at_least(0, false, 0.9));
  app.add_option("--csv", o.csv, "samples as CSV: policy,tokens,slots,rss_bytes,evict_us")
      ->check(infkv_tools::writable_file());
  app.add_option("--json", o.json, "summary per policy as JSON")->check(infkv_tools::writable_file());
  CLI11_PARSE(app, argc, argv);
  if (o.policies.empty())
    for (const auto& p : infkv_tools::policy_catalog)
      if (p.k != policy_kind::full && !infkv_tools::engine_only(p.k)) o.policies.emplace_back(p.name);
  try {
    std::vector<result> results;
    const infkv_tools::policy_knobs knobs{};
    for (const auto& name : o.policies) {
      const auto entry = infkv_tools::find_policy(name);
      if (!entry || entry->k == policy_kind::full || infkv_tools::engine_only(entry->k))
        infkv_tools::fail("--policy = {}: not an evicting policy (see infkv-stream --list-policies)", name);
      const auto b = *infkv_tools::policy_budget(entry->k, o.budget, knobs);
      results.push_back(infkv_tools::with_policy(entry->k, knobs, [&](const auto& p) { return soak(name, p, b, o); }));
      const result& r = results.back();
      fmt::print(
          "{:<18} {:>9} tokens, {:>6} evictions: rss {:.1f} -> max {:.1f} MiB after warm-up, eviction {:.0f} -> {:.0f} "
          "us "
          "(median, first / last tenth): {}\n",
          r.policy, o.tokens, r.evictions, double(r.rss_warm) / 1048576.0, double(r.rss_max) / 1048576.0, r.us_first,
          r.us_last, r.flat ? "flat" : "GREW: " + r.why);
    }
    if (!o.csv.empty()) {
      std::string csv = "policy,tokens,slots,rss_bytes,evict_us\n";
      for (const auto& r : results)
        for (const auto& s : r.samples)
          csv += fmt::format("{},{},{},{},{:.1f}\n", r.policy, s.tokens, s.slots, s.rss, s.evict_us);
      std::ofstream(o.csv) << csv;
    }
    if (!o.json.empty()) {
      nlohmann::json j;
      j["tokens"] = o.tokens, j["budget"] = o.budget, j["block"] = o.block;
      for (const auto& r : results)
        j["policies"].push_back({{"policy", r.policy},
                                 {"evictions", r.evictions},
                                 {"rss_warm", r.rss_warm},
                                 {"rss_max", r.rss_max},
                                 {"evict_us_first", r.us_first},
                                 {"evict_us_last", r.us_last},
                                 {"flat", r.flat},
                                 {"why", r.why}});
      std::ofstream(o.json) << j.dump(1) << "\n";
    }
    return std::all_of(results.begin(), results.end(), [](const result& r) { return r.flat; }) ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "infkv-soak: error: {}\n", e.what());
    return 1;
  }
}
