// infkv llama.cpp adapter: observing the compute graph through `cb_eval`. The observer asks for
// the post-RoPE query and key nodes of every layer (`Qcur-<layer>` and `Kcur-<layer>` whose op is
// GGML_OP_ROPE; several nodes share each name) and copies their rows out as f32, token-major,
// across however many micro-batches llama_decode splits a batch into, or hands each node to its
// owner, which copies what it keeps straight from the graph. Works with flash attention
// on and off (those nodes exist either way). On request it also copies the values (`Vcur-<layer>`,
// the node reshaped or viewed to [head_dim, heads, tokens]). It can also watch, without asking for
// any node (the graph then runs unsplit), where llama.cpp writes each token's K and V: the
// `cache_k_l<layer>` / `cache_v_l<layer>` tensors a GGML_OP_SET_ROWS node writes, and that node's
// cell indices (its third source, an I64 input tensor on the host, set before the graph runs), so
// that the owner can read the cache's own rows later. Public llama.h / ggml API only.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <llama.h>

#include <infkv/dtype.hpp>
#include <infkv/error.hpp>

namespace infkv::llama_cpp {

/// Adds the seconds from its construction to its destruction to `total`.
class stopwatch {
 public:
  explicit stopwatch(double& total) : total_(total) {}
  stopwatch(const stopwatch&) = delete;
  stopwatch& operator=(const stopwatch&) = delete;
  ~stopwatch() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }

 private:
  double& total_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

/// The RoPE a layer's key node applied, read from the node's op_params (ggml_rope_ext's layout):
/// each layer's own parameters (Gemma 3's sliding layers turn with another base than its global
/// ones), as llama.cpp used them.
struct node_rope {
  bool seen = false;
  std::int32_t n_dims = 0;
  std::int32_t mode = 0;  ///< GGML_ROPE_TYPE_*: 0 normal, 2 NeoX, others (M-RoPE, vision)
  float freq_base = 0.f, freq_scale = 0.f;
  float ext_factor = 0.f;     ///< YaRN: 0 when off
  bool freq_factors = false;  ///< per-dimension frequency factors (Llama 3's rope_freqs)
};

/// What one observed node is.
enum class node_kind : std::uint8_t { query = 1, key = 2, value = 3 };

/// The rows of one observed node, readable on the host: [n_tokens][heads][head_dim] at
/// `base + i * nb2 + h * nb1 + e * nb0`, f32 or f16 (as llama.cpp computed them).
struct node_rows {
  std::int32_t layer = 0;
  node_kind kind = node_kind::query;
  const char* base = nullptr;
  dtype type = dtype::f32;
  std::int64_t head_dim = 0, heads = 0, n_tokens = 0;
  std::int64_t nb0 = 0, nb1 = 0, nb2 = 0;

