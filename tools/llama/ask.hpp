// Questions asked of a llama.cpp context without changing what it streams: plain decodes on a
// sequence, the forced choice among candidate answers (teacher forcing) and a greedy answer, on
// sequence 1 sharing every cell of sequence 0. Used by infkv-stream's runners and infkv-video.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <llama.h>

#include <infkv/error.hpp>
#include <infkv/llama_cpp/session.hpp>

#include "errors.hpp"
#include "llama_util.hpp"

namespace stream {

/// A question's answer: the greedy text, and the log-probability of each candidate answer.
struct answer {
  std::string text;
  std::vector<double> logprobs;
};

/// Decodes `toks` on sequence `seq` at positions pos0, pos0 + 1, ... with logits from batch
/// index `out_from` on (llama_get_logits_ith(ctx, out_from + i) is then the i-th output); the
/// time and tokens go to `st`. A failing llama_decode throws.
inline void decode_plain(llama_context* ctx, std::span<const llama_token> toks, std::int64_t pos0,
                         std::int64_t out_from, llama_seq_id seq, infkv::llama_cpp::session_stats& st) {
  llama_batch b = llama_batch_init(std::int32_t(toks.size()), 0, 1);
  for (std::size_t i = 0; i < toks.size(); ++i) {
    b.token[i] = toks[i];
    b.pos[i] = llama_pos(pos0 + std::int64_t(i));
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = std::int64_t(i) >= out_from;
  }
  b.n_tokens = std::int32_t(toks.size());
  std::int32_t rc = 0;
  {
    const infkv::llama_cpp::stopwatch w{st.decode};
    rc = llama_decode(ctx, b);
  }
  ++st.decodes, st.decoded_tokens += std::int64_t(toks.size());
  llama_batch_free(b);
  if (rc != 0) infkv_tools::engine_fail("llama_decode of {} tokens returned {}", toks.size(), rc);
}

/// The logits of batch index `i` of the last decode.
inline std::span<const float> logits_at(llama_context* ctx, std::int64_t i) {
  const float* l = llama_get_logits_ith(ctx, std::int32_t(i));
  if (l == nullptr) infkv_tools::fail("no logits for batch index {} of the last decode", i);
  return {l, std::size_t(llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx))))};
}

/// Decodes `question` on sequence `seq` from position `pos0`, then each candidate answer after
/// it (teacher forcing: its log-probability after the question; its cells are removed again
/// before the next), then up to `gen` greedy tokens in all (stopping at end of generation).
inline answer answer_on(llama_context* ctx, llama_seq_id seq, std::span<const llama_token> question,
                        std::span<const std::vector<llama_token>> candidates, std::int64_t pos0, std::int64_t gen,
                        infkv::llama_cpp::session_stats& st) {
  INFKV_REQUIRE(!question.empty(), "question tokens", question.size(), "must not be empty");
  const llama_model* model = llama_get_model(ctx);
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const auto q = std::int64_t(question.size());
  decode_plain(ctx, question, pos0, q - 1, seq, st);
  const auto l = logits_at(ctx, q - 1);
  const std::vector<float> after(l.begin(), l.end());  // the next token's logits after the question
  llama_token t = argmax(after);
  pos0 += q;
  answer a;
  for (const auto& c : candidates) {
    INFKV_REQUIRE(!c.empty(), "candidate answer tokens", c.size(), "must not be empty");
    double lp = -token_nll(after, c[0]);
    if (c.size() > 1) {
      decode_plain(ctx, std::span(c).first(c.size() - 1), pos0, 0, seq, st);
      for (std::size_t i = 1; i < c.size(); ++i) lp -= token_nll(logits_at(ctx, std::int64_t(i - 1)), c[i]);
      if (!llama_memory_seq_rm(llama_get_memory(ctx), seq, llama_pos(pos0), -1))
        infkv_tools::engine_fail("llama_memory_seq_rm(seq {}, {}, -1) after scoring an answer = false", seq, pos0);
    }
    a.logprobs.push_back(lp);
  }
  std::vector<llama_token> next;
  for (std::int64_t g = 0; g < gen && !llama_vocab_is_eog(vocab, t); ++g) {
    a.text += piece(model, t);
    if (g + 1 == gen) break;
    next.assign(1, t);
    decode_plain(ctx, next, pos0++, 0, seq, st);
    t = argmax(logits_at(ctx, 0));
  }
  return a;
}

/// Asks `question` without changing sequence 0: on sequence 1, which shares every cell of
/// sequence 0 (llama_memory_seq_cp copies nothing in one unified cache), at the positions from
/// `next_pos` (the stream's next), then removes sequence 1: its own cells are freed, the shared
/// ones stay sequence 0's. A session bound to sequence 0 never sees these decodes. The context
/// needs two sequences and room for the question + the longest candidate + `gen` cells.
inline answer ask_aside(llama_context* ctx, std::int64_t next_pos, std::span<const llama_token> question,
                        std::span<const std::vector<llama_token>> candidates, std::int64_t gen,
                        infkv::llama_cpp::session_stats& st) {
  llama_memory_t mem = llama_get_memory(ctx);
  llama_memory_seq_cp(mem, 0, 1, -1, -1);
  answer a = answer_on(ctx, 1, question, candidates, next_pos, gen, st);
  if (!llama_memory_seq_rm(mem, 1, -1, -1) || llama_memory_seq_pos_max(mem, 1) != -1)
    infkv_tools::engine_fail("sequence 1 not removed after a question (llama_memory_seq_rm, seq_pos_max = {})",
                             llama_memory_seq_pos_max(mem, 1));
  return a;
}

}  // namespace stream
