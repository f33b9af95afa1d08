// infkv-stream: streams a real text (or a retrieval prompt: a passkey in repeated filler, a needle
// in real prose) through a llama.cpp model whose KV
// cache is bounded: n_ctx = budget + block cells, evicted back to the budget with an infkv policy
// after every block. Reports per-block perplexity, memory and speed, a summary per policy, and
// optionally CSV, JSON and a PNG plot. See --help.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <infkv/version.hpp>

#include "cli_util.hpp"
#include "policy_options.hpp"

#include "report.hpp"

namespace {

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "infkv-stream: error: " << msg << '\n';
  std::exit(2);
}

using stream::load_average;

using infkv_tools::at_least;

struct options {
  std::string model, text, json, csv, plot;
  std::string export_questions;  ///< --export-questions
  std::vector<std::string> policy_names;
  stream::settings s;
  std::int64_t tokens = 0, skip = 0, trials = 10, gen = 8, smooth = 8, progress = 10, needles = 1, needle_gap = 1024,
               people = 1;
  std::vector<std::int64_t> passkey, needle;  ///< retrieval distances
  std::vector<std::string> needle_kinds;
  bool retrieval() const { return !passkey.empty() || !needle.empty(); }
  std::string mode() const { return !passkey.empty() ? "--passkey" : "--needle"; }
  std::uint64_t seed = 1;
  std::string key_type;               ///< --key-type (empty: the cache's own)
  std::string cache_type = "f16";     ///< --cache-type
  std::string keys = "auto";          ///< --keys
  std::string proxy = "after_cache";  ///< --proxy
  bool list = false;
  bool interleave = false;  ///< --interleave
};

