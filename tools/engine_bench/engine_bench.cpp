// infkv-engine-bench: what a bounded cache costs and buys inside llama.cpp, measured on a real
// model and text.
//   decode:  single-token decode speed with the full cache after 2K..32K tokens of history,
//            against bounded caches (budget + block cells) evicted by infkv policies, with the
//            session's time split; KV bytes of each.
//   prefill: peak memory (KV bytes, process RSS) and time of one prefill of N tokens, plain
//            (a context of N cells) or budgeted block-wise (llama_cpp::prefill, budget + block
//            cells). Run each in its own process: the RSS peak is the process's.
//   placement: what llama.cpp's decode of a block costs when the cells an eviction freed (and
//            the block then fills) lie together, as StreamingLLM's ring leaves them (after its
//            sinks, or with none: runs aligned to the block), against scattered, as a scoring
//            policy's leaves them; no infkv session, the same tokens and positions, contexts
//            taking turns block by block.
// Writes a JSON record (--json) that scripts/perf_report.py turns into docs/performance.md.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "cli_util.hpp"

#include "runner.hpp"
#include "stats_json.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

using stream::load_average;
using stream::status_bytes;

struct options {
  std::string model, text, json;
  stream::settings s;
  // decode
  std::vector<std::int64_t> history{2048, 4096, 8192, 16384};
  std::int64_t gen = 32, bounded_gen = 512, warm = 2048;
  std::vector<std::string> policies{"streaming_llm", "inf_mllm_bias"};
  // prefill
  std::int64_t tokens = 4096;
  std::string mode = "budgeted", policy = "snapkv";
  // placement
  std::int64_t rounds = 30, sinks = 4;
  std::vector<std::string> flash_attn{"on", "off"};
  std::uint32_t seed = 1;
};

/// Fails naming --budget when it cannot hold what policy `k` protects.
void check_budget(const options& o, stream::kind k) {
  if (const std::string why = infkv_tools::budget_problem(k, o.s.budget, o.s); !why.empty())
    infkv_tools::fail("{}", why);
}

/// Decodes `toks` at positions pos0.. in batches of n_batch (logits for the last only).
void decode_plain(llama_context* ctx, std::span<const llama_token> toks, std::int64_t pos0, std::int64_t n_batch) {
  for (std::size_t at = 0; at < toks.size(); at += std::size_t(n_batch)) {
    const auto n = std::min<std::size_t>(std::size_t(n_batch), toks.size() - at);
    llama_batch b = llama_batch_init(std::int32_t(n), 0, 1);
    for (std::size_t i = 0; i < n; ++i) {
      b.token[i] = toks[at + i];
      b.pos[i] = llama_pos(pos0 + std::int64_t(at + i));
      b.n_seq_id[i] = 1;
      b.seq_id[i][0] = 0;
      b.logits[i] = at + i + 1 == toks.size();
    }
    b.n_tokens = std::int32_t(n);
    const std::int32_t rc = llama_decode(ctx, b);
    llama_batch_free(b);
    if (rc != 0)
      infkv_tools::engine_fail("infkv-engine-bench: llama_decode of {} tokens at {} returned {}", n,
                               pos0 + std::int64_t(at), rc);
  }
}

nlohmann::json head(const options& o, const llama_model* m, const char* what) {
  char desc[256];
  llama_model_desc(m, desc, sizeof desc);
  return {{"program", "infkv-engine-bench"},
          {"measure", what},
          {"model", o.model},
          {"model_desc", desc},
          {"text", o.text},
          {"threads", o.s.threads},
          {"budget", o.s.budget},
          {"block", o.s.block},
          {"load_average_start", load_average()},
          {"hardware_threads", std::thread::hardware_concurrency()}};
}

void write_json(const options& o, nlohmann::json j) {
  j["load_average_end"] = load_average();
  if (!o.json.empty()) infkv_tools::write_json("--json", o.json, j);
}

