// infkv-compare: compares KV-cache eviction policies on attention recorded from a real model
// (a safetensors trace of post-RoPE Q, K and V, examples/trace_io.hpp; by default the built-in
// SmolLM2 trace over the KJV Bible) or on a synthetic multi-round attention workload (sinks,
// local recency, attention saddles, rounds that move the attended region). Every block of tokens is appended to a
// bounded cache per (policy, budget), which is then evicted back to its budget and compacted; the queries of the next
// block measure how much of the full cache's attention mass the kept cache holds and how far its attention output
// drifts.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
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

void print_table(const std::vector<record>& recs, const std::vector<std::string>& names,
                 const std::vector<std::int64_t>& budgets) {
  std::string head1(19, ' '), head2 = "policy             ";
  for (auto b : budgets) {
    const std::string title = "budget " + std::to_string(b);
    head1 += std::string(std::max<std::size_t>(2, 18 - title.size()), ' ') + title;
    head2 += "    mass   out err";
  }
  fmt::print("{}\n{}\n", head1, head2);
  for (const auto& name : names) {
    std::string line = name;
    line.resize(19, ' ');
    for (auto b : budgets)
      for (const auto& r : recs)
        if (r.policy == name && r.budget == b)
          line += r.samples ? fmt::format("  {:>6.3f}{:>10.3f}", r.mass_mean, r.err_mean) : std::string(18, ' ');
    fmt::print("{}\n", line);
  }
  fmt::print(
      "mass: share of the full cache's attention the kept cache holds, for the queries of the block\n"
      "after each eviction (mean over evictions); out err: relative L2 error of their attention output.\n");
}

nlohmann::json to_json(const std::vector<record>& recs) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : recs) {
    const auto opt = [&](double v) { return r.samples ? nlohmann::json(v) : nlohmann::json(nullptr); };
    j.push_back({{"policy", r.policy},
                 {"budget", r.budget},
                 {"samples", r.samples},
                 {"mass_kept", {{"mean", opt(r.mass_mean)}, {"min", opt(r.mass_min)}}},
                 {"output_rel_error", {{"mean", opt(r.err_mean)}, {"max", opt(r.err_max)}}},
                 {"evictions", r.evictions},
                 {"seconds", r.seconds}});
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
std::vector<record> run_workload(synthetic::workload& w, const std::vector<compare::policy_info>& chosen,
                                 const std::vector<std::int64_t>& budgets, const compare::settings& s,
                                 std::int64_t block, int threads, std::size_t& n_blocks) {
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t tokens = w.size();
  const auto plan =
      infkv::block_prefill{.block = block, .budget = budgets.back(), .first_block_fills_budget = false}.plan(w.tokens);
  n_blocks = plan.size();
  std::int64_t max_block = 0;
  for (const auto& b : plan) max_block = std::max(max_block, b.end - b.begin);
  std::vector<std::unique_ptr<compare::policy_run>> runs;
  for (const auto& p : chosen) {
    if (p.k == kind::full)
      runs.push_back(std::make_unique<compare::policy_run>(p.k, 0, tokens, s, w.cfg));
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
      fmt::print(stderr, "infkv-compare: block {}/{} ({:.1f} s)\n", i + 1, plan.size(),
                 std::chrono::duration<double>(now - start).count());
      last_report = now;
    }
  }
  std::vector<record> recs;
  for (const auto& run : runs) {
    const auto name = infkv_tools::policy_catalog[std::size_t(run->policy())].name;
    if (run->policy() == kind::full)
      for (auto b : budgets) recs.push_back(summarise(*run, name, b));
    else
      recs.push_back(summarise(*run, name, run->capacity()));
  }
  return recs;
}

using infkv_tools::at_least;

[[noreturn]] void usage_error(const std::string& msg) {
  fmt::print(stderr, "infkv-compare: error: {}\n", msg);
  std::exit(2);
}