void add_options(CLI::App& app, options& o) {
  const auto pos = at_least(1), nonneg = at_least(0);
  app.add_option("--model", o.model, "GGUF model file (e.g. the path scripts/model.sh prints)")
      ->check(CLI::ExistingFile);
  app.add_option("--text", o.text, "text file to stream (e.g. the path scripts/kjv.sh prints)")
      ->check(CLI::ExistingFile);
  app.add_option("--policy", o.policy_names,
                 "policies to run in turn, each on a fresh context (repeatable or comma "
                 "list; default streaming_llm; see --list-policies)")
      ->delimiter(',');
  stream::add_policy_options(app, o.s);
  app.add_option("--block", o.s.block, "tokens decoded between two evictions")->check(pos);
  app.add_flag("--interleave", o.interleave,
               "perplexity runs: the policies take turns block by block (each on its own context, the order turned "
               "every block) instead of one after another, so that a drifting machine or the order within the "
               "process weighs on all of them alike (for timing comparisons)");
  app.add_option("--tokens", o.tokens, "stop after this many tokens of text (0: the whole text)")->check(nonneg);
  app.add_option("--skip", o.skip,
                 "start the stream after this many tokens of the text (e.g. to compare a slice "
                 "with the recompute oracle); CSV token counts include them")
      ->check(nonneg);
  app.add_option("--smooth", o.smooth, "blocks in the moving average of window_ppl (CSV, plot)")->check(pos);
  app.add_option("--progress", o.progress, "a progress line on stderr every N blocks (0: none)")->check(nonneg);
  app.add_option("--json", o.json, "write the per-block (or per-trial) records as JSON to FILE")
      ->check(infkv_tools::writable_file());
  app.add_option("--csv", o.csv, "write the per-block (or per-trial) records as CSV to FILE")
      ->check(infkv_tools::writable_file());
  app.add_option("--export-questions", o.export_questions,
                 "retrieval: write every question's prompt (the stream up to it), question and candidate answers as "
                 "token ids, JSON, to FILE and exit without running a policy (for other engines on the same prompts)")
      ->check(infkv_tools::writable_file());
  app.add_option("--plot", o.plot, "plot windowed perplexity vs tokens, one line per policy, to FILE.png (gnuplot)")
      ->check(infkv_tools::writable_file());
  app.add_option("--key-type", o.key_type, "type of the session's host key copies (default: the cache's own, f16)")
      ->check(CLI::IsMember({"f32", "f16"}));
  app.add_option("--cache-type", o.cache_type,
                 "llama.cpp's K and V cache type: f16, or q8_0 / q4_0 (quantized, attended with flash attention; "
                 "for the full cache at equal bytes, or beside an evicting policy, whose key copies are then f16)")
      ->check(CLI::IsMember({"f16", "q8_0", "q4_0"}));
  app.add_option("--keys", o.keys,
                 "where the policies read the keys: auto (llama.cpp's cache where the session can read it), "
                 "copy (host copies taken at every decode), engine (llama.cpp's cache or an error)")
      ->check(CLI::IsMember({"auto", "copy", "engine"}));
  app.add_flag("--gather-cells", o.s.gather_cells,
               "after each eviction move the cached cells together (through sequence 1), so that the next block "
               "goes into one run of llama.cpp's cells (policies reading llama.cpp's cache)");
  app.add_flag("--list-policies", o.list, "list the policies and exit");
  app.add_option("--passkey", o.passkey,
                 "passkey retrieval instead of perplexity: the question DISTANCE tokens of "
                 "filler after the key (comma list: asked at each)")
      ->delimiter(',')
      ->check(pos);
  app.add_option("--needle", o.needle,
                 "needle retrieval in real text: needle statements planted into the --text "
                 "prose, the question DISTANCE tokens after each (comma list: asked at each)")
      ->delimiter(',')
      ->check(pos)
      ->excludes("--passkey");
  std::vector<std::string> kind_names;
  for (const auto& k : stream::needle_kinds) kind_names.emplace_back(k.name);
  app.add_option("--needle-kind", o.needle_kinds,
                 fmt::format("needle kinds the keys cycle through ({}; default: the first "
                             "three, or the first --needles)",
                             fmt::join(kind_names, ", ")))
      ->delimiter(',')
      ->check(CLI::IsMember(kind_names));
  app.add_option("--needles", o.needles,
                 "needles planted in one stream, each about its own person (--people of each kind; at most "
                 "--people times the kinds given)")
      ->check(at_least(1, true, 12));
  app.add_option("--people", o.people,
                 "needles of one kind in a stream, about different people with different values, so that an answer "
                 "must bind the value to its person")
      ->check(at_least(1, true, stream::max_people_per_kind()));
  app.add_option("--needle-gap", o.needle_gap, "tokens of prose between two needles of a stream")->check(pos);
  app.add_option("--trials", o.trials, "retrieval keys per policy, each asked at every distance (seeded)")->check(pos);
  app.add_option("--gen", o.gen, "retrieval answer tokens decoded greedily")->check(at_least(1, true, 256));
  app.add_option("--seed", o.seed, "retrieval seed");
  app.add_flag("--question-known", o.s.question_known,
               "single turn: every question gets a prompt of its own (the stream up to it), prefilled in blocks with "
               "each eviction scoring against the question's queries (policies that read window queries; the full "
               "cache answers as in the stream)");
  app.add_flag("--whole-segments", o.s.whole_segments,
               "keep whole sentences and lines of the text first (by their mean score), the rest of the budget "
               "token by token (evicting policies)");
  app.add_option("--reconstruct", o.s.reconstruct,
                 "score every eviction by context reconstruction (KVzip, query-agnostic): the cached tokens are "
                 "repeated on a second sequence, this many per pass, and each keeps the largest attention any "
                 "repeating query gives it; the policy named gives only its protected tokens (sinks, recent). With "
                 "--question-known each question's prompt is prefilled on its own, the question unused (KVzip is "
                 "query-agnostic): with a --block as long as the prompts, one eviction after the prompt, as kvpress's "
                 "KVzipPress compresses")
      ->check(at_least(1, true, 8192));
  app.add_option("--proxy", o.proxy,
                 "how --question-known computes the question's queries: after_cache (decoded after the cache at "
                 "every eviction) or alone (decoded once by itself, turned to the positions after the cache)")
      ->check(CLI::IsMember({"after_cache", "alone"}));
}

