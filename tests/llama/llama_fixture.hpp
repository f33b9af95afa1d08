// Shared helpers of the llama.cpp adapter tests: tiny random-weight models written by
// make_tiny_llama.py, contexts routed to a session, deterministic token streams.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <infkv/llama_cpp.hpp>

namespace infkv_test {

using infkv::llama_cpp::context_ptr;
using infkv::llama_cpp::model_ptr;

/// The tiny llama model with `layers` layers (64-dim embeddings, 4 heads, 2 KV heads, vocab 128).
inline model_ptr tiny_model(int layers) {
  return infkv::llama_cpp::load_model(std::string(INFKV_TEST_MODEL_DIR) + "/tiny-llama-" + std::to_string(layers) +
                                      ".gguf");
}

/// The tiny Gemma 3 model: 4 layers, sliding window 16 on layers 0 and 2 (RoPE base 100), global
/// layers 1 and 3 (base 10000); 64-dim embeddings, 4 heads, 2 KV heads, vocab 128.
inline model_ptr tiny_gemma3() {
  return infkv::llama_cpp::load_model(std::string(INFKV_TEST_MODEL_DIR) + "/tiny-gemma3.gguf");
}

/// Context settings the tests vary.
struct ctx_config {
  bool flash_attn = false;
  std::uint32_t n_ctx = 256;
  std::uint32_t n_ubatch = 64;
  ggml_type type_k = GGML_TYPE_F32;
};

inline llama_context_params context_params(const ctx_config& c) {
  auto p = llama_context_default_params();
  p.n_ctx = c.n_ctx;
  p.n_batch = c.n_ctx;
  p.n_ubatch = c.n_ubatch;
  p.n_threads = 1;
  p.n_threads_batch = 1;
  p.no_perf = true;
  p.flash_attn_type = c.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  p.type_k = c.type_k;
  p.type_v = c.type_k;
  return p;
}

/// A context created from parameters attached to `s`, and bound to it.
inline context_ptr bound_context(llama_model* m, infkv::llama_cpp::session& s, const ctx_config& c = {}) {
  auto p = context_params(c);
  s.attach(p);
  context_ptr ctx(llama_init_from_model(m, p));
  REQUIRE(ctx != nullptr);
  s.bind(ctx.get());
  return ctx;
}

/// A context of `seqs` sequences in one unified cache (the second the session's scratch sequence:
/// it shares the session's cells without copying them), created from parameters attached to `s`,
/// and bound to it.
inline context_ptr shared_context(llama_model* m, infkv::llama_cpp::session& s, const ctx_config& c,
                                  std::uint32_t seqs = 2) {
  auto p = context_params(c);
  p.n_seq_max = seqs;
  p.kv_unified = true;
  s.attach(p);
  context_ptr ctx(llama_init_from_model(m, p));
  REQUIRE(ctx != nullptr);
  s.bind(ctx.get());
  return ctx;
}

/// Decodes `toks` into `s`, 16 tokens a decode.
inline void feed(infkv::llama_cpp::session& s, const std::vector<llama_token>& toks) {
  for (std::size_t i = 0; i < toks.size(); i += 16)
    REQUIRE(s.decode(std::span(toks).subspan(i, std::min<std::size_t>(16, toks.size() - i))) == 0);
}

/// A plain context (no session).
inline context_ptr plain_context(llama_model* m, const ctx_config& c = {}) {
  auto p = context_params(c);
  context_ptr ctx(llama_init_from_model(m, p));
  REQUIRE(ctx != nullptr);
  return ctx;
}

/// `n` token ids in [3, 128) from a fixed seed.
inline std::vector<llama_token> random_tokens(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<llama_token> d(3, 127);
  std::vector<llama_token> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

/// Logits of the last output of the last decode.
inline std::vector<float> last_logits(llama_context* ctx) {
  const float* l = llama_get_logits_ith(ctx, -1);
  REQUIRE(l != nullptr);
  const int n = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
  return {l, l + n};
}

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float m = 0.f;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

/// Decodes `tokens` into a plain context at positions 0, 1, ... (sequence 0); returns the status.
inline int plain_decode(llama_context* ctx, const std::vector<llama_token>& tokens, int first_pos = 0) {
  llama_batch b = llama_batch_init(int(tokens.size()), 0, 1);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    b.token[i] = tokens[i];
    b.pos[i] = first_pos + int(i);
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = i + 1 == tokens.size();
  }
  b.n_tokens = int(tokens.size());
  const int rc = llama_decode(ctx, b);
  llama_batch_free(b);
  return rc;
}

/// The positions the session holds.
inline std::set<std::int64_t> positions(const infkv::llama_cpp::session& s) {
  std::set<std::int64_t> p;
  for (const auto& t : s.tokens()) p.insert(t.pos);
  return p;
}

/// The positions of `before` that no run of `removed` (an eviction's removed runs) covers.
template <class Runs>
std::set<std::int64_t> not_removed(const std::set<std::int64_t>& before, const Runs& removed) {
  std::set<std::int64_t> kept;
  for (const auto p : before)
    if (std::none_of(removed.begin(), removed.end(), [&](const auto& run) { return p >= run.begin && p < run.end; }))
      kept.insert(p);
  return kept;
}

/// The positions 0..n-1.
inline std::set<std::int64_t> range_set(std::int64_t n) {
  std::set<std::int64_t> p;
  for (std::int64_t i = 0; i < n; ++i) p.insert(i);
  return p;
}

/// A caller's own eval callback that requests an abort while the second micro-batch computes.
struct abort_after_first_ubatch {
  int kcur0_seen = 0;
  bool abort = false;
  static bool eval(ggml_tensor* t, bool ask, void* user) {
    auto* self = static_cast<abort_after_first_ubatch*>(user);
    const bool want = t->op == GGML_OP_ROPE && std::string(ggml_get_name(t)) == "Kcur-0";
    if (ask) return want;
    if (want && ++self->kcur0_seen == 2) self->abort = true;
    return true;
  }
  static bool should_abort(void* user) { return static_cast<abort_after_first_ubatch*>(user)->abort; }
};

/// Checks the session's bookkeeping against the llama memory directly. With sliding-window layers
/// llama.cpp reports the minimum of their cache, which may have dropped tokens older than the
/// window: anywhere from the session's minimum to its maximum.
inline void check_memory_matches(const infkv::llama_cpp::session& s) {
  llama_memory_t mem = llama_get_memory(s.context());
  const auto seq = s.options().seq;
  if (s.size() == 0) {
    CHECK(llama_memory_seq_pos_min(mem, seq) == -1);
    CHECK(llama_memory_seq_pos_max(mem, seq) == -1);
    return;
  }
  std::int64_t lo = s.tokens()[0].pos, hi = lo;
  for (const auto& t : s.tokens()) lo = std::min(lo, t.pos), hi = std::max(hi, t.pos);
  const llama_pos got_lo = llama_memory_seq_pos_min(mem, seq);
  if (llama_model_n_swa(llama_get_model(s.context())) > 0) {
    CHECK(got_lo >= lo);
    CHECK(got_lo <= hi);
  } else {
    CHECK(got_lo == lo);
  }
  CHECK(llama_memory_seq_pos_max(mem, seq) == hi);
}

/// Checks that the llama memory holds exactly the session's cells: decoding the remaining room,
/// llama_n_ctx - size(), succeeds and one token more does not fit. Fills the context.
inline void check_room(infkv::llama_cpp::session& s, unsigned seed = 99) {
  const auto room = std::int64_t(llama_n_ctx(s.context())) - s.size();
  REQUIRE(room > 0);
  const auto fill = random_tokens(std::size_t(room), seed);
  const std::size_t step = llama_n_batch(s.context());
  for (std::size_t i = 0; i < fill.size(); i += step)
    REQUIRE(s.decode(std::span(fill).subspan(i, std::min(step, fill.size() - i))) == 0);
  CHECK(s.decode(random_tokens(1, seed + 1)) == 1);
  check_memory_matches(s);
}

}  // namespace infkv_test
