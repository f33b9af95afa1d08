// Shared by infkv's tools: errors with fmt-formatted messages, thrown as the library's
// public exception types (<infkv/error.hpp>).
#pragma once

#include <utility>

#include <fmt/core.h>

#include <infkv/error.hpp>

namespace infkv_tools {

/// Throws infkv::invalid_argument with the message fmt::format(f, a...).
template <class... A>
[[noreturn]] void fail(fmt::format_string<A...> f, A&&... a) {
  throw infkv::invalid_argument(fmt::format(f, std::forward<A>(a)...));
}

/// Throws infkv::engine_error (an engine call refused or failed) with the message fmt::format(f, a...).
template <class... A>
[[noreturn]] void engine_fail(fmt::format_string<A...> f, A&&... a) {
  throw infkv::engine_error(fmt::format(f, std::forward<A>(a)...));
}

}  // namespace infkv_tools