/// Checks what CLI11 cannot: the combination of flags. Exits with status 2 naming the flag.
std::vector<stream::policy_info> check(const options& o) {
  if (o.model.empty()) usage_error("--model is required");
  const bool retrieval = o.retrieval();
  const std::string mode = o.mode();
  if (o.passkey.empty() && o.text.empty()) usage_error("--text is required (or --passkey DISTANCE)");
  if (o.skip > 0 && retrieval)
    usage_error("--skip = " + std::to_string(o.skip) + ": only for the text stream, not " + mode);
  if (o.tokens > 0 && retrieval)
    usage_error("--tokens = " + std::to_string(o.tokens) + ": only for the text stream, not " + mode);
  if (!o.export_questions.empty() && !retrieval)
    usage_error("--export-questions = " + o.export_questions + ": only with --needle or --passkey");
  if (!o.plot.empty() && retrieval) usage_error("--plot = " + o.plot + ": plots are for the text stream, not " + mode);
  if (!o.needle_kinds.empty() && o.needle.empty()) usage_error("--needle-kind: only with --needle DISTANCE");
  if (o.needles > 1 && o.needle.empty())
    usage_error(fmt::format("--needles = {}: only with --needle DISTANCE", o.needles));
  if (o.people > 1 && o.needle.empty())
    usage_error(fmt::format("--people = {}: only with --needle DISTANCE", o.people));
  if (const std::string why = infkv_tools::knobs_problem(o.s); !why.empty()) usage_error(why);
  if (std::set<std::string>(o.needle_kinds.begin(), o.needle_kinds.end()).size() != o.needle_kinds.size())
    usage_error(fmt::format("--needle-kind = {}: a kind is listed twice", fmt::join(o.needle_kinds, ",")));
  for (const auto& [flag, list] : {std::pair{"--passkey", &o.passkey}, {"--needle", &o.needle}})
    if (std::set<std::int64_t>(list->begin(), list->end()).size() != list->size())
      usage_error(fmt::format("{} = {}: a distance is listed twice", flag, fmt::join(*list, ",")));
  std::vector<stream::policy_info> chosen;
  std::set<std::string> seen;
  for (const auto& n : o.policy_names.empty() ? std::vector<std::string>{"streaming_llm"} : o.policy_names) {
    const auto p = stream::find_policy(n);
    if (!p) usage_error("--policy = " + n + ": unknown policy (see --list-policies)");
    if (seen.insert(n).second) chosen.push_back(*p);
  }
  for (const auto& p : chosen)
    if (const std::string why = infkv_tools::budget_problem(p.k, o.s.budget, o.s); !why.empty()) usage_error(why);
  if (o.s.recall_tokens > 0 && o.s.archive_bits == 0)
    usage_error(fmt::format("--recall = {}: needs --archive BITS", o.s.recall_tokens));
  if (o.s.prefetch_tokens > 0 && o.s.archive_bits == 0)
    usage_error(fmt::format("--prefetch = {}: needs --archive BITS", o.s.prefetch_tokens));
  if (o.s.question_known && !retrieval) usage_error("--question-known: only with --needle or --passkey DISTANCE");
  if (o.s.reconstruct > 0) {
    if (o.s.archive_bits > 0)
      usage_error(fmt::format("--reconstruct = {}: recalled slots have no token ids to repeat; not with --archive",
                              o.s.reconstruct));
    for (const auto& p : chosen)
      if (p.k != stream::kind::full &&
          (infkv_tools::engine_only(p.k) ||
           infkv_tools::with_policy(p.k, o.s, [](const auto& x) { return x.spec().parts() > 1; })))
        usage_error(
            fmt::format("--policy = {}: --reconstruct scores an infkv session's cache by one score; {} "
                        "cannot take it",
                        p.name, p.name));
  }
  for (const auto& p : chosen) {
    if (!o.s.question_known || o.s.reconstruct > 0) break;  // reconstruction ignores the question
    if (p.k == stream::kind::full) continue;
    const bool steers = !infkv_tools::engine_only(p.k) && infkv_tools::with_policy(p.k, o.s, [](const auto& x) {
      const auto sp = x.spec();
      return sp.reads_queries() && !sp.accumulates();
    });
    if (!steers)
      usage_error(
          fmt::format("--policy = {}: --question-known steers policies that read window queries; {} reads "
                      "none (its single-turn answers are its streaming ones: run it without the flag)",
                      p.name, p.name));
  }
  for (const auto& p : chosen)
    if (o.s.whole_segments && p.k != stream::kind::full && !infkv_tools::engine_only(p.k) &&
        infkv_tools::with_policy(p.k, o.s, [](const auto& x) { return x.spec().parts() > 1; }))
      usage_error(fmt::format("--policy = {}: --whole-segments selects by one score; {} unites two", p.name, p.name));
  if (o.s.recall_tokens > 0 && !retrieval)
    usage_error(fmt::format("--recall = {}: recall runs before questions (--needle or --passkey)", o.s.recall_tokens));
  for (const auto& p : chosen) {
    if (o.s.archive_bits == 0) break;
    const bool session = p.k != stream::kind::full && !infkv_tools::engine_only(p.k);
    const bool reads = session && infkv_tools::with_policy(p.k, o.s, [](const auto& x) {
                         const auto sp = x.spec();
                         for (std::int32_t i = 0; i < sp.parts(); ++i)
                           if (!sp.part(i).reads_queries()) return false;
                         return true;
                       });
    if (!session || ((o.s.recall_tokens > 0 || o.s.prefetch_tokens > 0) && !reads))
      usage_error(fmt::format(
          "--policy = {}: {} (--archive / --recall / --prefetch)", p.name,
          session ? "recall scores with the policy, and it reads no queries" : "has no session to archive from"));
  }
  return chosen;
}

