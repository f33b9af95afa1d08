// infkv-stream: output: per-block CSV and JSON, the summary table, and the PNG plot (gnuplot,
// running the script of examples/plot_stream.gp, compiled in).
#pragma once

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.hpp"

#include "infkv_stream_plot.hpp"
#include "passkey.hpp"
#include "stats_json.hpp"
#include "stream_run.hpp"

namespace stream {

/// JSON number, or null for NaN / infinity.
inline nlohmann::json num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

/// A table cell: `v` fixed with `digits` decimals, right-aligned in `width`; "-" when not finite.
inline std::string cell(double v, int width, int digits) {
  if (!std::isfinite(v)) return fmt::format("{:>{}}", "-", width);
  return fmt::format("{:>{}.{}f}", v, width, digits);
}

/// "  (note)", or nothing for an empty note.
inline std::string note_suffix(const std::string& note) { return note.empty() ? std::string() : "  (" + note + ")"; }

inline const char* csv_header =
    "policy,block,tokens,scored,block_ppl,running_ppl,window_ppl,slots_peak,slots,evicted,"
    "kv_alloc_bytes,kv_state_bytes,host_bytes,rss_bytes,seconds,tok_per_s\n";

inline std::string to_csv(const std::vector<stream_run>& runs) {
  std::ostringstream os;
  os << csv_header;
  fmt::memory_buffer line;
  for (const auto& r : runs)
    for (const auto& b : r.blocks) {
      line.clear();
      fmt::format_to(std::back_inserter(line), "{},{},{},{},{:.6g},{:.6g},{:.6g},{},{},{},{},{},{},{},{:.6f},{:.3f}\n",
                     r.policy, b.index, b.tokens, b.scored, b.block_ppl, b.running_ppl, b.window_ppl, b.slots_peak,
                     b.slots, b.evicted, b.kv_alloc_bytes, b.kv_state_bytes, b.host_bytes, b.rss_bytes, b.seconds,
                     b.tok_per_s);
      os.write(line.data(), std::streamsize(line.size()));
    }
  return os.str();
}

inline nlohmann::json to_json(const block_record& b) {
  return {{"block", b.index},
          {"tokens", b.tokens},
          {"scored", b.scored},
          {"nll", b.nll},
          {"block_ppl", num(b.block_ppl)},
          {"running_ppl", num(b.running_ppl)},
          {"window_ppl", num(b.window_ppl)},
          {"slots_peak", b.slots_peak},
          {"slots", b.slots},
          {"evicted", b.evicted},
          {"kv_alloc_bytes", b.kv_alloc_bytes},
          {"kv_state_bytes", b.kv_state_bytes},
          {"host_bytes", b.host_bytes},
          {"rss_bytes", b.rss_bytes},
          {"seconds", b.seconds},
          {"tok_per_s", b.tok_per_s}};
}

inline nlohmann::json to_json(const run_summary& s) {
  return {{"ppl", num(s.ppl)},
          {"early_ppl", num(s.early_ppl)},
          {"late_ppl", num(s.late_ppl)},
          {"warm_blocks", s.warm_blocks},
          {"tok_per_s", s.tok_per_s},
          {"max_slots", s.max_slots},
          {"kv_alloc_bytes", s.kv_alloc_bytes},
          {"peak_rss_bytes", s.peak_rss},
          {"evictions", s.evictions}};
}

/// What every JSON output says about its memory figures.
inline const char* memory_note =
    "kv_alloc_bytes: computed, llama_n_ctx * layers * 2 (K, V) * kv_heads * head_dim elements of the cache type "
    "(f16 unless --cache-type); "
    "kv_state_bytes: measured, llama_state_seq_get_size of the sequence after the eviction (cells in use); "
    "host_bytes: measured, session::memory().total(): the session's key (and value) copies in the cache's type (f16 "
    "for a quantized cache), "
    "window and staged queries, H2O state, workspace and bookkeeping; rss_bytes: "
    "/proc/self/statm";

inline nlohmann::json stream_json(const nlohmann::json& head, const std::vector<stream_run>& runs, const settings& s) {
  nlohmann::json j = head;
  j["memory_note"] = memory_note;
  j["runs"] = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : r.blocks) blocks.push_back(to_json(b));
    j["runs"].push_back({{"policy", r.policy},
                         {"tokens", r.tokens},
                         {"seconds", r.seconds},
                         {"note", r.note},
                         {"summary", to_json(summarise(r, s))},
                         {"time", to_json(r.time)},
                         {"blocks", std::move(blocks)}});
  }
  return j;
}

