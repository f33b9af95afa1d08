// infkv-stream: llama.cpp helpers: model loading, tokenization, next-token losses from logits,
// greedy choice, and the memory figures the stream reports (KV bytes, process RSS).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

#include <llama.h>

#include <infkv/error.hpp>
#include <infkv/llama_cpp/handles.hpp>

#include "errors.hpp"

namespace stream {

using infkv::llama_cpp::context_ptr;
using infkv::llama_cpp::model_ptr;

/// Loads a GGUF model on the CPU; throws infkv::error naming --model and the path when it cannot.
inline model_ptr load_model(const std::string& path) { return infkv::llama_cpp::load_model(path, "--model"); }

/// Shape figures of a model that the memory accounting needs.
struct model_shape {
  std::int32_t layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, n_ctx_train = 0;

  explicit model_shape(const llama_model* m)
      : layers(llama_model_n_layer(m)),
        heads(llama_model_n_head(m)),
        kv_heads(llama_model_n_head_kv(m)),
        head_dim(llama_model_n_embd(m) / std::max(1, llama_model_n_head(m))),
        vocab(llama_vocab_n_tokens(llama_model_get_vocab(m))),
        n_ctx_train(llama_model_n_ctx_train(m)) {}

  /// Bytes of K and V for `cells` cache cells of every layer with element type `t`.
  std::int64_t kv_bytes(std::int64_t cells, ggml_type t = GGML_TYPE_F16) const {
    return cells * layers * 2 * std::int64_t(kv_heads) * head_dim * std::int64_t(ggml_type_size(t)) /
           std::int64_t(ggml_blck_size(t));
  }
  /// Bytes of the session's f16 key copies (every layer) for `cells` cached tokens.
  std::int64_t key_copy_bytes(std::int64_t cells) const { return cells * layers * kv_heads * head_dim * 2; }
};

/// Context parameters shared by every run: `n_ctx` cells, batches up to `n_batch` tokens, `seqs`
/// sequences over one shared cache (2: retrieval asks its questions on sequence 1).
inline llama_context_params context_params(std::uint32_t n_ctx, std::uint32_t n_batch, int threads,
                                           std::uint32_t seqs = 1) {
  auto p = llama_context_default_params();
  p.n_ctx = n_ctx;
  p.n_batch = n_batch;
  p.n_ubatch = std::min<std::uint32_t>(n_batch, 512);
  p.n_seq_max = seqs;
  p.kv_unified = true;  // one cache all sequences share: llama_memory_seq_cp then copies nothing
  p.n_threads = threads;
  p.n_threads_batch = threads;
  p.no_perf = true;
  return p;
}

/// Tokenizes `text` (special tokens such as BOS added as the model asks).
inline std::vector<llama_token> tokenize(const llama_model* m, const std::string& text, bool add_special) {
  const llama_vocab* v = llama_model_get_vocab(m);
  std::vector<llama_token> out(text.size() / 2 + 16);
  std::int32_t n = llama_tokenize(v, text.data(), std::int32_t(text.size()), out.data(), std::int32_t(out.size()),
                                  add_special, false);
  if (n < 0) {
    out.resize(std::size_t(-n));
    n = llama_tokenize(v, text.data(), std::int32_t(text.size()), out.data(), std::int32_t(out.size()), add_special,
                       false);
  }
  if (n < 0) infkv_tools::fail("infkv-stream: llama_tokenize failed on {} bytes of text", text.size());
  out.resize(std::size_t(n));
  return out;
}

/// Refuses what is not UTF-8 text (the tokenizer would take any bytes and the perplexity would
/// mean nothing): a NUL byte, or a byte that starts no valid UTF-8 sequence (overlong forms and
/// surrogates included), named by its offset.
inline void check_utf8_text(const std::string& path, std::string_view text) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned c = byte(i);
    if (c == 0) infkv_tools::fail("--text = {}: a NUL byte at offset {}: the file is not text", path, i);
    const std::size_t len = c < 0x80                 ? 1
                            : c >= 0xC2 && c <= 0xDF ? 2
                            : c >= 0xE0 && c <= 0xEF ? 3
                            : c >= 0xF0 && c <= 0xF4 ? 4
                                                     : 0;
    bool ok = len != 0 && i + len <= text.size();
    for (std::size_t k = 1; ok && k < len; ++k) ok = (byte(i + k) & 0xC0) == 0x80;
    if (ok && len > 2) {  // the second byte's range: no overlong forms, surrogates or code points past U+10FFFF
      const unsigned d = byte(i + 1);
      ok = !(c == 0xE0 && d < 0xA0) && !(c == 0xED && d >= 0xA0) && !(c == 0xF0 && d < 0x90) &&
           !(c == 0xF4 && d >= 0x90);
    }
    if (!ok)
      infkv_tools::fail(
          "--text = {}: byte 0x{:02x} at offset {} is not UTF-8 (convert the file, e.g. "
          "iconv -f latin1 -t utf-8)",
          path, c, i);
    i += len;
  }
}