/// Fails naming --budget (or --tokens, for the full cache) before anything is allocated when the
/// largest cache a run needs cannot fit in the memory available now: llama.cpp's K/V (in the cache
/// type) plus the session's f16 key copies, per cell, times the cells.
void check_memory(const options& o, const std::vector<stream::policy_info>& chosen, const llama_model* m) {
  const stream::model_shape sh(m);
  for (const auto& p : chosen) {
    const bool full = p.k == stream::kind::full;
    const double cells = full ? double(o.tokens > 0 ? std::min<std::int64_t>(o.tokens, sh.n_ctx_train) : sh.n_ctx_train)
                              : double(o.s.budget) + double(o.s.block);
    stream::check_cells(m, full ? "--tokens" : "--budget", full ? o.tokens : o.s.budget, p.name, cells, o.s.cache_type);
  }
}

std::string version_line() { return fmt::format("infkv-stream {} (llama.cpp {})", infkv::version, llama_version()); }

nlohmann::json head(const options& o, const llama_model* m, double load) {
  const stream::model_shape sh(m);
  char desc[256];
  llama_model_desc(m, desc, sizeof desc);
  return {{"program", "infkv-stream"},
          {"version", version_line()},
          {"model", o.model},
          {"model_desc", desc},
          {"model_shape",
           {{"layers", sh.layers},
            {"heads", sh.heads},
            {"kv_heads", sh.kv_heads},
            {"head_dim", sh.head_dim},
            {"vocab", sh.vocab},
            {"n_ctx_train", sh.n_ctx_train}}},
          {"text", o.text},
          {"settings",
           {{"budget", o.s.budget},
            {"block", o.s.block},
            {"sinks", o.s.sinks},
            {"recent", o.s.recent},
            {"window", o.s.window},
            {"beta", o.s.beta},
            {"ea_window", o.s.ea_window},
            {"recent_share", o.s.recent_share},
            {"union_share", o.s.union_share},
            {"keydiff_kernel", o.s.keydiff_kernel},
            {"reduce", infkv::to_string(o.s.reduce)},
            {"threads", o.s.threads},
            {"keep_positions", o.s.keep_positions},
            {"position_gap", o.s.position_gap},
            {"position_span", o.s.position_span},
            {"archive_bits", o.s.archive_bits},
            {"archive_mib", o.s.archive_mib},
            {"archive_page", o.s.archive_page},
            {"recall_tokens", o.s.recall_tokens},
            {"recall_candidates", o.s.recall_candidates},
            {"recall_neighbours", o.s.recall_neighbours},
            {"recall_distance", o.s.recall_distance},
            {"prefetch_tokens", o.s.prefetch_tokens},
            {"recall_bias", o.s.recall_bias},
            {"key_type", o.key_type.empty() ? "cache" : o.key_type},
            {"cache_type", o.cache_type},
            {"keys", o.keys},
            {"gather_cells", o.s.gather_cells},
            {"interleave", o.interleave},
            {"question_known", o.s.question_known},
            {"whole_segments", o.s.whole_segments},
            {"reconstruct", o.s.reconstruct},
            {"score_layers", o.s.score_global_layers ? "global" : "all"},
            {"proxy", o.proxy},
            {"smooth", o.smooth}}},
          {"load_average_start", stream::num(load)}};
}

