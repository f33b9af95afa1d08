// infkv-stream's retrieval tests. --passkey: a random 5-digit pass key stated once, DISTANCE tokens
// of a repeated filler sentence, then the question (a sanity check: anything that differs from
// the filler stands out). --needle: a needle statement (a number, a word or a short fact) planted
// into real prose from --text, DISTANCE tokens of that prose after it, then the question. Either
// prompt streams through the bounded cache in blocks with eviction exactly as the text stream
// does (the question is the last block); the answer is decoded greedily and succeeds when it
// contains the needle (case-insensitive).
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "runner.hpp"

namespace stream {

/// One retrieval prompt, already tokenized.
struct passkey_prompt {
  std::string kind = "passkey";       ///< passkey, or the needle's kind: number, word, fact
  std::string needle;                 ///< what the answer must contain
  std::vector<llama_token> context;   ///< intro, filler, the key, DISTANCE tokens of filler
  std::vector<llama_token> question;  ///< the last block
  std::int64_t prefix = 0;            ///< filler sentences (passkey) or prose tokens (needle) before the key
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
  p.needle = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
  const std::string intro =
      "There is an important piece of information hidden inside a lot of irrelevant text. Find it and remember it.";
  const std::string filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  const std::string key = " The pass key is " + p.needle + ". Remember it. " + p.needle + " is the pass key.";
  const std::int64_t unit = std::int64_t(tokenize(m, filler, false).size());
  const std::int64_t reps = std::max<std::int64_t>(1, (distance + unit - 1) / unit);
  p.prefix = std::uniform_int_distribution<std::int64_t>(0, reps / 4)(rng);
  std::string before = intro;
  for (std::int64_t i = 0; i < p.prefix; ++i) before += filler;
  std::string text = before + key;
  p.key_at = std::int64_t(tokenize(m, before, true).size());
  const std::int64_t key_end = std::int64_t(tokenize(m, text, true).size());
  for (std::int64_t i = 0; i < reps; ++i) text += filler;
  p.context = tokenize(m, text, true);
  p.distance = std::int64_t(p.context.size()) - key_end;
  p.question = tokenize(m, " What is the pass key? The pass key is", false);
  return p;
}

/// The needle kinds, in the order trials cycle through them.
inline constexpr std::array<std::string_view, 3> needle_kinds{"number", "word", "fact"};

/// The most prose tokens a needle prompt of `distance` takes (a prefix of up to distance / 4, and
/// up to 64 to reach line starts): --text must hold more.
inline std::int64_t needle_text_needed(std::int64_t distance) { return distance + distance / 4 + 64; }

/// The prompt of needle trial `trial` of kind `kind`: an intro, `prefix` tokens of prose (drawn
/// in [0, distance / 4]) from a random line start of `text`, the needle statement on its own
/// line, the next `distance` tokens of prose, the question. `line_start[i]`: token i of `text`
/// begins a line.
inline passkey_prompt make_needle(const llama_model* m, std::span<const llama_token> text,
                                  const std::vector<bool>& line_start, std::int64_t distance, std::string_view kind,
                                  std::int64_t trial, std::uint64_t seed) {
  static constexpr std::array<std::string_view, 12> words{"pineapple", "telescope", "violin", "umbrella", "volcano", "penguin",
                                                          "lantern", "bicycle", "saxophone", "avocado", "kangaroo", "helicopter"};
  static constexpr std::array<std::string_view, 8> names{"Marta", "Tobias", "Ingrid", "Kenji", "Amara", "Lukas", "Priya", "Mateo"};
  static constexpr std::array<std::string_view, 8> cities{"Lisbon", "Oslo", "Nairobi", "Kyoto", "Toronto", "Santiago",
                                                          "Helsinki", "Melbourne"};
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(trial) + 7777u);
  const auto pick = [&](const auto& list) { return std::string(list[std::size_t(rng() % list.size())]); };
  passkey_prompt p;
  p.kind = std::string(kind);
  std::string statement, question;
  if (kind == "number") {
    p.needle = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
    statement = "The magic number is " + p.needle + ".";
    question = "\nWhat is the magic number? The magic number is";
  } else if (kind == "word") {
    p.needle = pick(words);
    statement = "The secret word is " + p.needle + ".";
    question = "\nWhat is the secret word? The secret word is";
  } else {
    const std::string name = pick(names);
    p.needle = pick(cities);
    statement = name + " lives in " + p.needle + ".";
    question = "\nWhere does " + name + " live? " + name + " lives in";
  }
  p.prefix = std::uniform_int_distribution<std::int64_t>(0, distance / 4)(rng);
  const auto n = std::int64_t(text.size());
  const std::int64_t span = p.prefix + distance + 64;  // prose used, plus room to reach a line start
  if (n <= span) infkv_examples::fail("--needle = {}: the --text has {} tokens, the prompt needs {} of its prose", distance, n, span);
  std::int64_t at = std::uniform_int_distribution<std::int64_t>(1, n - span)(rng);
  while (at < n - span + 32 && !line_start[std::size_t(at)]) ++at;
  std::int64_t cut = at + p.prefix;  // the needle goes at the line start nearest after the prefix
  while (cut < at + p.prefix + 32 && !line_start[std::size_t(cut)]) ++cut;
  p.prefix = cut - at;
  p.context = tokenize(m, "There is an important fact hidden inside a long text. Find it and remember it.\n", true);
  p.context.insert(p.context.end(), text.begin() + at, text.begin() + cut);
  p.key_at = std::int64_t(p.context.size());
  const auto stmt = tokenize(m, statement + "\n", false);
  p.context.insert(p.context.end(), stmt.begin(), stmt.end());
  p.context.insert(p.context.end(), text.begin() + cut, text.begin() + cut + distance);
  p.distance = distance;
  p.question = tokenize(m, question, false);
  return p;
}

/// True when the answer contains the needle, ignoring case.
inline bool contains_needle(std::string answer, std::string needle) {
  const auto lower = [](std::string& x) {
    for (auto& c : x) c = char(std::tolower(static_cast<unsigned char>(c)));
  };
  lower(answer), lower(needle);
  return answer.find(needle) != std::string::npos;
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
  out.success = contains_needle(out.answer, out.prompt.needle);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace stream