int run_decode(const options& o, const llama_model* m) {
  auto hist = o.history;
  std::sort(hist.begin(), hist.end());
  const std::int64_t longest = hist.back();
  std::vector<stream::kind> kinds;  // every argument checked before the first decode
  for (const auto& name : o.policies) {
    const auto e = stream::find_policy(name);
    if (!e || e->k == stream::kind::full || e->k == stream::kind::recompute)
      infkv_tools::fail("--policy = {}: not a bounded-cache policy (see infkv-stream --list-policies)", name);
    check_budget(o, e->k);
    kinds.push_back(e->k);
  }
  stream::check_cells(m, "--history", longest, "the full cache", double(longest + o.gen));
  stream::check_cells(m, "--budget", o.s.budget, "a bounded cache", double(o.s.budget + o.s.block));
  const std::int64_t need_full = longest + o.gen, need_bounded = o.warm + o.bounded_gen;
  const auto toks = stream::tokenize_file(m, o.text, std::max(need_full, need_bounded));
  if (std::int64_t(toks.size()) < std::max(need_full, need_bounded))
    infkv_tools::fail("{}: --text = {} has {} tokens, fewer than the {} this run decodes",
                      need_full >= need_bounded
                          ? fmt::format("--history = {} (+ --gen {})", longest, o.gen)
                          : fmt::format("--warm = {} (+ --bounded-gen {})", o.warm, o.bounded_gen),
                      o.text, toks.size(), std::max(need_full, need_bounded));
  const stream::model_shape sh(m);
  auto j = head(o, m, "decode");
  j["gen"] = o.gen, j["bounded_gen"] = o.bounded_gen, j["warm"] = o.warm;

  // The full cache: one context grown by prefill from checkpoint to checkpoint; at each, `gen`
  // single-token decodes (the text's next tokens), timed, then removed again.
  nlohmann::json full = nlohmann::json::array();
  {
    constexpr std::int64_t n_batch = 512;
    auto p = stream::context_params(std::uint32_t(longest + o.gen), n_batch, o.s.threads);
    stream::context_ptr ctx(llama_init_from_model(const_cast<llama_model*>(m), p));
    if (!ctx) infkv_tools::engine_fail("infkv-engine-bench: cannot create a context of {} cells", longest + o.gen);
    llama_memory_t mem = llama_get_memory(ctx.get());
    std::int64_t at = 0;
    for (const std::int64_t n : hist) {
      const auto t0 = clock_type::now();
      decode_plain(ctx.get(), std::span(toks).subspan(std::size_t(at), std::size_t(n - at)), at, n_batch);
      const double prefill_s = since(t0);
      const std::int64_t prefilled = n - at;
      at = n;
      const auto t1 = clock_type::now();
      for (std::int64_t i = 0; i < o.gen; ++i)
        decode_plain(ctx.get(), std::span(toks).subspan(std::size_t(n + i), 1), n + i, 1);
      const double secs = since(t1);
      if (!llama_memory_seq_rm(mem, 0, llama_pos(n), -1))
        infkv_tools::engine_fail("infkv-engine-bench: llama_memory_seq_rm failed");
      full.push_back({{"history", n},
                      {"tok_per_s", double(o.gen) / secs},
                      {"seconds", secs},
                      {"prefill_seconds", prefill_s},
                      {"kv_bytes", sh.kv_bytes(n + o.gen)}});
      fmt::print(stderr, "full cache, history {:6}: {:7.1f} tok/s (prefill of {} tokens {:.1f} s)\n", n,
                 double(o.gen) / secs, prefilled, prefill_s);
    }
  }
  j["full"] = full;

  // Bounded: a runner per policy streams `warm` tokens in blocks, then decodes `bounded_gen`
  // single tokens, evicting whenever the cache is full.
  nlohmann::json bounded = nlohmann::json::array();
  for (std::size_t pi = 0; pi < kinds.size(); ++pi) {
    const std::string& name = o.policies[pi];
    auto r = stream::make_runner(m, kinds[pi], o.s, 0, o.s.block);
    for (std::int64_t at = 0; at < o.warm; at += o.s.block) {
      r->feed(std::span(toks).subspan(std::size_t(at), std::size_t(std::min(o.s.block, o.warm - at))));
      r->evict();
    }
    r->evicts_above(o.s.budget + o.s.block - 1);  // the rule of the loop below
    const auto before = r->stats();
    const auto t0 = clock_type::now();
    for (std::int64_t i = 0; i < o.bounded_gen; ++i) {
      if (r->slots() + 1 > o.s.budget + o.s.block) r->evict();
      r->feed(std::span(toks).subspan(std::size_t(o.warm + i), 1), true);
    }
    const double secs = since(t0);
    auto t = r->stats();
    for (auto [a, b] : {std::pair{&t.decode, before.decode},
                        {&t.capture, before.capture},
                        {&t.append, before.append},
                        {&t.h2o, before.h2o},
                        {&t.score, before.score},
                        {&t.seq_rm, before.seq_rm},
                        {&t.seq_add, before.seq_add},
                        {&t.host_evict, before.host_evict},
                        {&t.rerotate, before.rerotate}})
      *a -= b;
    t.decodes -= before.decodes, t.decoded_tokens -= before.decoded_tokens, t.evictions -= before.evictions;
    t.observed -= before.observed;
    bounded.push_back({{"policy", name},
                       {"tok_per_s", double(o.bounded_gen) / secs},
                       {"seconds", secs},
                       {"evictions", t.evictions},
                       {"kv_bytes", r->kv_alloc_bytes()},
                       {"host_bytes", r->host_bytes()},
                       {"time", stream::to_json(t)}});
    fmt::print(stderr, "bounded {:<16}: {:7.1f} tok/s over {} tokens, {} evictions, decode {:.2f} s of {:.2f} s\n",
               name, double(o.bounded_gen) / secs, o.bounded_gen, t.evictions, t.decode, secs);
  }
  j["bounded"] = bounded;
  fmt::print("{:<24} {:>9} {:>10}\n", "cache", "tok/s", "KV MiB");
  for (const auto& f : full)
    fmt::print("{:<24} {:9.1f} {:10.1f}\n", fmt::format("full, {} history", f["history"].get<std::int64_t>()),
               f["tok_per_s"].get<double>(), f["kv_bytes"].get<double>() / 1048576.0);
  for (const auto& b : bounded)
    fmt::print("{:<24} {:9.1f} {:10.1f}\n",
               fmt::format("{} {}+{}", b["policy"].get<std::string>(), o.s.budget, o.s.block),
               b["tok_per_s"].get<double>(), b["kv_bytes"].get<double>() / 1048576.0);
  write_json(o, j);
  return 0;
}

