// Shared by infkv's example programs: command-line checks (and, through errors.hpp, the errors
// the programs throw).
#pragma once

#include <cmath>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "errors.hpp"

namespace infkv_examples {

/// CLI11 check: the value is a number >= `min` (an integer when `integer`).
inline CLI::Validator at_least(double min, bool integer = true) {
  return CLI::Validator(
      [=](std::string& v) -> std::string {
        std::istringstream is(v);
        double x = 0;
        if (!(is >> x) || !is.eof() || (integer && x != std::floor(x)))
          return "value " + v + " is not " + (integer ? "an integer" : "a number");
        if (x < min) return fmt::format("value {} must be >= {}", v, min);
        return {};
      },
      integer && min >= 1 ? "POSITIVE" : "NONNEGATIVE");
}

}  // namespace infkv_examples