inline void print_stream_table(const std::vector<stream_run>& runs, const settings& s) {
  fmt::print("{:<18} {:>7} {:>6} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>8} {:>8}\n", "policy", "tokens", "blocks",
             "ppl", "ppl_early", "ppl_late", "tok/s", "slots", "kv_MiB", "rss_MiB", "evicts");
  for (const auto& r : runs) {
    const auto m = summarise(r, s);
    fmt::print("{:<18} {:7} {:6} {} {} {} {} {:6} {} {} {:8}{}\n", r.policy, r.tokens, r.blocks.size(),
               cell(m.ppl, 9, 3), cell(m.early_ppl, 9, 3), cell(m.late_ppl, 9, 3), cell(m.tok_per_s, 7, 1), m.max_slots,
               cell(double(m.kv_alloc_bytes) / 1048576.0, 8, 2), cell(double(m.peak_rss) / 1048576.0, 8, 1),
               m.evictions, note_suffix(r.note));
  }
  fmt::print(
      "ppl_early / ppl_late: first / last 10% of the blocks after warm-up (tokens > budget + block = {}); "
      "slots: peak cached tokens; kv_MiB: llama.cpp K/V buffers (computed from n_ctx)\n",
      s.budget + s.block);
}

/// Where each run's seconds went: llama_decode (capture callbacks inside it), then the
/// session's own work after the decodes and at the evictions.
inline void print_time_table(const std::vector<stream_run>& runs) {
  fmt::print("{:<18} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7}\n", "time (s)", "total",
             "decode", "capture", "append", "h2o", "score", "seq_rm", "seq_add", "h_evict", "rerot", "own %");
  for (const auto& r : runs) {
    const auto& t = r.time;
    fmt::print("{:<18} {} {} {} {} {} {} {} {} {} {} {}\n", r.policy, cell(r.seconds, 8, 2), cell(t.decode, 8, 2),
               cell(t.capture, 8, 3), cell(t.append, 7, 3), cell(t.h2o, 7, 3), cell(t.score, 7, 3),
               cell(t.seq_rm, 7, 3), cell(t.seq_add, 7, 4), cell(t.host_evict, 7, 3), cell(t.rerotate, 7, 3),
               cell(t.decode > 0 ? 100.0 * t.overhead() / t.decode : NAN, 7, 2));
  }
  fmt::print(
      "decode: llama_decode, capture copies (part of it) and llama.cpp's K-shift included; own %: the session's "
      "work outside llama_decode over the decode time\n");
}

inline nlohmann::json passkey_json(const nlohmann::json& head, const std::vector<passkey_run>& runs) {
  nlohmann::json j = head;
  j["runs"] = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json trials = nlohmann::json::array();
    for (const auto& t : r.trials) {
      nlohmann::json cands = nlohmann::json::array();
      for (std::size_t c = 0; c < t.p.candidates.size(); ++c)
        cands.push_back({{"value", t.p.candidates[c]}, {"logprob", num(t.logprobs[c])}});
      trials.push_back({{"trial", t.p.trial},
                        {"stream", t.p.stream},
                        {"kind", t.p.kind},
                        {"person", t.p.person},
                        {"needle", t.p.needle},
                        {"prefix", t.p.prefix},
                        {"key_at", t.p.key_at},
                        {"asked_at", t.p.at},
                        {"distance", t.p.distance()},
                        {"prompt_tokens", t.p.at + std::int64_t(t.p.question.size())},
                        {"key_tokens", t.p.key_tokens()},
                        {"key_kept", t.key_kept},
                        {"needle_logprob", num(t.needle_logprob)},
                        {"forced_success", t.p.forced() ? nlohmann::json(t.forced_success) : nlohmann::json(nullptr)},
                        {"rank", t.rank},
                        {"candidates", std::move(cands)},
                        {"answer", t.answer},
                        {"success", t.success},
                        {"seconds", t.seconds},
                        {"key_recalled", t.key_recalled},
                        {"recall_seconds", t.recall_seconds},
                        {"decode_seconds", t.decode_seconds},
                        {"archive_bytes", t.archive_bytes},
                        {"cache_bytes", t.cache_bytes},
                        {"full_bytes", t.full_bytes}});
    }
    j["runs"].push_back({{"policy", r.policy},
                         {"note", r.note},
                         {"seconds", r.seconds},
                         {"success_rate", num(r.trials.empty() ? NAN : success_rate(r.trials))},
                         {"forced_rate", num(r.trials.empty() ? NAN : forced_rate(r.trials))},
                         {"trials", std::move(trials)}});
  }
  return j;
}

