// infkv llama.cpp adapter: owning handles for models and contexts, one-time backend set-up with
// only llama.cpp's errors printed, and model loading that names the file when it fails.
#pragma once

#include <algorithm>
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

namespace detail {
/// llama.cpp's error messages of this thread while a caller collects them (model loading), so
/// that a failure is reported once, in infkv's error, with llama.cpp's reasons in it.
struct log_collector {
  bool active = false;
  std::string text;
};
inline log_collector& collector() {
  thread_local log_collector c;
  return c;
}
}  // namespace detail

/// Initialises llama.cpp's backends once per process; only its error messages reach stderr
/// (or the error infkv raises, while a model loads).
inline void init_backend() {
  static const bool once = [] {
    llama_log_set(
        [](ggml_log_level level, const char* text, void*) {
          if (level != GGML_LOG_LEVEL_ERROR) return;
          auto& c = detail::collector();
          if (c.active)
            c.text += text;
          else
            std::fprintf(stderr, "[llama.cpp] %s", text);
        },
        nullptr);
    llama_backend_init();
    return true;
  }();
  (void)once;
}

/// Loads a GGUF model on the CPU; throws engine_error naming `arg`, the path and llama.cpp's
/// reasons when it cannot.
inline model_ptr load_model(const std::string& path, const char* arg = "model") {
  init_backend();
  auto mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  auto& c = detail::collector();
  c = {true, {}};
  model_ptr m(llama_model_load_from_file(path.c_str(), mp));
  std::string why = std::move(c.text);
  c = {};
  if (!m) {
    std::string joined;  // llama.cpp's lines, "; "-separated
    for (std::size_t a = 0, b; a < why.size(); a = b + 1) {
      b = std::min(why.find('\n', a), why.size());
      if (b > a) joined += (joined.empty() ? "" : "; ") + why.substr(a, b - a);
    }
    why = std::move(joined);
    infkv::raise<engine_error>("infkv: ", arg, " = ", path, ": llama.cpp cannot load it as a GGUF model",
                               why.empty() ? "" : " (llama.cpp: ", why, why.empty() ? "" : ")");
  }
  return m;
}

}  // namespace infkv::llama_cpp
