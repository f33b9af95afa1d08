// infkv-compare: compares KV-cache eviction policies on attention recorded from a real model
// (a safetensors trace of post-RoPE Q, K and V, examples/trace_io.hpp; by default the built-in
// SmolLM2 trace over the KJV Bible) or on a synthetic multi-round attention workload (sinks,
// local recency, attention saddles, rounds that move the attended region). Every block of tokens is appended to a bounded cache per (policy, budget), which is then
// evicted back to its budget and compacted; the queries of the next block measure how much of
// the full cache's attention mass the kept cache holds and how far its attention output drifts.
#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.hpp"

#include "compare_stream.hpp"
#include "compare_trace.hpp"

namespace {

using compare::kind;

/// Statistics of one (policy, budget) over its samples.
struct record {
  std::string policy;
  std::int64_t budget = 0;
  std::int64_t samples = 0, evictions = 0;
  double mass_mean = 0, mass_min = 0, err_mean = 0, err_max = 0, seconds = 0;
};

record summarise(const compare::policy_run& run, std::string_view name, std::int64_t budget) {
  record r{.policy = std::string(name), .budget = budget, .evictions = run.evictions(), .seconds = run.seconds()};
  r.mass_min = std::numeric_limits<double>::infinity();
  for (const auto& s : run.samples()) {
    if (s.context <= budget) continue;  // `full` is measured everywhere; keep this budget's points
    ++r.samples;
    r.mass_mean += s.mass, r.err_mean += s.error;
    r.mass_min = std::min(r.mass_min, s.mass), r.err_max = std::max(r.err_max, s.error);
  }
  if (r.samples) r.mass_mean /= double(r.samples), r.err_mean /= double(r.samples);
  return r;
}

/// Calls f(i) for i in [0, n) on `threads` threads, each taking the next index when free.
template <class F>
void dynamic_for(int threads, std::int64_t n, F&& f) {
  std::atomic<std::int64_t> next{0};
  infkv::cpu::parallel_for({threads}, threads, [&](std::int64_t) {
    for (std::int64_t i; (i = next++) < n;) f(i);
  });
}

std::string fixed(double v, int width, int digits) { return fmt::format("{:>{}.{}f}", v, width, digits); }

void print_table(const std::vector<record>& recs, const std::vector<std::string>& names,
                 const std::vector<std::int64_t>& budgets) {
  std::string head1(19, ' '), head2 = "policy             ";
  for (auto b : budgets) {
    std::string title = "budget " + std::to_string(b);
    head1 += std::string(std::max<std::size_t>(2, 18 - title.size()), ' ') + title;
    head2 += "    mass   out err";
  }
  std::cout << head1 << '\n' << head2 << '\n';
  for (const auto& name : names) {
    std::string line = name;
    line.resize(19, ' ');
    for (auto b : budgets)
      for (const auto& r : recs)
        if (r.policy == name && r.budget == b)
          line += r.samples ? "  " + fixed(r.mass_mean, 6, 3) + fixed(r.err_mean, 10, 3) : std::string(18, ' ');
    std::cout << line << '\n';
  }
  std::cout << "mass: share of the full cache's attention the kept cache holds, for the queries of the block\n"
               "after each eviction (mean over evictions); out err: relative L2 error of their attention output.\n";
}

nlohmann::json to_json(const std::vector<record>& recs) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : recs) {
    const auto opt = [&](double v) { return r.samples ? nlohmann::json(v) : nlohmann::json(nullptr); };
    j.push_back({{"policy", r.policy}, {"budget", r.budget}, {"samples", r.samples},
                 {"mass_kept", {{"mean", opt(r.mass_mean)}, {"min", opt(r.mass_min)}}},
                 {"output_rel_error", {{"mean", opt(r.err_mean)}, {"max", opt(r.err_max)}}},
                 {"evictions", r.evictions}, {"seconds", r.seconds}});
  }
  return j;
}

