// infkv-stream --passkey: a random 5-digit pass key stated once, DISTANCE tokens of neutral
// filler, then the question. The prompt streams through the bounded cache in blocks with
// eviction exactly as the text stream does (the question is the last block); the answer is
// decoded greedily and succeeds when it contains the number.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "runner.hpp"

namespace stream {

/// One passkey prompt, already tokenized.
struct passkey_prompt {
  std::string number;
  std::vector<llama_token> context;   ///< intro, filler, the key, DISTANCE tokens of filler
  std::vector<llama_token> question;  ///< the last block
  std::int64_t prefix_units = 0;      ///< filler sentences before the key (varies per trial)
  std::int64_t key_at = 0;            ///< token index where the key statement starts
  std::int64_t distance = 0;          ///< tokens from the end of the key statement to the question
  /// Tokens of the key statement.
  std::int64_t key_tokens() const { return std::int64_t(context.size()) - distance - key_at; }
};

/// The outcome of one trial.
struct passkey_trial {
  std::int64_t trial = 0;
  passkey_prompt prompt;
  std::string answer;
  std::int64_t key_kept = 0;  ///< tokens of the key statement still cached when the question starts
  bool success = false;
  double seconds = 0.0;
};

/// One policy's trials.
struct passkey_run {
  std::string policy;
  std::vector<passkey_trial> trials;
  std::string note;  ///< why the policy was skipped, if it was
  double rate() const {
    std::int64_t ok = 0;
    for (const auto& t : trials) ok += t.success;
    return trials.empty() ? 0.0 : double(ok) / double(trials.size());
  }
};

/// The prompt of trial `trial`: number and key position drawn from (seed, trial).
inline passkey_prompt make_passkey(const llama_model* m, std::int64_t distance, std::int64_t trial, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(trial));
  passkey_prompt p;
  p.number = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
  const std::string intro =
      "There is an important piece of information hidden inside a lot of irrelevant text. Find it and remember it.";
  const std::string filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  const std::string key = " The pass key is " + p.number + ". Remember it. " + p.number + " is the pass key.";
  const std::int64_t unit = std::int64_t(tokenize(m, filler, false).size());
  const std::int64_t reps = std::max<std::int64_t>(1, (distance + unit - 1) / unit);
  p.prefix_units = std::uniform_int_distribution<std::int64_t>(0, reps / 4)(rng);
  std::string before = intro;
  for (std::int64_t i = 0; i < p.prefix_units; ++i) before += filler;
  std::string text = before + key;
  p.key_at = std::int64_t(tokenize(m, before, true).size());
  const std::int64_t key_end = std::int64_t(tokenize(m, text, true).size());
  for (std::int64_t i = 0; i < reps; ++i) text += filler;
  p.context = tokenize(m, text, true);
  p.distance = std::int64_t(p.context.size()) - key_end;
  p.question = tokenize(m, " What is the pass key? The pass key is", false);
  return p;
}

/// Runs one trial through a fresh runner of policy `k`, generating up to `gen` tokens.
inline passkey_trial run_passkey(const llama_model* m, kind k, const settings& s, passkey_prompt prompt,
                                 std::int64_t trial, std::int64_t gen) {
  const auto t0 = std::chrono::steady_clock::now();
  passkey_trial out;
  out.trial = trial;
  out.prompt = std::move(prompt);
  const auto& ctx = out.prompt.context;
  const auto& q = out.prompt.question;
  const std::int64_t max_feed = std::max<std::int64_t>(s.block, std::int64_t(q.size()) + gen);
  auto r = make_runner(m, k, s, std::int64_t(ctx.size() + q.size()) + gen, max_feed);
  for (std::size_t at = 0; at < ctx.size(); at += std::size_t(s.block)) {
    r->feed(std::span(ctx).subspan(at, std::min(std::size_t(s.block), ctx.size() - at)));
    r->evict();
  }
  out.key_kept = r->cached_in(out.prompt.key_at, out.prompt.key_at + out.prompt.key_tokens());
  r->feed(q);
  const llama_vocab* vocab = llama_model_get_vocab(m);
  std::int64_t last = std::int64_t(q.size()) - 1;
  for (std::int64_t g = 0; g < gen; ++g) {
    const llama_token t = argmax(r->logits(last));
    if (llama_vocab_is_eog(vocab, t)) break;
    out.answer += piece(m, t);
    if (g + 1 < gen) r->feed(std::vector<llama_token>{t}, true), last = 0;
  }
  out.success = out.answer.find(out.prompt.number) != std::string::npos;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace stream