int run_prefill(const options& o, const llama_model* m) {
  const auto e = stream::find_policy(o.policy);
  if (o.mode == "plain") {
    stream::check_cells(m, "--tokens", o.tokens, "plain prefill", double(o.tokens));
  } else {
    if (!e || !stream::policy_budget(e->k, o.s))
      infkv_tools::fail("--policy = {}: budgeted prefill takes a scoring policy (see infkv-stream --list-policies)",
                        o.policy);
    check_budget(o, e->k);
    stream::check_cells(m, "--budget", o.s.budget, "a bounded cache", double(o.s.budget + o.s.block));
  }
  const auto toks = stream::tokenize_file(m, o.text, o.tokens);
  if (std::int64_t(toks.size()) < o.tokens)
    infkv_tools::fail("--tokens = {}: --text = {} has {} tokens", o.tokens, o.text, toks.size());
  const stream::model_shape sh(m);
  const std::int64_t rss_model = status_bytes("VmRSS");
  auto j = head(o, m, "prefill");
  j["tokens"] = o.tokens, j["mode"] = o.mode, j["rss_after_model_bytes"] = rss_model;
  std::int64_t cells = 0, peak_slots = 0, state = 0, session_bytes = 0;
  double secs = 0;
  if (o.mode == "plain") {
    constexpr std::int64_t n_batch = 512;
    auto p = stream::context_params(std::uint32_t(o.tokens), n_batch, o.s.threads);
    stream::context_ptr ctx(llama_init_from_model(const_cast<llama_model*>(m), p));
    if (!ctx) infkv_tools::engine_fail("infkv-engine-bench: cannot create a context of {} cells", o.tokens);
    const auto t0 = clock_type::now();
    decode_plain(ctx.get(), toks, 0, n_batch);
    secs = since(t0);
    cells = llama_n_ctx(ctx.get()), peak_slots = o.tokens;
    state = std::int64_t(llama_state_seq_get_size(ctx.get(), 0));
  } else {
    const auto b = stream::policy_budget(e->k, o.s);
    j["policy"] = o.policy;
    infkv::llama_cpp::session session(m, stream::session_options_for(e->k, o.s));
    const infkv::block_prefill schedule{.block = o.s.block, .budget = o.s.budget};
    auto p = stream::context_params(std::uint32_t(schedule.peak()),
                                    std::uint32_t(std::max<std::int64_t>(o.s.block, 512)), o.s.threads);
    session.attach(p);
    stream::context_ptr ctx(llama_init_from_model(const_cast<llama_model*>(m), p));
    if (!ctx) infkv_tools::engine_fail("infkv-engine-bench: cannot create a context of {} cells", schedule.peak());
    session.bind(ctx.get());
    const infkv::llama_cpp::chunk c = infkv::llama_cpp::text_chunk(toks);
    const infkv::llama_cpp::prefill_options po{.sinks = b->sinks, .recent = b->recent};
    const auto t0 = clock_type::now();
    const auto res = infkv_tools::with_policy(e->k, o.s, [&](const auto& pol) {
      return infkv::llama_cpp::prefill(session, std::span(&c, 1), pol, schedule, po);
    });
    secs = since(t0);
    if (!res.ok())
      infkv_tools::engine_fail("infkv-engine-bench: prefill stopped at block {}: llama_decode returned {}",
                               res.failed_block, res.status);
    cells = llama_n_ctx(ctx.get()), peak_slots = res.peak;
    state = std::int64_t(llama_state_seq_get_size(ctx.get(), 0));
    j["time"] = stream::to_json(session.stats());
    const auto mem = session.memory();
    session_bytes = mem.total();
    j["session_bytes"] = {
        {"keys", mem.keys},     {"values", mem.values},       {"queries", mem.queries},
        {"h2o", mem.h2o},       {"workspace", mem.workspace}, {"tokens", mem.tokens},
        {"total", mem.total()}, {"llama_kv", mem.kv},         {"key_type", to_string(session.key_type())}};
    j["host_bytes"] = mem.total();
  }
  j["seconds"] = secs, j["tok_per_s"] = double(o.tokens) / secs;
  j["kv_alloc_bytes"] = sh.kv_bytes(cells), j["n_ctx"] = cells, j["peak_slots"] = peak_slots;
  j["kv_state_bytes"] = state, j["peak_rss_bytes"] = status_bytes("VmHWM");
  fmt::print(
      "prefill {} tokens, {}{}: {:.1f} s ({:.0f} tok/s), {} cells, KV {:.1f} MiB, infkv session {:.1f} MiB, peak RSS "
      "{:.1f} MiB (model loaded: {:.1f} MiB)\n",
      o.tokens, o.mode, o.mode == "plain" ? "" : " (" + o.policy + ")", secs, double(o.tokens) / secs, cells,
      double(sh.kv_bytes(cells)) / 1048576.0, double(session_bytes) / 1048576.0,
      double(status_bytes("VmHWM")) / 1048576.0, double(rss_model) / 1048576.0);
  write_json(o, j);
  return 0;
}