/// The command line.
struct options {
  std::vector<std::string> policies;
  std::vector<std::int64_t> budgets;
  std::int64_t block = 256, tokens = 0;
  std::int32_t layer = -1;
  std::uint64_t seed = 1;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  std::string json_path, trace_path;
  bool list = false, synthetic = false;
  compare::settings s;
};

void add_options(CLI::App& app, options& o) {
  app.name("infkv-compare");
  app.option_defaults()->always_capture_default();
  compare::settings& s = o.s;
  app.add_option("--policy", o.policies, "policies to run (repeatable or comma list; default: all)")->delimiter(',');
  app.add_option("--budget", o.budgets, "cache budgets in tokens (repeatable or comma list; default 256,512,1024)")
      ->delimiter(',')
      ->check(at_least(1));
  app.add_option("--block", o.block, "prefill block size in tokens (blocks end at segment changes)")
      ->check(at_least(1));
  auto* trace_opt = app.add_option("--trace", o.trace_path,
                                   "recorded trace (safetensors, docs/traces.md); default: the built-in trace");
  auto* synth_opt = app.add_flag("--synthetic", o.synthetic, "use the synthetic workload instead of a recorded trace");
  trace_opt->excludes(synth_opt);
  app.add_option("--layer", o.layer, "trace layer to run (default: every recorded layer, then their average)")
      ->check(at_least(0))
      ->excludes(synth_opt);
  app.add_option("--tokens", o.tokens, "stream length (default: the whole trace; synthetic: 8192)")->check(at_least(1));
  app.add_option("--seed", o.seed, "synthetic workload seed");
  app.add_option("--threads", o.threads, "worker threads")->check(at_least(1, true, 1024));
  app.add_option("--sinks", s.sinks, "protected first tokens (streaming_llm, keydiff, inf_mllm*, expected_attention)")
      ->check(at_least(0));
  app.add_option("--recent", s.recent, "protected recent tokens (scored policies)")->check(at_least(0));
  app.add_option("--window", s.window, "retrieval window: last queries that score the cache")->check(at_least(1));
  app.add_option("--probes", s.probes, "queries of the next block that measure fidelity")->check(at_least(1));
  app.add_option("--beta", s.beta, "attention bias of inf_mllm_bias")->check(at_least(0, false));
  app.add_option("--ea-window", s.ea_window, "queries whose mean and covariance expected_attention uses")
      ->check(at_least(1));
  app.add_option("--recent-share", s.recent_share,
                 "recent_keydiff, saddle_union: share of each budget kept as the recency region")
      ->check(at_least(0, false, 1));
  app.add_option("--union-share", s.union_share,
                 "saddle_union: share of the saddles chosen by attention (inf_mllm_bias), the rest by KeyDiff")
      ->check(at_least(0, false, 1));
  app.add_option("--keydiff-kernel", s.keydiff_kernel,
                 "recent_keydiff, saddle_union: KeyDiff scores max-pooled over this many neighbours (odd; 1: none)")
      ->check(at_least(1, true, 1001));
  app.add_option("--json", o.json_path, "write one record per (policy, budget) to FILE ('-': stdout, no table)")
      ->check(infkv_tools::writable_file());
  app.add_flag("--list-policies", o.list, "list the policies and exit");
}

/// What a valid command line asks for: the policies in the table's order, the budgets ascending,
/// the trace (unless synthetic) and the stream length.
struct job {
  std::vector<compare::policy_info> chosen;
  std::vector<std::int64_t> budgets;
  std::optional<trace_io::trace> trace;
  std::int64_t tokens = 0;
};

