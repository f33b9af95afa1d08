// infkv llama.cpp adapter: owning handles for models and contexts, one-time backend set-up with
// only llama.cpp's errors printed, and model loading that names the file when it fails.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include <llama.h>

#include <infkv/error.hpp>

namespace infkv::llama_cpp {

struct model_deleter {
  void operator()(llama_model* m) const { llama_model_free(m); }
};
struct context_deleter {
  void operator()(llama_context* c) const { llama_free(c); }
};
/// Owning handle of a llama_model.
using model_ptr = std::unique_ptr<llama_model, model_deleter>;
/// Owning handle of a llama_context.
using context_ptr = std::unique_ptr<llama_context, context_deleter>;

/// Initialises llama.cpp's backends once per process; only its error messages reach stderr.
inline void init_backend() {
  static const bool once = [] {
    llama_log_set(
        [](ggml_log_level level, const char* text, void*) {
          if (level == GGML_LOG_LEVEL_ERROR) std::fprintf(stderr, "[llama.cpp] %s", text);
        },
        nullptr);
    llama_backend_init();
    return true;
  }();
  (void)once;
}

/// Loads a GGUF model on the CPU; throws infkv::error naming `arg` and the path when it cannot.
inline model_ptr load_model(const std::string& path, const char* arg = "model") {
  init_backend();
  auto mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  model_ptr m(llama_model_load_from_file(path.c_str(), mp));
  if (!m) infkv::detail::raise<engine_error>("infkv: ", arg, " = ", path, ": llama.cpp cannot load it as a GGUF model");
  return m;
}

}  // namespace infkv::llama_cpp