  /// Row (token i, head h) as `t` (f32, f16 or bf16) into `out` (head_dim elements); `tmp`
  /// holds head_dim floats when the conversion goes through f32.
  void row_to(std::int64_t i, std::int64_t h, dtype t, void* out, float* tmp) const {
    const char* row = base + i * nb2 + h * nb1;
    const bool packed = nb0 == std::int64_t(size_of(type));
    if (packed && t == type) {
      std::memcpy(out, row, std::size_t(head_dim) * size_of(type));
      return;
    }
    float* f = t == dtype::f32 ? static_cast<float*>(out) : tmp;
    if (packed)
      to_f32(type, row, f, head_dim);
    else
      for (std::int64_t e = 0; e < head_dim; ++e) to_f32(type, row + e * nb0, f + e, 1);
    if (t != dtype::f32) from_f32(t, f, out, head_dim);
  }
};

/// Post-RoPE Q and K rows of one layer seen during one decode: f32, [n_tokens][heads][head_dim]
/// (kept only by an observer without a handler), and what was seen of each node.
struct layer_rows {
  std::int32_t n_head = 0;
  std::int32_t n_head_kv = 0;
  std::int32_t head_dim = 0;
  std::int64_t n_q = 0;  ///< query rows (tokens) seen
  std::int64_t n_k = 0;  ///< key rows (tokens) seen
  std::int64_t n_v = 0;  ///< value rows (tokens) seen (graph_observer with values)
  std::vector<float> q;
  std::vector<float> k;
  std::vector<float> v;  ///< [n_v][n_head_kv][head_dim] when values are captured
  node_rope rope;        ///< the key node's RoPE
  /// Where the decode's K rows went (observe.cells): the layer's K and V cache tensors, the cells
  /// of the tokens in batch order, and whether the V cache holds rows (flash attention; false:
  /// llama.cpp stores V transposed, element by element).
  const ggml_tensor* k_cache = nullptr;
  const ggml_tensor* v_cache = nullptr;
  bool v_rows = false;
  std::vector<std::int64_t> cells;
};

/// What one decode observes: the Q, K and V rows it copies out (each asks for its graph nodes,
/// which splits the graph there), and the cells its K rows are written to (asks for nothing).
struct observe_set {
  bool queries = true, keys = true, values = false, cells = false;
  bool splits() const { return queries || keys || values; }
};

/// The layer of a llama.cpp cache tensor named "cache_<tag>k_l<layer>" (`kind` 'k') or
/// "cache_<tag>v_l<layer>" ('v'), or -1.
inline std::int32_t cache_layer_of(const char* name, char kind) {
  const std::string_view n(name);
  if (n.substr(0, 6) != "cache_") return -1;
  const std::size_t at = n.rfind("_l");
  if (at == std::string_view::npos || at < 7 || n[at - 1] != kind || (at - 1 > 6 && n[at - 2] != '_')) return -1;
  std::int32_t layer = 0;
  if (at + 2 == n.size()) return -1;
  for (char c : n.substr(at + 2)) {
    if (c < '0' || c > '9' || layer > 1'000'000) return -1;
    layer = layer * 10 + (c - '0');
  }
  return layer;
}

/// The RoPE parameters of a ROPE node.
inline node_rope rope_of(const ggml_tensor* t) {
  node_rope r;
  r.seen = true;
  r.n_dims = t->op_params[1];
  r.mode = t->op_params[2];
  std::memcpy(&r.freq_base, &t->op_params[5], sizeof(float));
  std::memcpy(&r.freq_scale, &t->op_params[6], sizeof(float));
  std::memcpy(&r.ext_factor, &t->op_params[7], sizeof(float));
  r.freq_factors = t->src[2] != nullptr;
  return r;
}

/// Layer index of a node named "<prefix>-<layer>", or -1 when the name is anything else.
inline std::int32_t layer_of(const char* name, std::string_view prefix) {
  const std::string_view n(name);
  if (n.size() <= prefix.size() + 1 || n.substr(0, prefix.size()) != prefix || n[prefix.size()] != '-') return -1;
  std::int32_t layer = 0;
  for (char c : n.substr(prefix.size() + 1)) {
    if (c < '0' || c > '9' || layer > 1'000'000) return -1;
    layer = layer * 10 + (c - '0');
  }
  return layer;
}

/// The rows of a [head_dim, heads, n_tokens] f32 or f16 node, on the host (`scratch` holds a copy
/// when the node lives in device memory).
inline node_rows rows_of(const ggml_tensor* t, std::int32_t layer, node_kind kind, std::vector<char>& scratch) {
  if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16)
    infkv::raise<engine_error>("infkv: llama.cpp node ", ggml_get_name(t), " has type ", ggml_type_name(t->type),
                               ": only f32 and f16 query/key nodes can be observed");
  if (t->ne[3] != 1)
    infkv::raise<engine_error>("infkv: llama.cpp node ", ggml_get_name(t), " has ne[3] = ", t->ne[3], ": expected 1");
  const char* base = nullptr;
  if (t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) {
    base = static_cast<const char*>(t->data);
  } else {  // device memory: copy the tensor's bytes to the host first
    scratch.resize(ggml_nbytes(t));
    ggml_backend_tensor_get(t, scratch.data(), 0, scratch.size());
    base = scratch.data();
  }
  if (base == nullptr) infkv::raise<engine_error>("infkv: llama.cpp node ", ggml_get_name(t), " has no data");
  return {layer,
          kind,
          base,
          t->type == GGML_TYPE_F32 ? dtype::f32 : dtype::f16,
          t->ne[0],
          t->ne[1],
          t->ne[2],
          std::int64_t(t->nb[0]),
          std::int64_t(t->nb[1]),
          std::int64_t(t->nb[2])};
}

