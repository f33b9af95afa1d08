// Selects 4 of 16 slots with StreamingLLM through the installed package; exit 0 on success.
#include <infkv/cpu.hpp>

int main() {
  auto tokens = infkv::text_tokens(16);
  infkv::layer_inputs<> in{.tokens = tokens};
  auto keep = infkv::cpu::select(infkv::streaming_llm{}, {.capacity = 4, .sinks = 1}, in);
  const auto runs = keep.kept_runs(tokens);
  return keep.size(0) == 4 && runs.size() == 2 && runs[0].end == 1 && runs[1].begin == 13 ? 0 : 1;
}
