// infkv: the library's one exception type and the argument checks that raise it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace infkv {

/// Raised for every invalid argument: the message names the argument and its value.
class error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw error(os.str());
}

/// Throws `infkv::error("infkv: <arg> = <value>: <why>")` unless `ok`.
template <class Value, class... Why>
void require(bool ok, std::string_view arg, const Value& value, const Why&... why) {
  if (!ok) fail("infkv: ", arg, " = ", value, ": ", why...);
}

}  // namespace detail
}  // namespace infkv