/// Appends every row of `r` to `out` as f32.
inline void append_rows(const node_rows& r, std::vector<float>& out) {
  const std::size_t at = out.size();
  out.resize(at + std::size_t(r.head_dim * r.heads * r.n_tokens));
  float* dst = out.data() + at;
  for (std::int64_t i = 0; i < r.n_tokens; ++i)
    for (std::int64_t h = 0; h < r.heads; ++h)
      r.row_to(i, h, dtype::f32, dst + (i * r.heads + h) * r.head_dim, nullptr);
}

/// Collects post-RoPE Q and K of every layer while active. Install it into the context
/// parameters before the context is created; it keeps and forwards any callback already set.
/// Not copyable or movable: the context holds its address.
class graph_observer {
 public:
  /// Hands each observed node's rows to its owner, from inside llama_decode.
  using handler = std::function<void(const node_rows&)>;

  /// Observes `n_layers` layers; `values`: also the value rows (`Vcur-<layer>`). Without a
  /// handler every row is copied out as f32 (layers()); with one, each node goes to it (and
  /// layers() records only what was seen: counts, heads, RoPE).
  explicit graph_observer(std::int32_t n_layers, bool values = false, handler to = {})
      : layers_(std::size_t(n_layers > 0 ? n_layers : 0)), values_(values), to_(std::move(to)) {
    INFKV_REQUIRE(n_layers > 0, "n_layers", n_layers, "must be > 0");
  }
  graph_observer(const graph_observer&) = delete;
  graph_observer& operator=(const graph_observer&) = delete;

  /// Routes `p.cb_eval` to this observer; a callback already in `p` is still called for every node.
  void install(llama_context_params& p) {
    if (p.cb_eval == &graph_observer::callback && p.cb_eval_user_data == this) return;
    next_cb_ = p.cb_eval;
    next_user_ = p.cb_eval_user_data;
    p.cb_eval = &graph_observer::callback;
    p.cb_eval_user_data = this;
  }

  /// Starts collecting (clears the rows of the previous decode): every row kind the observer
  /// was made for.
  void begin() { begin({.queries = true, .keys = true, .values = values_}); }
  /// Starts collecting what `what` names (values only where the observer was made for them).
  void begin(observe_set what) {
    for (auto& l : layers_)
      l.n_q = l.n_k = l.n_v = 0, l.q.clear(), l.k.clear(), l.v.clear(), l.rope = {}, l.cells.clear();
    what.values = what.values && values_;
    what_ = what;
    error_.clear();
    seconds_ = 0;
    active_ = true;
  }
  /// Stops collecting.
  void end() { active_ = false; }

  /// Rows collected since begin(), per layer.
  std::vector<layer_rows>& layers() { return layers_; }
  /// The error that made the observer abort the last compute, or empty.
  const std::string& error() const { return error_; }
  /// Seconds spent copying rows out of the graph since begin().
  double seconds() const { return seconds_; }

