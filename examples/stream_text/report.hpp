// infkv-stream: output: per-block CSV and JSON, the summary table, and the PNG plot (gnuplot,
// running the script of examples/plot_stream.gp, compiled in).
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "infkv_stream_plot.hpp"
#include "passkey.hpp"
#include "stream_run.hpp"

namespace stream {

/// JSON number, or null for NaN / infinity.
inline nlohmann::json num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

inline std::string fmt(double v, int width, int digits) {
  char buf[64];
  if (!std::isfinite(v)) std::snprintf(buf, sizeof buf, "%*s", width, "-");
  else std::snprintf(buf, sizeof buf, "%*.*f", width, digits, v);
  return buf;
}

/// Writes `text` to `path`; throws infkv::error naming `flag` when it cannot.
inline void write_file(const std::string& flag, const std::string& path, const std::string& text) {
  std::ofstream f(path);
  if (!(f << text)) infkv::detail::fail(flag, " = ", path, ": cannot write the file");
}

inline const char* csv_header =
    "policy,block,tokens,scored,block_ppl,running_ppl,window_ppl,slots_peak,slots,evicted,"
    "kv_alloc_bytes,kv_state_bytes,host_bytes,rss_bytes,seconds,tok_per_s\n";

inline std::string to_csv(const std::vector<stream_run>& runs) {
  std::ostringstream os;
  os << csv_header;
  char line[512];
  for (const auto& r : runs)
    for (const auto& b : r.blocks) {
      std::snprintf(line, sizeof line, "%s,%lld,%lld,%lld,%.6g,%.6g,%.6g,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%.6f,%.3f\n",
                    r.policy.c_str(), (long long)b.index, (long long)b.tokens, (long long)b.scored, b.block_ppl,
                    b.running_ppl, b.window_ppl, (long long)b.slots_peak, (long long)b.slots, (long long)b.evicted,
                    (long long)b.kv_alloc_bytes, (long long)b.kv_state_bytes, (long long)b.host_bytes,
                    (long long)b.rss_bytes, b.seconds, b.tok_per_s);
      os << line;
    }
  return os.str();
}

inline nlohmann::json to_json(const block_record& b) {
  return {{"block", b.index},          {"tokens", b.tokens},
          {"scored", b.scored},        {"nll", b.nll},
          {"block_ppl", num(b.block_ppl)}, {"running_ppl", num(b.running_ppl)},
          {"window_ppl", num(b.window_ppl)}, {"slots_peak", b.slots_peak},
          {"slots", b.slots},          {"evicted", b.evicted},
          {"kv_alloc_bytes", b.kv_alloc_bytes}, {"kv_state_bytes", b.kv_state_bytes},
          {"host_bytes", b.host_bytes}, {"rss_bytes", b.rss_bytes},
          {"seconds", b.seconds},      {"tok_per_s", b.tok_per_s}};
}

inline nlohmann::json to_json(const run_summary& s) {
  return {{"ppl", num(s.ppl)},          {"early_ppl", num(s.early_ppl)}, {"late_ppl", num(s.late_ppl)},
          {"warm_blocks", s.warm_blocks}, {"tok_per_s", s.tok_per_s},    {"max_slots", s.max_slots},
          {"kv_alloc_bytes", s.kv_alloc_bytes}, {"peak_rss_bytes", s.peak_rss}, {"evictions", s.evictions}};
}

/// What every JSON output says about its memory figures.
inline const char* memory_note =
    "kv_alloc_bytes: computed, llama_n_ctx * layers * 2 (K, V) * kv_heads * head_dim * 2 bytes (f16 cache); "
    "kv_state_bytes: measured, llama_state_seq_get_size of the sequence after the eviction (cells in use); "
    "host_bytes: computed, the session's f16 key copies and f32 window queries; rss_bytes: /proc/self/statm";

inline nlohmann::json stream_json(const nlohmann::json& head, const std::vector<stream_run>& runs, const settings& s) {
  nlohmann::json j = head;
  j["memory_note"] = memory_note;
  j["runs"] = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : r.blocks) blocks.push_back(to_json(b));
    j["runs"].push_back({{"policy", r.policy}, {"tokens", r.tokens}, {"seconds", r.seconds}, {"note", r.note},
                         {"summary", to_json(summarise(r, s))}, {"blocks", std::move(blocks)}});
  }
  return j;
}