int run_text(const options& o, const std::vector<stream::policy_info>& chosen, const llama_model* m) {
  const double load0 = load_average();
  auto toks = stream::tokenize_file(m, o.text, o.tokens > 0 ? o.skip + o.tokens : 0);
  if (o.tokens > 0 && std::int64_t(toks.size()) < o.skip + o.tokens)
    usage_error("--tokens = " + std::to_string(o.tokens) + ": the text has " + std::to_string(toks.size()) + " tokens" +
                (o.skip > 0 ? " (--skip = " + std::to_string(o.skip) + ")" : std::string()) +
                "; --tokens 0 streams the whole text");
  if (std::int64_t(toks.size()) < o.skip + 2)
    usage_error("--skip = " + std::to_string(o.skip) + ": the text has " + std::to_string(toks.size()) +
                " tokens, fewer than 2 remain");
  toks.erase(toks.begin(), toks.begin() + o.skip);
  fmt::print(stderr,
             "infkv-stream: {} tokens of {} after {} skipped; budget {}, block {}, {} threads; load average {:.2f}\n",
             toks.size(), o.text, o.skip, o.s.budget, o.s.block, o.s.threads, load0);
  const stream::model_shape sh(m);
  // One runner and stepper per policy: one after another, or all at once taking turns (--interleave).
  struct one {
    std::string name, note;
    std::unique_ptr<stream::runner> r;
    std::optional<stream::stream_stepper> st;
  };
  std::vector<one> all;
  std::vector<stream::stream_run> runs;
  const auto start = [&](const stream::policy_info& p) {
    std::span<const llama_token> part(toks);
    one x;
    x.name = p.name;
    if (p.k == stream::kind::full && std::int64_t(part.size()) > sh.n_ctx_train) {
      part = part.first(std::size_t(sh.n_ctx_train));
      x.note = "stopped at the trained context, " + std::to_string(sh.n_ctx_train) + " tokens";
    }
    x.r = stream::make_runner(m, p.k, o.s, std::int64_t(part.size()), o.s.block);
    x.st.emplace(*x.r, x.name, part, o.skip, o.s, o.smooth);
    return x;
  };
  const auto step = [&](one& x) {
    const stream::block_record& b = x.st->step();
    const std::int64_t n_blocks = x.st->n_blocks();
    if (o.progress == 0 || ((b.index + 1) % o.progress != 0 && b.index + 1 != n_blocks)) return;
    fmt::print(
        stderr,
        "[{}] block {}/{} tokens {} ppl {:.3f} running {:.3f} slots {} kv {:.2f} MiB rss {:.0f} MiB {:.0f} tok/s\n",
        x.name, b.index + 1, n_blocks, b.tokens, b.block_ppl, b.running_ppl, b.slots_peak,
        double(b.kv_state_bytes) / 1048576.0, double(b.rss_bytes) / 1048576.0, b.tok_per_s);
  };
  const auto done = [&](one& x) {
    runs.push_back(x.st->finish());
    runs.back().note = x.note;
    x.st.reset(), x.r.reset();
  };
  if (o.interleave) {
    for (const auto& p : chosen) all.push_back(start(p));
    for (std::size_t turn = 0, left = all.size(); left > 0; ++turn) {
      left = 0;
      for (std::size_t i = 0; i < all.size(); ++i) {  // the order turned every block
        one& x = all[(i + turn) % all.size()];
        if (x.st->done()) continue;
        step(x);
        ++left;
      }
    }
    for (auto& x : all) done(x);
  } else {
    for (const auto& p : chosen) {
      one x = start(p);
      while (!x.st->done()) step(x);
      done(x);
    }
  }
  const double load1 = load_average();
  stream::print_stream_table(runs, o.s);
  stream::print_time_table(runs);
  fmt::print("load average: {:.2f} at start, {:.2f} at end (tokens/s are shared-machine figures)\n", load0, load1);
  if (!o.json.empty()) {
    auto j = stream::stream_json(head(o, m, load0), runs, o.s);
    j["tokens"] = toks.size();
    j["skip"] = o.skip;
    j["load_average_end"] = stream::num(load1);
    infkv_tools::write_json("--json", o.json, j);
  }
  const std::string csv = stream::to_csv(runs);
  if (!o.csv.empty()) infkv_tools::write_file("--csv", o.csv, csv);
  if (!o.plot.empty()) {
    std::string data = o.csv;
    if (data.empty()) infkv_tools::write_file("--plot", data = o.plot + ".csv", csv);
    const std::string title = "infkv-stream: " + std::filesystem::path(o.model).filename().string() + " on " +
                              std::filesystem::path(o.text).filename().string() + ", budget " +
                              std::to_string(o.s.budget) + ", block " + std::to_string(o.s.block) +
                              ", moving average over " + std::to_string(o.smooth) + " blocks";
    stream::plot(data, o.plot, runs, title, o.s);
    if (o.csv.empty()) std::filesystem::remove(data);
  }
  return 0;
}

