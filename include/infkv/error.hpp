// infkv: the library's exception types and the argument checks that raise them.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace infkv {

/// Base of everything infkv throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// An invalid argument: the message names the argument and its value.
class invalid_argument : public error {
 public:
  using error::error;
};

/// An engine or device refused or failed a call (llama.cpp memory calls, model loading, CUDA):
/// the message names the call, its arguments and what state was left.
class engine_error : public error {
 public:
  using error::error;
};

/// Building infkv's messages and errors (for adapters and bindings too): `cat` concatenates,
/// `fail` throws `invalid_argument`, `raise<E>` any `infkv::error`, `fail_arg` the standard
/// "infkv: <arg> = <value>: <why>" message.

/// Concatenates `parts` with operator<<.
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

/// Throws `infkv::invalid_argument` with the concatenated parts.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw invalid_argument(cat(parts...));
}

/// Throws `E` (an `infkv::error`) with the concatenated parts.
template <class E, class... Parts>
[[noreturn]] void raise(const Parts&... parts) {
  throw E(cat(parts...));
}

/// Throws `infkv::invalid_argument("infkv: <arg> = <value>: <why>")`. Cold: only called once a
/// check has failed, so the message (and any string the caller builds for it) costs nothing on
/// the path that passes.
template <class Arg, class Value, class... Why>
[[noreturn]] void fail_arg(const Arg& arg, const Value& value, const Why&... why) {
  fail("infkv: ", arg, " = ", value, ": ", why...);
}

}  // namespace infkv

/// Checks `ok`; when it fails, throws `infkv::invalid_argument("infkv: <arg> = <value>: <why>")`.
/// The arguments after `ok` are evaluated only on failure.
#define INFKV_REQUIRE(ok, ...)        \
  do {                                \
    if (!(ok)) [[unlikely]]           \
      ::infkv::fail_arg(__VA_ARGS__); \
  } while (0)
