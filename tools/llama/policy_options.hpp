// The command-line options of the policies' knobs that infkv-stream and infkv-video share: the
// budget, threads, protected tokens, windows, bias and reductions of stream::settings.
#pragma once

#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "cli_util.hpp"
#include "runner.hpp"

namespace stream {

/// Adds --budget, --threads, --sinks, --recent, --window, --beta, --ea-window, --reduce,
/// --recent-share, --keydiff-kernel, --archive, --archive-mib, --archive-page, --recall, --recall-candidates,
/// --prefetch, --recall-neighbours, --recall-distance, --recall-bias, --score-layers and
/// --keep-positions for `s` to `app`.
inline void add_policy_options(CLI::App& app, settings& s) {
  using infkv_tools::at_least;
  const auto pos = at_least(1), nonneg = at_least(0);
  app.add_option("--budget", s.budget, "cache slots kept after each eviction")->check(pos);
  app.add_option("--threads", s.threads, "llama.cpp and scoring threads")->check(at_least(1, true, 1024));
  app.add_option("--sinks", s.sinks, "protected first tokens (streaming_llm, keydiff, inf_mllm*, expected_attention)")
      ->check(nonneg);
  app.add_option("--recent", s.recent, "protected last tokens (h2o, snapkv, keydiff, inf_mllm*, expected_attention)")
      ->check(nonneg);
  app.add_option("--window", s.window, "queries that score the cache (snapkv, inf_mllm*)")->check(pos);
  app.add_option("--beta", s.beta, "attention bias toward newer tokens of inf_mllm_bias")->check(at_least(0, false));
  app.add_option("--ea-window", s.ea_window, "queries whose mean and covariance expected_attention uses")->check(pos);
  app.add_option("--reduce", s.reduce, "how the heads' and layers' scores combine into one per token (mean, max)")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, infkv::reduction>{{"mean", infkv::reduction::mean}, {"max", infkv::reduction::max}}));
  app.add_option("--recent-share", s.recent_share,
                 "recent_keydiff, saddle_union: share of --budget kept as the recency region")
      ->check(at_least(0, false, 1));
  app.add_option("--union-share", s.union_share,
                 "saddle_union: share of the saddles chosen by attention (inf_mllm_bias), the rest by KeyDiff")
      ->check(at_least(0, false, 1));
  app.add_option("--keydiff-kernel", s.keydiff_kernel,
                 "recent_keydiff, saddle_union: KeyDiff scores max-pooled over this many "
                 "neighbours (odd; 1: none)")
      ->check(at_least(1, true, 1001));
  app.add_option("--archive", s.archive_bits,
                 "keep the stream in an archive at this many bits (2, 4, 8; implies --keep-positions unless "
                 "--compact-positions)")
      ->check(CLI::IsMember({2, 4, 8}));
  app.add_option("--archive-mib", s.archive_mib, "the archive's capacity in MiB (the oldest pages leave when full)")
      ->check(pos);
  app.add_option("--archive-page", s.archive_page, "slots per archive page (the unit recall ranks)")
      ->check(at_least(1, true, 4096));
  app.add_option("--recall", s.recall_tokens,
                 "before each question, bring back at most this many archived slots it needs (needs --archive)")
      ->check(pos);
  app.add_option("--prefetch", s.prefetch_tokens,
                 "after each eviction, bring back at most this many archived slots the window's queries need "
                 "(live prefetching; needs --archive)")
      ->check(pos);
  app.add_option("--recall-candidates", s.recall_candidates, "archive pages scored exactly per recall")->check(pos);
  app.add_option("--recall-neighbours", s.recall_neighbours,
                 "a recalled page brings this many adjoining pages on each side (0: none)")
      ->check(at_least(0, true, 64));
  app.add_option("--recall-distance", s.recall_distance,
                 "rank archived pages as if each stood this many positions before the newest cached token "
                 "(position-agnostic; default: where each would land)")
      ->check(nonneg)
      ->default_str("unset");
  app.add_option("--recall-bias", s.recall_bias,
                 "recall scores with the policy's recency bias (default true; false: without it, for inf_mllm_bias)");
  app.add_option_function<std::string>(
         "--score-layers", [&s](const std::string& v) { s.score_global_layers = v == "global"; },
         "which layers the policies score: all, or global (a sliding-window model's global layers only; other "
         "models: all)")
      ->check(CLI::IsMember({"all", "global"}))
      ->default_str("all");
  app.add_flag("--compact-positions", s.compact_positions,
               "with --archive: compact positions all the same (recalled rows are turned to where they land; for "
               "streams longer than the model's context)");
  app.add_option("--position-gap", s.position_gap,
                 "compacting positions, narrow the gap between two kept runs to at most this many positions instead "
                 "of closing it (0: close; runs far apart in the stream stay apart)")
      ->check(nonneg)
      ->capture_default_str();
  app.add_option("--position-span", s.position_span,
                 "compacting positions, narrow the gaps between kept runs as little as keeps every position below "
                 "this (e.g. the model's context less a block and a question; 0: unset)")
      ->check(nonneg)
      ->capture_default_str();
  app.add_flag("--keep-positions", s.keep_positions,
               "evicting policies leave holes at the original positions "
               "instead of compacting them (positions then grow with the stream)");
}

}  // namespace stream