inline void print_stream_table(const std::vector<stream_run>& runs, const settings& s) {
  std::printf("%-14s %7s %6s %9s %9s %9s %7s %6s %8s %8s %8s\n", "policy", "tokens", "blocks", "ppl", "ppl_early",
              "ppl_late", "tok/s", "slots", "kv_MiB", "rss_MiB", "evicts");
  for (const auto& r : runs) {
    const auto m = summarise(r, s);
    std::printf("%-14s %7lld %6zu %s %s %s %s %6lld %s %s %8lld%s\n", r.policy.c_str(), (long long)r.tokens,
                r.blocks.size(), fmt(m.ppl, 9, 3).c_str(), fmt(m.early_ppl, 9, 3).c_str(), fmt(m.late_ppl, 9, 3).c_str(),
                fmt(m.tok_per_s, 7, 1).c_str(), (long long)m.max_slots, fmt(double(m.kv_alloc_bytes) / 1048576.0, 8, 2).c_str(),
                fmt(double(m.peak_rss) / 1048576.0, 8, 1).c_str(), (long long)m.evictions,
                r.note.empty() ? "" : ("  (" + r.note + ")").c_str());
  }
  std::printf("ppl_early / ppl_late: first / last 10%% of the blocks after warm-up (tokens > budget + block = %lld); "
              "slots: peak cached tokens; kv_MiB: llama.cpp K/V buffers (computed from n_ctx)\n",
              (long long)(s.budget + s.block));
}

inline nlohmann::json passkey_json(const nlohmann::json& head, const std::vector<passkey_run>& runs) {
  nlohmann::json j = head;
  j["runs"] = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json trials = nlohmann::json::array();
    for (const auto& t : r.trials)
      trials.push_back({{"trial", t.trial}, {"number", t.prompt.number}, {"prefix_units", t.prompt.prefix_units},
                        {"key_at", t.prompt.key_at}, {"distance", t.prompt.distance},
                        {"prompt_tokens", t.prompt.context.size() + t.prompt.question.size()},
                        {"key_tokens", t.prompt.key_tokens()}, {"key_kept", t.key_kept}, {"answer", t.answer},
                        {"success", t.success}, {"seconds", t.seconds}});
    j["runs"].push_back({{"policy", r.policy}, {"note", r.note}, {"success_rate", num(r.trials.empty() ? NAN : r.rate())},
                         {"trials", std::move(trials)}});
  }
  return j;
}

inline std::string passkey_csv(const std::vector<passkey_run>& runs) {
  std::ostringstream os;
  os << "policy,trial,number,key_at,distance,prompt_tokens,key_tokens,key_kept,success,seconds,answer\n";
  for (const auto& r : runs)
    for (const auto& t : r.trials) {
      std::string a = t.answer;
      for (auto& c : a)
        if (c == '"' || c == '\n' || c == ',') c = ' ';
      os << r.policy << ',' << t.trial << ',' << t.prompt.number << ',' << t.prompt.key_at << ',' << t.prompt.distance
         << ',' << t.prompt.context.size() + t.prompt.question.size() << ',' << t.prompt.key_tokens() << ','
         << t.key_kept << ',' << int(t.success) << ','
         << t.seconds << ",\"" << a << "\"\n";
    }
  return os.str();
}

inline void print_passkey_table(const std::vector<passkey_run>& runs) {
  std::printf("%-14s %7s %8s %9s %9s\n", "policy", "trials", "success", "key_kept", "s/trial");
  for (const auto& r : runs) {
    double sec = 0, kept = 0;
    for (const auto& t : r.trials) sec += t.seconds, kept += double(t.key_kept) / double(t.prompt.key_tokens());
    const double n = r.trials.empty() ? NAN : double(r.trials.size());
    std::printf("%-14s %7zu %7.0f%% %8.0f%% %s%s\n", r.policy.c_str(), r.trials.size(), 100.0 * r.rate(),
                100.0 * kept / n, fmt(sec / n, 9, 2).c_str(),
                r.note.empty() ? "" : ("  (" + r.note + ")").c_str());
  }
}

/// Plots the CSV at `csv` into `png` with gnuplot (the script of examples/plot_stream.gp).
inline void plot(const std::string& csv, const std::string& png, const std::vector<stream_run>& runs,
                 const std::string& title, const settings& s) {
  std::string policies;
  for (const auto& r : runs) policies += r.policy + ' ';
  const auto script = std::filesystem::path(png).string() + ".gp";
  write_file("--plot", script, plot_script);
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
  const std::string vars = "csv='" + esc(csv) + "'; out='" + esc(png) + "'; policies='" + esc(policies) +
                           "'; title='" + esc(title) + "'; budget=" + std::to_string(s.budget);
  const std::string cmd = "gnuplot -e " + quote(vars) + " " + quote(script);
  const int rc = std::system(cmd.c_str());
  std::filesystem::remove(script);
  if (rc != 0)
    infkv::detail::fail("--plot = ", png, ": gnuplot failed (status ", rc,
                        "); install gnuplot (Debian: gnuplot-nox, scripts/kjv.sh does) or leave out --plot");
}

}  // namespace stream
