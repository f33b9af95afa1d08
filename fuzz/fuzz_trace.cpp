// Fuzz target: the trace reader (examples/trace_io.hpp) on the bytes a user hands it: truncated
// headers, lying offsets, huge shapes, bad JSON. Either it raises an infkv::error, or the trace
// it returns is consistent: every layer's Q, K, V hold n_tokens x heads x head_dim floats.
#include <cstdint>
#include <string>

#include "input.hpp"
#include "trace_io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  trace_io::trace t;
  try {
    t = trace_io::to_trace(trace_io::parse_safetensors(bytes, "fuzz"));
  } catch (const infkv::error&) {
    return 0;
  }
  INFKV_FUZZ_ASSERT(t.n_tokens > 0);
  for (const auto& l : t.layers) {
    INFKV_FUZZ_ASSERT(l.n_head > 0 && l.n_head_kv > 0 && l.head_dim > 0 && l.n_head % l.n_head_kv == 0);
    INFKV_FUZZ_ASSERT(std::int64_t(l.q.size()) == t.n_tokens * l.n_head * l.head_dim);
    INFKV_FUZZ_ASSERT(std::int64_t(l.k.size()) == t.n_tokens * l.n_head_kv * l.head_dim && l.v.size() == l.k.size());
  }
  INFKV_FUZZ_ASSERT(t.segments.empty() || std::int64_t(t.segments.size()) == t.n_tokens);
  return 0;
}