/// Per (policy, budget): the mean over layers of the means, the min of the minima, the max of
/// the maxima; samples, evictions and seconds summed.
std::vector<record> average(const std::vector<std::vector<record>>& per_layer) {
  std::vector<record> avg = per_layer.front();
  std::vector<std::int64_t> n(avg.size(), 0);
  for (std::size_t i = 0; i < avg.size(); ++i) {
    auto& a = avg[i];
    a.samples = a.evictions = 0, a.mass_mean = a.err_mean = a.seconds = a.err_max = 0;
    a.mass_min = std::numeric_limits<double>::infinity();
    for (const auto& layer : per_layer) {
      const auto& r = layer[i];
      a.samples += r.samples, a.evictions += r.evictions, a.seconds += r.seconds;
      if (!r.samples) continue;
      ++n[i], a.mass_mean += r.mass_mean, a.err_mean += r.err_mean;
      a.mass_min = std::min(a.mass_min, r.mass_min), a.err_max = std::max(a.err_max, r.err_max);
    }
    if (n[i]) a.mass_mean /= double(n[i]), a.err_mean /= double(n[i]);
  }
  return avg;
}

/// Streams `w` through every (policy, budget) and summarises; `n_blocks` gets the block count.
std::vector<record> run_workload(infkv::synthetic::workload& w, const std::vector<compare::policy_info>& chosen,
                                 const std::vector<std::int64_t>& budgets, const compare::settings& s,
                                 std::int64_t block, int threads, std::size_t& n_blocks) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t tokens = w.size();
  const auto plan = infkv::block_prefill{.block = block, .budget = budgets.back(), .first_block_fills_budget = false}
                        .plan(w.tokens);
  n_blocks = plan.size();
  std::int64_t max_block = 0;
  for (const auto& b : plan) max_block = std::max(max_block, b.end - b.begin);
  std::vector<std::unique_ptr<compare::policy_run>> runs;
  for (const auto& p : chosen) {
    if (p.k == kind::full) runs.push_back(std::make_unique<compare::policy_run>(p.k, 0, tokens, s, w.cfg));
    else
      for (auto b : budgets) runs.push_back(std::make_unique<compare::policy_run>(p.k, b, b + max_block, s, w.cfg));
  }
  auto last_report = start;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const std::int64_t context = plan[i].end;
    const bool measured = i + 1 < plan.size() && context > budgets.front();
    std::optional<compare::reference> ref;
    if (measured) ref = compare::make_reference(w, context, plan[i + 1], s.probes, {threads});
    dynamic_for(threads, std::int64_t(runs.size()), [&](std::int64_t r) {
      auto& run = *runs[std::size_t(r)];
      run.step(w, plan[i], {1});
      if (measured && (run.policy() == kind::full || context > run.capacity())) run.measure(*ref, {1});
    });
    const auto now = std::chrono::steady_clock::now();
    if (now - start > std::chrono::seconds(3) && now - last_report > std::chrono::seconds(2)) {
      std::cerr << "infkv-compare: block " << i + 1 << "/" << plan.size() << " ("
                << std::chrono::duration<double>(now - start).count() << " s)\n";
      last_report = now;
    }
  }
  std::vector<record> recs;
  for (const auto& run : runs) {
    const auto name = infkv_examples::policy_catalog[std::size_t(run->policy())].name;
    if (run->policy() == kind::full)
      for (auto b : budgets) recs.push_back(summarise(*run, name, b));
    else
      recs.push_back(summarise(*run, name, run->capacity()));
  }
  return recs;
}