/// Number of runs of consecutive cells in `cells` (1: the block went into one contiguous range).
std::int64_t cell_runs(std::vector<std::int64_t> cells) {
  std::sort(cells.begin(), cells.end());
  std::int64_t runs = cells.empty() ? 0 : 1;
  for (std::size_t i = 1; i < cells.size(); ++i) runs += cells[i] != cells[i - 1] + 1;
  return runs;
}

/// One context of the placement run: a cache of budget + block cells, evicting `block` tokens
/// before each block, the oldest after `sinks` (contiguous; with no sinks the runs are aligned to
/// the block) or drawn uniformly from those between the sinks and the newest block (scattered).
/// Positions are kept (no shift), so the contexts differ only in where the freed cells lie.
struct placement_arm {
  bool scattered, flash;
  std::int64_t sinks;
  std::mt19937 rng;
  infkv::llama_cpp::graph_observer cells;  // asks for no node: records the cells the K rows go to
  stream::context_ptr ctx;
  std::vector<llama_pos> live;  // the cached positions, ascending
  std::vector<double> seconds;
  std::vector<std::int64_t> runs;
  placement_arm(const llama_model* m, const options& o, bool scattered_, bool flash_, std::int64_t sinks_,
                std::uint32_t seed)
      : scattered(scattered_), flash(flash_), sinks(sinks_), rng(seed), cells(llama_model_n_layer(m)) {
    auto p = stream::context_params(std::uint32_t(o.s.budget + o.s.block), std::uint32_t(o.s.block), o.s.threads);
    p.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cells.install(p);
    ctx.reset(llama_init_from_model(const_cast<llama_model*>(m), p));
    if (!ctx)
      infkv_tools::engine_fail("infkv-engine-bench: cannot create a context of {} cells", o.s.budget + o.s.block);
  }
  /// Decodes `toks` at the positions after the newest; returns llama_decode's seconds.
  double feed(std::span<const llama_token> toks) {
    const llama_pos at = live.empty() ? 0 : live.back() + 1;
    cells.begin({.queries = false, .keys = false, .values = false, .cells = true});
    const auto t0 = clock_type::now();
    decode_plain(ctx.get(), toks, at, std::int64_t(toks.size()));
    const double s = since(t0);
    cells.end();
    if (!cells.error().empty()) infkv_tools::engine_fail("infkv-engine-bench: {}", cells.error());
    for (std::size_t i = 0; i < toks.size(); ++i) live.push_back(at + llama_pos(i));
    return s;
  }
  const char* freed() const { return scattered ? "scattered" : sinks > 0 ? "contiguous" : "aligned"; }
  void evict(std::int64_t n) {
    std::vector<std::size_t> pick(static_cast<std::size_t>(n));
    if (!scattered) {
      std::iota(pick.begin(), pick.end(), std::size_t(sinks));
    } else {  // n of the slots [sinks, size - n), uniformly
      std::vector<std::size_t> from(live.size() - std::size_t(n) - std::size_t(sinks));
      std::iota(from.begin(), from.end(), std::size_t(sinks));
      std::sample(from.begin(), from.end(), pick.begin(), n, rng);
    }
    llama_memory_t mem = llama_get_memory(ctx.get());
    for (const std::size_t i : pick)
      if (!llama_memory_seq_rm(mem, 0, live[i], live[i] + 1))
        infkv_tools::engine_fail("infkv-engine-bench: llama_memory_seq_rm of position {} failed", live[i]);
    std::vector<bool> gone(live.size());
    for (const std::size_t i : pick) gone[i] = true;
    std::size_t w = 0;
    for (std::size_t i = 0; i < live.size(); ++i)
      if (!gone[i]) live[w++] = live[i];
    live.resize(w);
  }
};