/// The retrieval streams of --passkey (one key each) or --needle (--needles keys each); --trials
/// keys in all.
std::vector<stream::retrieval_stream> retrieval_streams(const options& o, const llama_model* m) {
  std::vector<stream::retrieval_stream> streams;
  if (!o.passkey.empty()) {
    for (std::int64_t t = 0; t < o.trials; ++t) streams.push_back(stream::make_passkey(m, o.passkey, t, o.seed));
    return streams;
  }
  stream::needle_layout lay{
      .distances = o.needle, .kinds = o.needle_kinds, .per_stream = o.needles, .people = o.people, .gap = o.needle_gap};
  const std::int64_t kinds_needed = stream::kinds_in_stream(o.needles, o.people);
  if (lay.kinds.empty())  // number, word, fact; a stream of more kinds takes more
    for (std::int64_t i = 0; i < std::max<std::int64_t>(3, kinds_needed); ++i)
      lay.kinds.emplace_back(stream::needle_kinds[std::size_t(i)].name);
  if (kinds_needed > std::int64_t(lay.kinds.size()))
    usage_error(
        fmt::format("--needles = {}: with --people {} a stream takes {} kinds, more than the {} --needle-kind given "
                    "({})",
                    o.needles, o.people, kinds_needed, lay.kinds.size(), fmt::join(lay.kinds, ",")));
  const auto text = stream::tokenize_file(m, o.text, 0);
  if (std::int64_t(text.size()) <= lay.text_needed())
    usage_error(
        fmt::format("--needle = {}: --text = {} has {} tokens; a stream of {} needle(s) --needle-gap {} apart "
                    "takes up to {} tokens of its prose",
                    fmt::join(o.needle, ","), o.text, text.size(), o.needles, o.needle_gap, lay.text_needed()));
  std::vector<bool> line_start(text.size(), false);
  for (std::size_t i = 1; i < text.size(); ++i) {
    const std::string prev = stream::piece(m, text[i - 1]);
    line_start[i] = !prev.empty() && prev.back() == '\n';
  }
  for (std::int64_t first = 0, index = 0; first < o.trials; first += o.needles, ++index)
    streams.push_back(
        stream::make_needles(m, text, line_start, lay, first, std::min(o.needles, o.trials - first), index, o.seed));
  return streams;
}

/// The retrieval settings recorded in --json and --export-questions.
nlohmann::json retrieval_settings(const options& o) {
  nlohmann::json j = {{"distances", o.passkey.empty() ? o.needle : o.passkey},
                      {"trials", o.trials},
                      {"gen", o.gen},
                      {"seed", o.seed},
                      {"needles_per_stream", o.needles},
                      {"needle_gap", o.needle_gap},
                      {"people", o.people}};
  if (o.passkey.empty()) j["protocol"] = stream::needle_protocol;
  return j;
}

