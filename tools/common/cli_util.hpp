// Shared by infkv's tools: command-line checks, writing output files (and, through errors.hpp,
// the errors the programs throw).
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "errors.hpp"

namespace infkv_tools {

/// The largest integer any count option takes (tokens, slots, trials, threads): CLI11 would
/// otherwise saturate out-of-range input to the type's limit and run with it.
inline constexpr double max_count = double(std::int64_t(1) << 40);

/// CLI11 check: the value is a number in [min, max] (an integer when `integer`).
inline CLI::Validator at_least(double min, bool integer = true, double max = max_count) {
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        std::istringstream is(v);
        double x = 0;
        if (!(is >> x) || !is.eof() || !std::isfinite(x) || (integer && x != std::floor(x)))
          return "value " + v + " is not " + (integer ? "an integer" : "a finite number");
        if (x < min) return fmt::format("value {} must be >= {}", v, min);
        if (x > max) return fmt::format("value {} must be <= {}", v, max);
        return {};
      },
      integer&& min >= 1 ? "POSITIVE" : "NONNEGATIVE");
}

/// CLI11 check for an output file: its directory exists and is writable, so that a run does not
/// end in an error after all its work ('-' is standard output).
inline CLI::Validator writable_file() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        if (v == "-") return {};
        if (v.empty()) return "an empty path";
        const std::filesystem::path dir = std::filesystem::path(v).parent_path();
        const std::string d = dir.empty() ? "." : dir.string();
        std::error_code ec;
        if (!std::filesystem::is_directory(d, ec)) return fmt::format("directory {} does not exist", d);
        if (::access(d.c_str(), W_OK) != 0) return fmt::format("directory {} is not writable", d);
        if (std::filesystem::is_directory(v, ec)) return fmt::format("{} is a directory", v);
        return {};
      },
      "FILE");
}

/// Writes `bytes` to `path` (binary); throws infkv::error naming `flag` when it cannot.
inline void write_file(const std::string& flag, const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out.flush()) fail("{} = {}: cannot write the file", flag, path);
}

/// Writes `j` to `path` as JSON, `indent` spaces per level, and a newline. Text that is not valid
/// UTF-8 (a model's answer cut inside a character) is written with U+FFFD in its place rather
/// than failing the run at its end.
inline void write_json(const std::string& flag, const std::string& path, const nlohmann::json& j, int indent = 1) {
  write_file(flag, path, j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace infkv_tools