/// Checks every option against the others and the trace; exits naming the flag on the first problem.
job validate(options& o) {
  job jb;
  const std::set<std::string> wanted(o.policies.begin(), o.policies.end());
  for (const auto& w : wanted)
    if (const auto p = infkv_tools::find_policy(w); !p || !compare::compared(p->k))
      usage_error("--policy = " + w + ": unknown policy (see --list-policies)");
  for (const auto& p : infkv_tools::policy_catalog)
    if (compare::compared(p.k) && (wanted.empty() || wanted.count(std::string(p.name)))) jb.chosen.push_back(p);
  if (const std::string why = infkv_tools::knobs_problem(o.s); !why.empty()) usage_error(why);
  jb.budgets = o.budgets.empty() ? std::vector<std::int64_t>{256, 512, 1024} : o.budgets;
  std::sort(jb.budgets.begin(), jb.budgets.end());
  jb.budgets.erase(std::unique(jb.budgets.begin(), jb.budgets.end()), jb.budgets.end());
  for (auto b : jb.budgets)
    for (const auto& p : jb.chosen)
      if (const std::string why = infkv_tools::budget_problem(p.k, b, o.s); !why.empty()) usage_error(why);
  jb.tokens = o.tokens;
  if (o.synthetic) {
    if (jb.tokens == 0) jb.tokens = 8192;
  } else {
    if (o.trace_path.empty()) {
      o.trace_path = compare::find_default_trace();
      if (o.trace_path.empty()) {
        std::string tried;
        for (const auto& c : compare::default_trace_candidates()) tried += "\n  " + c;
        usage_error("--trace: no built-in trace found (looked in:" + tried + "); pass --trace FILE or --synthetic");
      }
    } else if (std::error_code ec; !std::filesystem::is_regular_file(o.trace_path, ec)) {
      usage_error("--trace = " + o.trace_path + ": no such file");
    }
    try {
      jb.trace = trace_io::read_trace(o.trace_path);
      o.s.rotary = compare::trace_rope(*jb.trace);
    } catch (const infkv::error& e) {
      usage_error(std::string("--trace = ") + o.trace_path + ": " + e.what());
    }
    const auto& layers = jb.trace->layers;
    if (o.layer >= 0 && std::none_of(layers.begin(), layers.end(), [&](auto& l) { return l.layer == o.layer; }))
      usage_error("--layer = " + std::to_string(o.layer) + ": not in the trace (layers " +
                  trace_io::layer_list(*jb.trace) + ")");
    if (jb.tokens == 0) jb.tokens = jb.trace->n_tokens;
    if (jb.tokens > jb.trace->n_tokens)
      usage_error("--tokens = " + std::to_string(jb.tokens) + ": the trace has " + std::to_string(jb.trace->n_tokens));
  }
  if (jb.tokens <= jb.budgets.back())
    usage_error("--tokens = " + std::to_string(jb.tokens) + ": must exceed the largest budget (" +
                std::to_string(jb.budgets.back()) + ") so that the cache is evicted");
  return jb;
}

/// One workload's results: what it was and a record per (policy, budget).
struct section {
  std::string title;  ///< the table's heading
  std::int32_t layer = -1;
  std::vector<record> recs;
};

/// What a run found: the sections (the synthetic workload, or each trace layer), the records the
/// JSON and the last table report (a single section's, or the mean over layers), the workload.
struct results {
  std::vector<section> sections;
  std::vector<record> recs;
  std::string header;
  nlohmann::json workload;
};