  /// The `cb_eval` entry point (user data: the observer).
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    return static_cast<graph_observer*>(user)->eval(t, ask);
  }

 private:
  bool eval(ggml_tensor* t, bool ask) {
    if (ask) {
      next_wants_ = next_cb_ != nullptr && next_cb_(t, true, next_user_);
      if (active_ && what_.cells && t->op == GGML_OP_SET_ROWS && error_.empty()) {
        try {
          note_cells(t);
        } catch (const std::exception& e) {  // never unwind through C code: the session reads error()
          error_ = e.what();
        }
      }
      return next_wants_ || (active_ && match(t) != 0);
    }
    bool ok = true;
    if (active_ && error_.empty()) {
      try {
        const stopwatch w{seconds_};
        observe(t);
      } catch (const std::exception& e) {  // never unwind through C code: abort the compute
        error_ = e.what();
        ok = false;
      }
    }
    if (next_wants_) ok = next_cb_(t, false, next_user_) && ok;
    return ok;
  }

  /// 1 for a post-RoPE query node, 2 for a post-RoPE key node, 3 for a value node shaped
  /// [head_dim, heads, tokens] (when values are captured), 0 otherwise.
  int match(const ggml_tensor* t) const {
    if (!what_.splits()) return 0;
    const char* name = ggml_get_name(t);
    if (what_.values && (t->op == GGML_OP_RESHAPE || t->op == GGML_OP_VIEW) && name[0] == 'V' &&
        layer_of(name, "Vcur") >= 0)
      return 3;
    if (t->op != GGML_OP_ROPE) return 0;
    if (what_.queries && name[0] == 'Q' && layer_of(name, "Qcur") >= 0) return 1;
    if (what_.keys && name[0] == 'K' && layer_of(name, "Kcur") >= 0) return 2;
    return 0;
  }

  /// A SET_ROWS node writing a layer's K (or V) cache: records the cache tensor and, for K, the
  /// cells of the tokens. ggml_set_rows(a, b, c) makes a view of the destination a with src[0] = b
  /// (the rows), src[1] = c (the indices: an input on the host, set before the graph runs) and
  /// src[2] = a.
  void note_cells(const ggml_tensor* t) {
    const ggml_tensor* dst = t->src[2];
    if (dst == nullptr) return;
    const ggml_tensor* root = dst;
    while (root->view_src != nullptr) root = root->view_src;
    const char* name = ggml_get_name(root);
    const std::int32_t kl = cache_layer_of(name, 'k'), vl = kl >= 0 ? -1 : cache_layer_of(name, 'v');
    if (kl < 0 && vl < 0) return;
    const std::int32_t layer = kl >= 0 ? kl : vl;
    INFKV_REQUIRE(layer < std::int32_t(layers_.size()), "layer", layer, "llama.cpp cache tensor ", name,
                  " is beyond the model's ", layers_.size(), " layers");
    layer_rows& l = layers_[std::size_t(layer)];
    if (vl >= 0) {  // rows (flash attention) or transposed: one row per cell, or one element per row
      l.v_cache = root;
      l.v_rows = dst->ne[0] == root->ne[0];
      return;
    }
    const ggml_tensor* idx = t->src[1];
    if (idx == nullptr || (idx->type != GGML_TYPE_I64 && idx->type != GGML_TYPE_I32) || idx->data == nullptr ||
        (idx->buffer != nullptr && !ggml_backend_buffer_is_host(idx->buffer)) || ggml_nelements(idx) != idx->ne[0])
      infkv::raise<engine_error>("infkv: llama.cpp writes ", name,
                                 " through indices infkv cannot read on the host: its cells are unknown");
    l.k_cache = root;
    for (std::int64_t i = 0; i < idx->ne[0]; ++i)
      l.cells.push_back(idx->type == GGML_TYPE_I64 ? static_cast<const std::int64_t*>(idx->data)[i]
                                                   : static_cast<const std::int32_t*>(idx->data)[i]);
  }

  void observe(const ggml_tensor* t) {
    const int kind = match(t);
    if (kind == 0) return;
    const std::int32_t layer = layer_of(ggml_get_name(t), kind == 1 ? "Qcur" : kind == 2 ? "Kcur" : "Vcur");
    INFKV_REQUIRE(layer < std::int32_t(layers_.size()), "layer", layer, "llama.cpp node ", ggml_get_name(t),
                  " is beyond the model's ", layers_.size(), " layers");
    layer_rows& l = layers_[std::size_t(layer)];
    const auto d = std::int32_t(t->ne[0]), heads = std::int32_t(t->ne[1]);
    if (l.head_dim == 0) l.head_dim = d;
    INFKV_REQUIRE(d == l.head_dim, "head_dim", d, "of ", ggml_get_name(t), " differs from the layer's ", l.head_dim);
    if (kind != 3) {  // values have as many heads as the keys (checked by the caller once both are seen)
      std::int32_t& h = kind == 1 ? l.n_head : l.n_head_kv;
      if (h == 0) h = heads;
      INFKV_REQUIRE(heads == h, "heads", heads, "of ", ggml_get_name(t), " changed from ", h);
    }
    const node_rows rows = rows_of(t, layer, node_kind(kind), scratch_);
    if (to_)
      to_(rows);
    else
      append_rows(rows, kind == 1 ? l.q : kind == 2 ? l.k : l.v);
    (kind == 1 ? l.n_q : kind == 2 ? l.n_k : l.n_v) += t->ne[2];
    if (kind == 2) l.rope = rope_of(t);
  }

  std::vector<layer_rows> layers_;
  std::vector<char> scratch_;
  std::string error_;
  double seconds_ = 0;
  ggml_backend_sched_eval_callback next_cb_ = nullptr;
  void* next_user_ = nullptr;
  bool next_wants_ = false;
  bool active_ = false;
  bool values_ = false;
  observe_set what_{};
  handler to_;
};

}  // namespace infkv::llama_cpp