int run_placement(const options& o, const llama_model* m) {
  if (o.s.budget < o.sinks + o.s.block)
    infkv_tools::fail(
        "--budget = {}: the scattered eviction draws --block = {} tokens from those between the {} "
        "sinks and the newest block, so it needs at least {}",
        o.s.budget, o.s.block, o.sinks, o.sinks + o.s.block);
  stream::check_cells(m, "--budget", o.s.budget, "a bounded cache",
                      double(o.s.budget + o.s.block) * 3.0 * double(o.flash_attn.size()));
  const std::int64_t fill = o.s.budget + o.s.block, need = fill + o.rounds * o.s.block;
  const auto toks = stream::tokenize_file(m, o.text, need);
  if (std::int64_t(toks.size()) < need)
    infkv_tools::fail("--rounds = {}: --text = {} has {} tokens, fewer than the {} a context decodes", o.rounds, o.text,
                      toks.size(), need);
  std::vector<std::unique_ptr<placement_arm>> arms;  // per flash attention setting: contiguous, aligned, scattered
  for (const auto& fa : o.flash_attn)
    for (const auto& [scattered, sinks] : {std::pair{false, o.sinks}, {false, std::int64_t(0)}, {true, o.sinks}})
      arms.push_back(std::make_unique<placement_arm>(m, o, scattered, fa == "on", sinks, o.seed));
  for (auto& a : arms)  // the cache filled: budget + block cells, in blocks
    for (std::int64_t at = 0; at < fill; at += o.s.block)
      a->feed(std::span(toks).subspan(std::size_t(at), std::size_t(std::min(o.s.block, fill - at))));
  for (std::int64_t r = 0; r < o.rounds; ++r)
    for (std::size_t i = 0; i < arms.size(); ++i) {  // the order turned every round
      auto& a = *arms[(i + std::size_t(r)) % arms.size()];
      a.evict(o.s.block);
      a.seconds.push_back(a.feed(std::span(toks).subspan(std::size_t(fill + r * o.s.block), std::size_t(o.s.block))));
      a.runs.push_back(cell_runs(a.cells.layers().front().cells));
    }
  auto j = head(o, m, "placement");
  j["rounds"] = o.rounds, j["sinks"] = o.sinks, j["seed"] = o.seed;
  nlohmann::json out = nlohmann::json::array();
  fmt::print("{:<12} {:<11} {:>12} {:>14} {:>24}\n", "flash attn", "freed cells", "median s", "cell runs",
             "against contiguous");
  for (std::size_t i = 0; i < arms.size(); i += 3)
    for (std::size_t k = i; k < i + 3; ++k) {
      const auto& a = *arms[k];
      std::vector<double> s = a.seconds, ratio;
      for (std::int64_t r = 0; r < o.rounds; ++r)
        ratio.push_back(a.seconds[std::size_t(r)] / arms[i]->seconds[std::size_t(r)]);
      std::sort(s.begin(), s.end());
      std::sort(ratio.begin(), ratio.end());
      const auto [lo, hi] = std::minmax_element(a.runs.begin(), a.runs.end());
      fmt::print("{:<12} {:<11} {:12.4f} {:>14} {:>24}\n", a.flash ? "on" : "off", a.freed(), s[s.size() / 2],
                 fmt::format("{}-{}", *lo, *hi),
                 k == i ? "" : fmt::format("{:.4f} (median ratio)", ratio[ratio.size() / 2]));
      out.push_back({{"flash_attn", a.flash},
                     {"freed", a.freed()},
                     {"sinks", a.sinks},
                     {"seconds", a.seconds},
                     {"cell_runs", a.runs}});
    }
  j["arms"] = out;
  write_json(o, j);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"infkv-engine-bench: decode speed and prefill memory of a llama.cpp model with full and bounded caches"};
  app.name("infkv-engine-bench");
  app.option_defaults()->always_capture_default();
  app.require_subcommand(1);
  options o;
  o.s.threads = int(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  using infkv_tools::at_least;
  const auto common = [&](CLI::App* c) {
    c->add_option("--model", o.model, "GGUF model file (scripts/model.sh prints one)")
        ->required()
        ->check(CLI::ExistingFile);
    c->add_option("--text", o.text, "text whose tokens are decoded (scripts/kjv.sh prints one)")
        ->required()
        ->check(CLI::ExistingFile);
    c->add_option("--budget", o.s.budget, "slots a bounded cache keeps after each eviction")->check(at_least(1));
    c->add_option("--block", o.s.block, "tokens between evictions")->check(at_least(1));
    c->add_option("--threads", o.s.threads, "llama.cpp and scoring threads")->check(at_least(1, true, 1024));
    c->add_option("--json", o.json, "write the results as JSON to FILE")->check(infkv_tools::writable_file());
  };
  auto* dec =
      app.add_subcommand("decode", "single-token decode speed: full cache after each --history, bounded caches");
  common(dec);
  dec->add_option("--history", o.history, "history lengths of the full-cache points")
      ->delimiter(',')
      ->check(at_least(1));
  dec->add_option("--gen", o.gen, "single-token decodes timed at each full-cache point")->check(at_least(1));
  dec->add_option("--bounded-gen", o.bounded_gen, "single-token decodes timed per bounded policy")->check(at_least(1));
  dec->add_option("--warm", o.warm, "tokens streamed through a bounded cache before timing")->check(at_least(0));
  dec->add_option("--policy", o.policies, "bounded-cache policies (comma list)")->delimiter(',');
  auto* pre = app.add_subcommand("prefill", "one prefill: time, KV bytes and peak RSS (one per process)");
  common(pre);
  pre->add_option("--tokens", o.tokens, "input tokens")->check(at_least(1));
  pre->add_option("--mode", o.mode, "plain (a context of --tokens cells) or budgeted (llama_cpp::prefill)")
      ->check(CLI::IsMember({"plain", "budgeted"}));
  pre->add_option("--policy", o.policy, "the budgeted prefill's policy");
  auto* pla = app.add_subcommand(
      "placement", "a block's decode into freed cells lying together against scattered ones (no infkv session)");
  common(pla);
  pla->add_option("--rounds", o.rounds, "blocks each context decodes after filling its cache")->check(at_least(1));
  pla->add_option("--flash-attn", o.flash_attn, "flash attention settings to run (comma list of on, off)")
      ->delimiter(',')
      ->check(CLI::IsMember({"on", "off"}));
  pla->add_option("--seed", o.seed, "seed of the scattered eviction's draws");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto model = stream::load_model(o.model);
    if (pla->parsed()) return run_placement(o, model.get());
    return dec->parsed() ? run_decode(o, model.get()) : run_prefill(o, model.get());
  } catch (const std::exception& e) {
    std::cerr << "infkv-engine-bench: error: " << e.what() << '\n';
    return 1;
  }
}