results run(const options& o, const job& jb) {
  results r;
  std::size_t n_blocks = 0;
  if (o.synthetic) {
    auto w = synthetic::generate({.tokens = jb.tokens, .seed = o.seed});
    r.recs = run_workload(w, jb.chosen, jb.budgets, o.s, o.block, o.threads, n_blocks);
    const auto videos = std::count_if(w.rounds.begin(), w.rounds.end(), [](auto& x) { return x.video; });
    const auto& c = w.cfg;
    r.header = fmt::format(
        "infkv-compare: synthetic, {} tokens in {} rounds ({} video), {} KV heads x {} query heads, "
        "d = {}; {} blocks of <= {} tokens; seed {}\n",
        jb.tokens, w.rounds.size(), videos, c.kv_heads, c.group, c.head_dim, n_blocks, o.block, o.seed);
    r.sections.push_back({"", -1, r.recs});
    r.workload = {{"kind", "synthetic"}, {"tokens", c.tokens},     {"kv_heads", c.kv_heads},
                  {"group", c.group},    {"head_dim", c.head_dim}, {"rounds", w.rounds.size()},
                  {"seed", c.seed},      {"blocks", n_blocks}};
    return r;
  }
  const trace_io::trace& t = *jb.trace;
  const auto meta = [&](const char* k) { return t.metadata.count(k) ? t.metadata.at(k) : "?"; };
  r.header = fmt::format("infkv-compare: trace {}\n  model {}, text {}; {} of {} tokens, layers {}\n", o.trace_path,
                         meta("model"), meta("source"), jb.tokens, t.n_tokens, trace_io::layer_list(t));
  std::vector<std::vector<record>> per_layer;
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : t.layers) {
    if (o.layer >= 0 && l.layer != o.layer) continue;
    auto w = compare::to_workload(t, l.layer, jb.tokens, 256);
    per_layer.push_back(run_workload(w, jb.chosen, jb.budgets, o.s, o.block, o.threads, n_blocks));
    r.sections.push_back(
        {fmt::format("layer {}: {} KV heads x {} query heads, d = {}; {} segments, {} blocks of <= {} "
                     "tokens",
                     l.layer, w.cfg.kv_heads, w.cfg.group, w.cfg.head_dim, w.rounds.size(), n_blocks, o.block),
         l.layer, per_layer.back()});
    layers.push_back(l.layer);
  }
  r.recs = per_layer.size() == 1 ? per_layer.front() : average(per_layer);
  if (per_layer.size() > 1) r.sections.push_back({"mean over layers " + trace_io::layer_list(t) + ":", -1, r.recs});
  r.workload = {{"kind", "trace"},     {"trace", o.trace_path}, {"model", meta("model")}, {"source", meta("source")},
                {"tokens", jb.tokens}, {"blocks", n_blocks},    {"layers", layers}};
  return r;
}

/// The tables on standard output (unless --json -), the JSON record to --json.
void report(const options& o, const job& jb, const results& r) {
  std::vector<std::string> names;
  for (const auto& p : jb.chosen) names.emplace_back(p.name);
  if (o.json_path != "-") {
    fmt::print("{}", r.header);
    for (const auto& sec : r.sections) {
      fmt::print("{}", sec.title.empty() ? "\n" : "\n" + sec.title + "\n");
      print_table(sec.recs, names, jb.budgets);
    }
  }
  if (o.json_path.empty()) return;
  const auto& s = o.s;
  nlohmann::json j;
  j["settings"] = {{"block", o.block},
                   {"sinks", s.sinks},
                   {"recent", s.recent},
                   {"window", s.window},
                   {"probes", s.probes},
                   {"beta", s.beta},
                   {"ea_window", s.ea_window},
                   {"recent_share", s.recent_share},
                   {"union_share", s.union_share},
                   {"keydiff_kernel", s.keydiff_kernel}};
  j["workload"] = r.workload;
  if (!o.synthetic) {
    j["per_layer"] = nlohmann::json::array();
    for (const auto& sec : r.sections)
      if (sec.layer >= 0) j["per_layer"].push_back({{"layer", sec.layer}, {"results", to_json(sec.recs)}});
  }
  j["results"] = to_json(r.recs);
  if (o.json_path == "-")
    fmt::print("{}\n", j.dump(2));
  else
    infkv_tools::write_json("--json", o.json_path, j, 2);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "infkv-compare: KV-cache eviction policies on recorded real-model attention (default: the built-in "
      "SmolLM2 trace) or a synthetic multi-round attention stream (--synthetic)"};
  options o;
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (o.list) {
    for (const auto& p : infkv_tools::policy_catalog)
      if (compare::compared(p.k)) fmt::print("{:<19} {}\n", p.name, p.about);
    return 0;
  }
  const job jb = validate(o);
  try {
    report(o, jb, run(o, jb));
  } catch (const infkv::error& e) {
    fmt::print(stderr, "infkv-compare: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "infkv-compare: failed: {}\n", e.what());
    return 1;
  }
  return 0;
}