/// --export-questions: every question as the runners would ask it, in token ids: `prompt` (the
/// stream's first `at` tokens, what a single-turn prompt holds before the question), `question`
/// (asked right after it), `choices` (each candidate's value and suffix, teacher-forced after the
/// question) with `truth` the true one, and where the statement lies in the prompt.
int export_questions(const options& o, const llama_model* m) {
  const double load0 = load_average();
  nlohmann::json qs = nlohmann::json::array();
  for (const auto& rs : retrieval_streams(o, m))
    for (const auto& p : rs.probes)
      qs.push_back({{"trial", p.trial},
                    {"stream", p.stream},
                    {"kind", p.kind},
                    {"person", p.person},
                    {"needle", p.needle},
                    {"candidates", p.candidates},
                    {"truth", p.truth},
                    {"key_at", p.key_at},
                    {"key_end", p.key_end},
                    {"at", p.at},
                    {"prompt", std::vector<llama_token>(rs.tokens.begin(), rs.tokens.begin() + p.at)},
                    {"question", p.question},
                    {"choices", p.choices}});
  auto j = head(o, m, load0);
  j[o.passkey.empty() ? "needle" : "passkey"] = retrieval_settings(o);
  j["questions"] = std::move(qs);
  infkv_tools::write_json("--export-questions", o.export_questions, j);
  fmt::print(stderr, "infkv-stream: {} questions written to {}\n", j["questions"].size(), o.export_questions);
  return 0;
}