using infkv_examples::at_least;

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "infkv-compare: error: " << msg << '\n';
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"infkv-compare: KV-cache eviction policies on recorded real-model attention (default: the built-in "
               "SmolLM2 trace) or a synthetic multi-round attention stream (--synthetic)"};
  app.name("infkv-compare");
  app.option_defaults()->always_capture_default();
  std::vector<std::string> policy_names;
  std::vector<std::int64_t> budgets;
  std::int64_t block = 256, tokens = 0;
  std::int32_t layer = -1;
  std::uint64_t seed = 1;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  std::string json_path, trace_path;
  bool list = false, synthetic = false;
  compare::settings s;
  app.add_option("--policy", policy_names, "policies to run (repeatable or comma list; default: all)")->delimiter(',');
  app.add_option("--budget", budgets, "cache budgets in tokens (repeatable or comma list; default 256,512,1024)")
      ->delimiter(',')->check(at_least(1));
  app.add_option("--block", block, "prefill block size in tokens (blocks end at segment changes)")
      ->check(at_least(1));
  auto* trace_opt = app.add_option("--trace", trace_path,
                                   "recorded trace (safetensors, docs/traces.md); default: the built-in trace");
  auto* synth_opt = app.add_flag("--synthetic", synthetic, "use the synthetic workload instead of a recorded trace");
  trace_opt->excludes(synth_opt);
  app.add_option("--layer", layer, "trace layer to run (default: every recorded layer, then their average)")
      ->check(at_least(0))->excludes(synth_opt);
  app.add_option("--tokens", tokens, "stream length (default: the whole trace; synthetic: 8192)")
      ->check(at_least(1));
  app.add_option("--seed", seed, "synthetic workload seed");
  app.add_option("--threads", threads, "worker threads")->check(at_least(1, true, 1024));
  app.add_option("--sinks", s.sinks, "protected first tokens (streaming_llm, keydiff, inf_mllm*, expected_attention)")
      ->check(at_least(0));
  app.add_option("--recent", s.recent, "protected recent tokens (scored policies)")
      ->check(at_least(0));
  app.add_option("--window", s.window, "retrieval window: last queries that score the cache")
      ->check(at_least(1));
  app.add_option("--probes", s.probes, "queries of the next block that measure fidelity")
      ->check(at_least(1));
  app.add_option("--beta", s.beta, "attention bias of inf_mllm_bias")->check(at_least(0, false));
  app.add_option("--ea-window", s.ea_window, "queries whose mean and covariance expected_attention uses")
      ->check(at_least(1));
  app.add_option("--recent-share", s.recent_share, "recent_keydiff: share of each budget kept as the recency region")
      ->check(at_least(0, false, 1));
  app.add_option("--keydiff-kernel", s.keydiff_kernel, "recent_keydiff: KeyDiff scores max-pooled over this many "
                                                        "neighbours (odd; 1: none)")->check(at_least(1, true, 1001));
  app.add_option("--json", json_path, "write one record per (policy, budget) to FILE ('-': stdout, no table)")
      ->check(infkv_examples::writable_file());
  app.add_flag("--list-policies", list, "list the policies and exit");
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const auto& p : infkv_examples::policy_catalog)
      if (compare::compared(p.k)) fmt::print("{:<19} {}\n", p.name, p.about);
    return 0;
  }
  // Policies in the table's order, each once.
  std::vector<compare::policy_info> chosen;
  std::set<std::string> wanted(policy_names.begin(), policy_names.end());
  for (const auto& w : wanted)
    if (const auto p = infkv_examples::find_policy(w); !p || !compare::compared(p->k))
      usage_error("--policy = " + w + ": unknown policy (see --list-policies)");
  for (const auto& p : infkv_examples::policy_catalog)
    if (compare::compared(p.k) && (wanted.empty() || wanted.count(std::string(p.name)))) chosen.push_back(p);
  if (const std::string why = infkv_examples::knobs_problem(s); !why.empty()) usage_error(why);
  if (budgets.empty()) budgets = {256, 512, 1024};
  std::sort(budgets.begin(), budgets.end());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
  for (auto b : budgets)
    for (const auto& p : chosen)
      if (const auto pb = compare::policy_budget(p.k, b, s); pb && b <= pb->sinks + pb->recent)
        usage_error("--budget = " + std::to_string(b) + ": must exceed the tokens " + std::string(p.name) +
                    " protects (sinks " + std::to_string(pb->sinks) + " + recent " + std::to_string(pb->recent) + ")");

  std::optional<trace_io::trace> trace;
  if (!synthetic) {
    if (trace_path.empty()) {
      trace_path = compare::find_default_trace();
      if (trace_path.empty()) {
        std::string tried;
        for (const auto& c : compare::default_trace_candidates()) tried += "\n  " + c;
        usage_error("--trace: no built-in trace found (looked in:" + tried + "); pass --trace FILE or --synthetic");
      }
    } else if (std::error_code ec; !std::filesystem::is_regular_file(trace_path, ec)) {
      usage_error("--trace = " + trace_path + ": no such file");
    }
    try {
      trace = trace_io::read_trace(trace_path);
    } catch (const infkv::error& e) {
      usage_error(std::string("--trace = ") + trace_path + ": " + e.what());
    }
    if (layer >= 0 && std::none_of(trace->layers.begin(), trace->layers.end(), [&](auto& l) { return l.layer == layer; }))
      usage_error("--layer = " + std::to_string(layer) + ": not in the trace (layers " + trace_io::layer_list(*trace) + ")");
    try {
      s.rotary = compare::trace_rope(*trace);
    } catch (const infkv::error& e) {
      usage_error(std::string("--trace = ") + trace_path + ": " + e.what());
    }
    if (tokens == 0) tokens = trace->n_tokens;
    if (tokens > trace->n_tokens)
      usage_error("--tokens = " + std::to_string(tokens) + ": the trace has " + std::to_string(trace->n_tokens));
  } else if (tokens == 0) {
    tokens = 8192;
  }
  if (tokens <= budgets.back())
    usage_error("--tokens = " + std::to_string(tokens) + ": must exceed the largest budget (" +
                std::to_string(budgets.back()) + ") so that the cache is evicted");

  std::ofstream json_file;
  if (!json_path.empty() && json_path != "-") {
    json_file.open(json_path);
    if (!json_file) usage_error("--json = " + json_path + ": cannot open the file for writing");
  }
  try {
    std::vector<std::string> names;
    for (const auto& p : chosen) names.emplace_back(p.name);
    nlohmann::json j;
    j["settings"] = {{"block", block}, {"sinks", s.sinks}, {"recent", s.recent}, {"window", s.window},
                     {"probes", s.probes}, {"beta", s.beta}, {"ea_window", s.ea_window},
                     {"recent_share", s.recent_share}, {"keydiff_kernel", s.keydiff_kernel}};
    const bool text = json_path != "-";
    std::vector<record> recs;
    std::size_t n_blocks = 0;
    if (synthetic) {
      auto w = infkv::synthetic::generate({.tokens = tokens, .seed = seed});
      recs = run_workload(w, chosen, budgets, s, block, threads, n_blocks);
      const auto videos = std::count_if(w.rounds.begin(), w.rounds.end(), [](auto& r) { return r.video; });
      const auto& c = w.cfg;
      j["workload"] = {{"kind", "synthetic"}, {"tokens", c.tokens}, {"kv_heads", c.kv_heads}, {"group", c.group},
                       {"head_dim", c.head_dim}, {"rounds", w.rounds.size()}, {"seed", c.seed}, {"blocks", n_blocks}};
      if (text) {
        std::cout << "infkv-compare: synthetic, " << tokens << " tokens in " << w.rounds.size() << " rounds ("
                  << videos << " video), " << c.kv_heads << " KV heads x " << c.group << " query heads, d = "
                  << c.head_dim << "; " << n_blocks << " blocks of <= " << block << " tokens; seed " << seed << "\n\n";
        print_table(recs, names, budgets);
      }
    } else {
      std::vector<std::vector<record>> per_layer;
      j["per_layer"] = nlohmann::json::array();
      const auto meta = [&](const char* k) { return trace->metadata.count(k) ? trace->metadata.at(k) : "?"; };
      if (text)
        std::cout << "infkv-compare: trace " << trace_path << "\n  model " << meta("model") << ", text " << meta("source")
                  << "; " << tokens << " of " << trace->n_tokens << " tokens, layers " << trace_io::layer_list(*trace)
                  << "\n";
      for (const auto& l : trace->layers) {
        if (layer >= 0 && l.layer != layer) continue;
        auto w = compare::to_workload(*trace, l.layer, tokens, 256);
        per_layer.push_back(run_workload(w, chosen, budgets, s, block, threads, n_blocks));
        j["per_layer"].push_back({{"layer", l.layer}, {"results", to_json(per_layer.back())}});
        if (text) {
          std::cout << "\nlayer " << l.layer << ": " << w.cfg.kv_heads << " KV heads x " << w.cfg.group
                    << " query heads, d = " << w.cfg.head_dim << "; " << w.rounds.size() << " segments, " << n_blocks
                    << " blocks of <= " << block << " tokens\n";
          print_table(per_layer.back(), names, budgets);
        }
      }
      recs = per_layer.size() == 1 ? per_layer.front() : average(per_layer);
      if (text && per_layer.size() > 1) {
        std::cout << "\nmean over layers " << trace_io::layer_list(*trace) << ":\n";
        print_table(recs, names, budgets);
      }
      j["workload"] = {{"kind", "trace"}, {"trace", trace_path}, {"model", meta("model")}, {"source", meta("source")},
                       {"tokens", tokens}, {"blocks", n_blocks}};
      j["workload"]["layers"] = nlohmann::json::array();
      for (const auto& p : j["per_layer"]) j["workload"]["layers"].push_back(p["layer"]);
    }
    j["results"] = to_json(recs);
    if (!json_path.empty()) {
      if (json_path == "-") {
        std::cout << j.dump(2) << '\n';
      } else {
        if (!(json_file << j.dump(2) << '\n' << std::flush)) usage_error("--json = " + json_path + ": cannot write the file");
      }
    }
  } catch (const infkv::error& e) {
    std::cerr << "infkv-compare: error: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "infkv-compare: failed: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