/// The first `limit` tokens of the file `path` (all of it when limit <= 0). Tokenizes a growing
/// prefix, cut at a line end, so that a short run does not tokenize a whole book.
inline std::vector<llama_token> tokenize_file(const llama_model* m, const std::string& path, std::int64_t limit) {
  std::ifstream f(path, std::ios::binary);
  if (!f) infkv_tools::fail("--text = {}: cannot open the file", path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.empty()) infkv_tools::fail("--text = {}: the file is empty", path);
  check_utf8_text(path, text);
  for (std::size_t bytes = limit > 0 ? std::size_t(limit) * 6 + 4096 : text.size();; bytes *= 2) {
    std::size_t cut = std::min(bytes, text.size());
    if (cut < text.size()) cut = text.rfind('\n', cut) == std::string::npos ? cut : text.rfind('\n', cut) + 1;
    auto toks = tokenize(m, text.substr(0, cut), true);
    if (limit > 0 && std::int64_t(toks.size()) >= limit) {
      toks.resize(std::size_t(limit));
      return toks;
    }
    if (cut == text.size()) return toks;
  }
}

/// Text of one token.
inline std::string piece(const llama_model* m, llama_token t) {
  char buf[256];
  const std::int32_t n = llama_token_to_piece(llama_model_get_vocab(m), t, buf, sizeof buf, 0, false);
  return n > 0 ? std::string(buf, std::size_t(n)) : std::string();
}

/// True when a token whose text is `p` ends a sentence or a line of text (a newline in it, or
/// `.`, `!` or `?` last, spaces aside).
inline bool ends_sentence(std::string_view p) {
  if (p.find('\n') != std::string_view::npos) return true;
  while (!p.empty() && p.back() == ' ') p.remove_suffix(1);
  return !p.empty() && (p.back() == '.' || p.back() == '!' || p.back() == '?');
}

/// Numbers a text's sentences and lines as it streams by (infkv-stream's --whole-segments): a
/// token after a sentence's or line's end starts the next segment, unless it begins with a
/// newline, which stays with the sentence it ends (a needle statement's line is one segment).
class sentence_counter {
 public:
  /// The segment of token `t` of `m`.
  std::int32_t next(const llama_model* m, llama_token t) {
    const std::string p = piece(m, t);
    if (ended_ && (p.empty() || p.front() != '\n')) ++segment_;
    ended_ = ends_sentence(p);
    return segment_;
  }

 private:
  std::int32_t segment_ = 0;
  bool ended_ = false;
};

/// Negative log-likelihood of `target` under one row of logits (log-softmax, in double).
inline double token_nll(std::span<const float> logits, llama_token target) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float v : logits) sum += std::exp(double(v - mx));
  return std::log(sum) + double(mx) - double(logits[std::size_t(target)]);
}

/// The most likely token of one row of logits.
inline llama_token argmax(std::span<const float> logits) {
  return llama_token(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// The 1-minute load average (/proc/loadavg), or NaN.
inline double load_average() {
  std::ifstream f("/proc/loadavg");
  double v = NAN;
  f >> v;
  return v;
}

/// Bytes of memory available now (MemAvailable in /proc/meminfo), or -1 when unknown.
inline double memory_available() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  double kb = 0;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024.0;
  return -1;
}

/// A field of /proc/self/status in bytes (VmHWM: peak RSS, VmRSS: RSS now), or -1.
inline std::int64_t status_bytes(std::string_view field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.size() > field.size() && line.compare(0, field.size(), field) == 0 && line[field.size()] == ':')
      return std::stoll(line.substr(field.size() + 1)) * 1024;
  return -1;
}

/// Resident set size of this process in bytes (/proc/self/statm), or 0 when unavailable.
inline std::int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return 0;
  return resident * std::int64_t(sysconf(_SC_PAGESIZE));
}

}  // namespace stream