int run_retrieval(const options& o, const std::vector<stream::policy_info>& chosen, const llama_model* m) {
  const double load0 = load_average();
  const stream::model_shape sh(m);
  const std::vector<stream::retrieval_stream> streams = retrieval_streams(o, m);
  std::int64_t longest = 0, questions = 0;
  for (const auto& rs : streams)
    longest = std::max(longest, std::int64_t(rs.tokens.size())), questions += std::int64_t(rs.probes.size());
  const auto& distances = o.passkey.empty() ? o.needle : o.passkey;
  fmt::print(stderr,
             "infkv-stream: {}, distances {}, {} keys in {} stream(s) of up to {} tokens, {} questions; budget {}, "
             "block {}; load average {:.2f}\n",
             o.passkey.empty() ? "needles in " + o.text : "passkey", fmt::join(distances, ","), o.trials,
             streams.size(), longest, questions, o.s.budget, o.s.block, load0);
  std::vector<stream::passkey_run> runs;
  for (const auto& p : chosen) {
    stream::passkey_run run;
    run.policy = std::string(p.name);
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& whole : streams) {
      // The full cache asks only the questions within the model's trained context.
      const std::int64_t limit = sh.n_ctx_train - stream::ask_room(whole, o.gen);
      const auto rs = p.k == stream::kind::full ? stream::within(whole, limit) : whole;
      if (rs.probes.size() < whole.probes.size())
        run.note = fmt::format("questions beyond the trained context ({} tokens) not asked", sh.n_ctx_train);
      if (rs.probes.empty()) continue;
      auto ps = o.s;
      if (p.k == stream::kind::full) ps.question_known = false;  // no eviction: the stream's answers are the same
      auto got = stream::run_retrieval(m, p.k, ps, rs, o.gen, [&](const stream::passkey_trial& t) {
        if (o.progress > 0)
          fmt::print(stderr,
                     "[{}] key {}: {} {}{}{} at token {}, asked at {} (distance {}), {}/{} key tokens cached, "
                     "log p(needle) {:.2f}{}: \"{}\" {}\n",
                     p.name, t.p.trial, t.p.kind, t.p.person, t.p.person.empty() ? "" : " ", t.p.needle, t.p.key_at,
                     t.p.at, t.p.distance(), t.key_kept, t.p.key_tokens(), t.needle_logprob,
                     t.p.forced()
                         ? fmt::format(", rank {} (best other {} {:.2f}) {}", t.rank, t.p.candidates[t.best_other],
                                       t.best_other_logprob(), t.forced_success ? "chosen" : "not chosen")
                         : std::string(),
                     t.answer, t.success ? "ok" : "miss");
      });
      run.trials.insert(run.trials.end(), got.begin(), got.end());
    }
    run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    runs.push_back(std::move(run));
  }
  stream::print_passkey_table(runs);
  if (!o.json.empty()) {
    auto j = stream::passkey_json(head(o, m, load0), runs);
    j[o.passkey.empty() ? "needle" : "passkey"] = retrieval_settings(o);
    j["load_average_end"] = stream::num(load_average());
    infkv_tools::write_json("--json", o.json, j);
  }
  if (!o.csv.empty()) infkv_tools::write_file("--csv", o.csv, stream::passkey_csv(runs));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "infkv-stream: perplexity (or passkey / needle retrieval) of a real model streaming text through a KV cache "
      "bounded to --budget + --block cells, evicted by infkv policies"};
  app.name("infkv-stream");
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", version_line());
  options o;
  o.s.threads = int(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (!o.key_type.empty()) o.s.key_type = o.key_type == "f32" ? infkv::dtype::f32 : infkv::dtype::f16;
  o.s.keys = o.keys == "copy"     ? infkv::llama_cpp::key_source::copy
             : o.keys == "engine" ? infkv::llama_cpp::key_source::engine
                                  : infkv::llama_cpp::key_source::automatic;
  o.s.proxy = o.proxy == "alone" ? infkv::llama_cpp::proxy_mode::alone : infkv::llama_cpp::proxy_mode::after_cache;
  if (o.s.compact_positions && o.s.keep_positions) usage_error("--compact-positions and --keep-positions: choose one");
  if (o.s.compact_positions && o.s.archive_bits == 0) usage_error("--compact-positions: needs --archive BITS");
  o.s.cache_type = o.cache_type == "q8_0" ? GGML_TYPE_Q8_0 : o.cache_type == "q4_0" ? GGML_TYPE_Q4_0 : GGML_TYPE_F16;
  if (o.s.cache_type != GGML_TYPE_F16 && o.s.archive_bits > 0)
    usage_error("--cache-type = " + o.cache_type +
                ": the archive reads and restores f16 caches only; not with --archive");
  if (o.s.archive_bits > 0 && !o.s.compact_positions)
    o.s.keep_positions = true;  // recalled rows go back at their own positions
  for (const auto& [flag, value] :
       {std::pair{"--position-gap", o.s.position_gap}, {"--position-span", o.s.position_span}}) {
    const std::string named = std::string(flag) + " " + std::to_string(value);
    if (value > 0 && o.s.keep_positions)
      usage_error(named + ": narrows the gaps of compacted positions; " +
                  (o.s.archive_bits > 0 ? "with --archive it needs --compact-positions" : "not with --keep-positions"));
    if (value > 0 && o.s.recall_tokens + o.s.prefetch_tokens > 0 && o.s.recall_distance < 0)
      usage_error(named + ": recall and prefetch need --recall-distance with it (the landing rule closes gaps)");
  }
  if (o.s.position_gap > 0 && o.s.position_span > 0) usage_error("--position-span and --position-gap: choose one");
  if (o.list) {
    for (const auto& p : infkv_tools::policy_catalog) fmt::print("{:<19} {}\n", p.name, p.about);
    return 0;
  }
  const auto chosen = check(o);
  try {
    const auto model = stream::load_model(o.model);
    check_memory(o, chosen, model.get());
    if (!o.export_questions.empty()) return export_questions(o, model.get());
    return o.retrieval() ? run_retrieval(o, chosen, model.get()) : run_text(o, chosen, model.get());
  } catch (const std::exception& e) {
    std::cerr << "infkv-stream: error: " << e.what() << '\n';
    if (o.keys == "engine" &&
        std::string_view(e.what()).find("session_options.keys = engine") != std::string_view::npos)
      std::cerr << "infkv-stream: --keys engine: the policies cannot read llama.cpp's cache here; run with --keys auto "
                   "(copies where the cache cannot be read) or --keys copy\n";
    return 1;
  }
}