/// Per question: success is the greedy grade (answer_matches), forced_success the forced choice
/// (empty for the passkey, which has no alternatives), rank the true value's among its
/// candidates, best_other the best-scoring other candidate.
inline std::string passkey_csv(const std::vector<passkey_run>& runs) {
  std::ostringstream os;
  os << "policy,trial,stream,kind,person,needle,key_at,distance,prompt_tokens,key_tokens,key_kept,success,"
        "forced_success,rank,candidates,needle_logprob,best_other,best_other_logprob,seconds,key_recalled,"
        "recall_seconds,decode_seconds,archive_bytes,cache_bytes,full_bytes,answer\n";
  const auto clean = [](std::string a) {
    for (auto& c : a)
      if (c == '"' || c == '\n' || c == ',' || c == '\r') c = ' ';
    return a;
  };
  for (const auto& r : runs)
    for (const auto& t : r.trials) {
      const bool f = t.p.forced();
      os << fmt::format(
          "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{:.4f},{},{},{:.3f},{},{:.4f},{:.3f},{},{},{},\"{}\"\n",
          r.policy, t.p.trial, t.p.stream, t.p.kind, t.p.person, clean(t.p.needle), t.p.key_at, t.p.distance(),
          t.p.at + std::int64_t(t.p.question.size()), t.p.key_tokens(), t.key_kept, int(t.success),
          f ? std::to_string(int(t.forced_success)) : std::string(), f ? std::to_string(t.rank) : "",
          t.p.candidates.size(), t.needle_logprob, f ? clean(t.p.candidates[t.best_other]) : "",
          f ? fmt::format("{:.4f}", t.best_other_logprob()) : "", t.seconds, t.key_recalled, t.recall_seconds,
          t.decode_seconds, t.archive_bytes, t.cache_bytes, t.full_bytes, clean(t.answer));
    }
  return os.str();
}

/// Per policy and distance asked: questions, forced-choice and greedy successes, key tokens
/// cached, mean log-probability of the needle after the question.
inline void print_passkey_table(const std::vector<passkey_run>& runs) {
  fmt::print("{:<18} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8}\n", "policy", "distance", "questions", "forced",
             "greedy", "key_kept", "logp", "s/run");
  struct tally {
    double n = 0, forced_n = 0, forced = 0, ok = 0, kept = 0, lp = 0;
  };
  for (const auto& r : runs) {
    if (r.trials.empty()) fmt::print("{:<18} {:>8} {:9}{}\n", r.policy, "-", 0, note_suffix(r.note));
    std::map<std::int64_t, tally> by_distance;
    for (const auto& t : r.trials) {
      auto& c = by_distance[t.p.distance()];
      ++c.n, c.ok += t.success, c.kept += double(t.key_kept) / double(t.p.key_tokens()), c.lp += t.needle_logprob;
      if (t.p.forced()) ++c.forced_n, c.forced += t.forced_success;
    }
    for (const auto& [d, c] : by_distance)
      fmt::print("{:<18} {:8} {:9.0f} {:>8} {:>7.0f}% {:>8.0f}% {} {}{}\n", r.policy, d, c.n,
                 c.forced_n > 0 ? fmt::format("{:.0f}%", 100.0 * c.forced / c.forced_n) : std::string("-"),
                 100.0 * c.ok / c.n, 100.0 * c.kept / c.n, cell(c.lp / c.n, 9, 2), cell(r.seconds, 8, 1),
                 note_suffix(r.note));
  }
  fmt::print(
      "forced: the true value's log-probability ranks first among its kind's candidates (teacher forcing); "
      "greedy: the greedy answer begins with the value (whole words, any case); logp: mean log-probability of "
      "the true value after the question\n");
}

/// Plots the CSV at `csv` into `png` with gnuplot (the script of examples/plot_stream.gp).
inline void plot(const std::string& csv, const std::string& png, const std::vector<stream_run>& runs,
                 const std::string& title, const settings& s) {
  std::string policies;
  for (const auto& r : runs) policies += r.policy + ' ';
  const auto script = std::filesystem::path(png).string() + ".gp";
  infkv_tools::write_file("--plot", script, plot_script);
  auto quote = [](const std::string& v) {
    std::string q = "'";
    for (char c : v) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  auto esc = [](std::string v) {  // inside a gnuplot single-quoted string
    std::string o;
    for (char c : v) o += c == '\'' ? std::string("''") : std::string(1, c);
    return o;
  };
  const std::string vars = "csv='" + esc(csv) + "'; out='" + esc(png) + "'; policies='" + esc(policies) + "'; title='" +
                           esc(title) + "'; budget=" + std::to_string(s.budget);
  const std::string cmd = "gnuplot -e " + quote(vars) + " " + quote(script);
  const int rc = std::system(cmd.c_str());
  std::filesystem::remove(script);
  if (rc != 0)
    infkv_tools::fail(
        "--plot = {}: gnuplot failed (status {}); install gnuplot (Debian: gnuplot-nox, "
        "scripts/kjv.sh does) or leave out --plot",
        png, rc);
}

}  // namespace stream
