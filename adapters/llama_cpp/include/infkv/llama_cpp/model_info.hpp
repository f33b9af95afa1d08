// infkv llama.cpp adapter: what the adapter reads from a model through llama.h (the RoPE
// parameters needed to re-rotate cached keys after a position shift) and each layer's RoPE as its
// key node in the graph applied it.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include <llama.h>

#include "capture.hpp"

#include <infkv/cpu/rope.hpp>
#include <infkv/error.hpp>

namespace infkv::llama_cpp {

/// A model's metadata value as a string, or nothing when the key is absent.
inline std::optional<std::string> meta_string(const llama_model* model, const std::string& key) {
  char buf[256];
  const std::int32_t n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof buf);
  if (n < 0) return std::nullopt;
  if (std::size_t(n) < sizeof buf) return std::string(buf, std::size_t(n));
  std::string big(std::size_t(n) + 1, '\0');
  llama_model_meta_val_str(model, key.c_str(), big.data(), big.size());
  big.resize(std::size_t(n));
  return big;
}

/// A numeric metadata value, or `fallback` when absent or not a number.
inline double meta_number(const llama_model* model, const std::string& key, double fallback) {
  const auto s = meta_string(model, key);
  if (!s) return fallback;
  char* end = nullptr;
  const double v = std::strtod(s->c_str(), &end);
  return end == s->c_str() ? fallback : v;
}

/// How a model's keys can be re-rotated on the host.
struct rope_info {
  cpu::rope params{};     ///< theta, rotary dims, style, frequency scale
  bool supported = true;  ///< false for rope kinds the CPU backend cannot re-rotate (M-RoPE, vision)
  bool has_rope = true;   ///< false when the model uses no RoPE (nothing to re-rotate)
  std::string kind;       ///< "norm", "neox", "none", or the unsupported kind
};

/// RoPE parameters of `model`: style from llama_model_rope_type, theta and rotary dims from the
/// `<arch>.rope.freq_base` / `<arch>.rope.dimension_count` metadata, frequency scale from
/// llama_model_rope_freq_scale_train; a non-zero `ctx_freq_base` / `ctx_freq_scale` (the context
/// parameters' overrides) wins. Per-dimension frequency factors (Llama 3 `rope_freqs`) and YaRN
/// are not modelled: keys re-rotated on the host are then approximate.
inline rope_info model_rope(const llama_model* model, float ctx_freq_base = 0.f, float ctx_freq_scale = 0.f) {
  if (model == nullptr) infkv::fail("infkv: model = null: a llama_model is required");
  rope_info info;
  switch (llama_model_rope_type(model)) {
    case LLAMA_ROPE_TYPE_NORM: info.params.style = cpu::rope_style::normal, info.kind = "norm"; break;
    case LLAMA_ROPE_TYPE_NEOX: info.params.style = cpu::rope_style::neox, info.kind = "neox"; break;
    case LLAMA_ROPE_TYPE_NONE: info.has_rope = false, info.kind = "none"; break;
    default: info.supported = false, info.kind = "mrope/vision"; break;
  }
  const std::string arch = meta_string(model, "general.architecture").value_or("llama");
  info.params.theta = meta_number(model, arch + ".rope.freq_base", 10000.0);
  info.params.dims = std::int32_t(meta_number(model, arch + ".rope.dimension_count", 0.0));
  info.params.freq_scale = llama_model_rope_freq_scale_train(model);
  if (!(info.params.freq_scale > 0.0)) info.params.freq_scale = 1.0;
  if (ctx_freq_base > 0.f) info.params.theta = ctx_freq_base;
  if (ctx_freq_scale > 0.f) info.params.freq_scale = ctx_freq_scale;
  return info;
}

/// The RoPE a layer's key node applied (capture.hpp's node_rope) as re-rotation parameters:
/// exact for normal and NeoX RoPE without YaRN or frequency factors (the kind says "approximate"
/// otherwise: neither is modelled); M-RoPE / vision kinds are unsupported (as in model_rope).
inline rope_info node_rope_info(const node_rope& n) {
  rope_info info;
  info.params.theta = n.freq_base;
  info.params.dims = n.n_dims;
  info.params.freq_scale = n.freq_scale;
  if (n.mode == LLAMA_ROPE_TYPE_NORM) {
    info.params.style = cpu::rope_style::normal, info.kind = "norm";
  } else if (n.mode == LLAMA_ROPE_TYPE_NEOX) {
    info.params.style = cpu::rope_style::neox, info.kind = "neox";
  } else {
    info.supported = false, info.kind = "mrope/vision";
  }
  if (n.ext_factor != 0.f || n.freq_factors) info.kind += " (YaRN or frequency factors: approximate)";
  return info;
}

}  // namespace infkv::llama_cpp
