// infkv-stream's retrieval tests. --passkey: a random 5-digit pass key stated once, then a repeated
// filler sentence (a sanity check: anything that differs from the filler stands out). --needle:
// needle statements (a number, a word or a short fact, each about its own person) planted into
// real prose from --text, --needles of them per stream, --needle-gap tokens of prose apart. The
// stream goes through the bounded cache in blocks with eviction exactly as the text stream does;
// DISTANCE tokens after each key (for each DISTANCE asked) the question is asked on a second
// llama.cpp sequence that shares the cache (runner::ask), so asking changes nothing the stream
// goes on with. The greedy answer succeeds when it contains the needle (case-insensitive).
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "runner.hpp"

namespace stream {

/// One question asked along a retrieval stream.
struct probe {
  std::int64_t trial = 0;        ///< the key's number (keys counted over every stream)
  std::string kind = "passkey";  ///< passkey, or the needle's kind: number, word, fact
  std::string needle;            ///< what the answer must contain
  std::vector<llama_token> question;
  std::int64_t key_at = 0;   ///< stream index where the key statement starts
  std::int64_t key_end = 0;  ///< ... and ends
  std::int64_t at = 0;       ///< asked after the stream's first `at` tokens
  std::int64_t prefix = 0;   ///< filler sentences (passkey) or prose tokens (needle) before the stream's first key
  std::int64_t distance() const { return at - key_end; }
  std::int64_t key_tokens() const { return key_end - key_at; }
};

/// A token stream and the questions asked along it (ascending `at`).
struct retrieval_stream {
  std::vector<llama_token> tokens;
  std::vector<probe> probes;
};

/// The outcome of one question.
struct passkey_trial {
  probe p;
  std::string answer;
  std::int64_t key_kept = 0;    ///< tokens of the key statement cached when the question is asked
  double needle_logprob = 0.0;  ///< log-probability of " needle" right after the question
  bool success = false;
  double seconds = 0.0;  ///< asking and answering
};

/// One policy's questions.
struct passkey_run {
  std::string policy;
  std::vector<passkey_trial> trials;
  std::string note;  ///< why the policy was skipped, if it was
  double seconds = 0.0;
};

/// Successes over questions.
inline double success_rate(std::span<const passkey_trial> t) {
  std::int64_t ok = 0;
  for (const auto& x : t) ok += x.success;
  return t.empty() ? 0.0 : double(ok) / double(t.size());
}

/// Asks each distance in `distances` of the key that occupies [key_at, key_end) of `s.tokens`.
inline void add_probes(retrieval_stream& s, const probe& key, std::span<const std::int64_t> distances) {
  for (const std::int64_t d : distances) {
    probe p = key;
    p.at = key.key_end + d;
    s.probes.push_back(std::move(p));
  }
}

/// Sorts the questions by where they are asked (keys in order at equal places).
inline void order_probes(retrieval_stream& s) {
  std::stable_sort(s.probes.begin(), s.probes.end(), [](const probe& a, const probe& b) { return a.at < b.at; });
}

/// Passkey stream `trial`: number and key position drawn from (seed, trial); the filler runs to
/// the farthest distance, and the question is asked at each distance (rounded up to whole filler
/// sentences).
inline retrieval_stream make_passkey(const llama_model* m, std::span<const std::int64_t> distances, std::int64_t trial,
                                     std::uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(trial));
  probe key;
  key.trial = trial;
  key.needle = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
  const std::string intro =
      "There is an important piece of information hidden inside a lot of irrelevant text. Find it and remember it.";
  const std::string filler =
      " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
  const std::string statement = " The pass key is " + key.needle + ". Remember it. " + key.needle + " is the pass key.";
  const std::int64_t unit = std::int64_t(tokenize(m, filler, false).size());
  const auto reps_of = [&](std::int64_t d) { return std::max<std::int64_t>(1, (d + unit - 1) / unit); };
  const std::int64_t far = *std::max_element(distances.begin(), distances.end());
  key.prefix = std::uniform_int_distribution<std::int64_t>(0, reps_of(far) / 4)(rng);
  std::string text = intro;
  for (std::int64_t i = 0; i < key.prefix; ++i) text += filler;
  key.key_at = std::int64_t(tokenize(m, text, true).size());
  text += statement;
  key.key_end = std::int64_t(tokenize(m, text, true).size());
  for (std::int64_t i = 0; i < reps_of(far); ++i) text += filler;
  retrieval_stream s;
  s.tokens = tokenize(m, text, true);
  key.question = tokenize(m, " What is the pass key? The pass key is", false);
  std::vector<std::int64_t> whole;  // the distances rounded up to whole filler sentences, within the stream
  for (const std::int64_t d : distances)
    whole.push_back(std::min<std::int64_t>(reps_of(d) * unit, std::int64_t(s.tokens.size()) - key.key_end));
  add_probes(s, key, whole);
  order_probes(s);
  return s;
}

/// A kind of needle: a statement about a person and the question that asks it back ("{name}":
/// the person's name, "{v}": the value). Values are drawn from `values`, or are random digits
/// (`digits` of them) when it is empty.
struct needle_kind {
  std::string_view name, statement, question;
  std::span<const std::string_view> values;
  int digits = 0;
};

namespace detail {
inline constexpr std::array<std::string_view, 12> words{"pineapple", "telescope",  "umbrella",   "volcano",
                                                        "penguin",   "lantern",    "bicycle",    "avocado",
                                                        "kangaroo",  "helicopter", "trampoline", "compass"};
inline constexpr std::array<std::string_view, 8> cities{"Lisbon",  "Oslo",     "Nairobi",  "Kyoto",
                                                        "Toronto", "Santiago", "Helsinki", "Melbourne"};
inline constexpr std::array<std::string_view, 8> colours{"turquoise", "magenta", "orange", "lavender",
                                                         "beige",     "maroon",  "teal",   "pink"};
inline constexpr std::array<std::string_view, 8> pets{"hamster",  "parrot",   "iguana", "rabbit",
                                                      "goldfish", "tortoise", "ferret", "canary"};
inline constexpr std::array<std::string_view, 8> cars{"Volvo", "Toyota", "Renault", "Ford",
                                                      "Honda", "Fiat",   "Skoda",   "Tesla"};
inline constexpr std::array<std::string_view, 8> jobs{"dentist",   "pilot",       "chemist",    "plumber",
                                                      "librarian", "firefighter", "journalist", "architect"};
inline constexpr std::array<std::string_view, 8> sports{"tennis",    "chess", "hockey",  "volleyball",
                                                        "badminton", "golf",  "cricket", "baseball"};
inline constexpr std::array<std::string_view, 8> languages{"Portuguese", "Swahili", "Finnish", "Japanese",
                                                           "Polish",     "Turkish", "Dutch",   "Korean"};
inline constexpr std::array<std::string_view, 8> drinks{"espresso", "lemonade", "cocoa",     "cider",
                                                        "smoothie", "kombucha", "milkshake", "iced tea"};
inline constexpr std::array<std::string_view, 8> fruits{"mango",  "kiwi", "banana",  "papaya",
                                                        "cherry", "lime", "coconut", "blueberry"};
}  // namespace detail

/// The needle kinds, in the order keys cycle through them: every kind asks a different question,
/// so the needles of one stream (up to one of each kind) never answer each other's question.
inline constexpr std::array<needle_kind, 12> needle_kinds{{
    {"number", "{name}'s magic number is {v}.", "What is {name}'s magic number? {name}'s magic number is", {}, 5},
    {"word", "{name}'s secret word is {v}.", "What is {name}'s secret word? {name}'s secret word is", detail::words},
    {"fact", "{name} lives in {v}.", "Where does {name} live? {name} lives in", detail::cities},
    {"colour", "{name}'s favourite colour is {v}.", "What is {name}'s favourite colour? {name}'s favourite colour is",
     detail::colours},
    {"pet", "{name}'s pet is a {v}.", "What is {name}'s pet? {name}'s pet is a", detail::pets},
    {"car", "{name} drives a {v}.", "What car does {name} drive? {name} drives a", detail::cars},
    {"job", "{name} works as a {v}.", "What is {name}'s job? {name} works as a", detail::jobs},
    {"sport", "{name} plays {v} every week.", "What does {name} play every week? {name} plays", detail::sports},
    {"code", "{name}'s door code is {v}.", "What is {name}'s door code? {name}'s door code is", {}, 4},
    {"language", "{name} speaks {v}.", "What language does {name} speak? {name} speaks", detail::languages},
    {"drink", "{name}'s favourite drink is {v}.", "What is {name}'s favourite drink? {name}'s favourite drink is",
     detail::drinks},
    {"fruit", "{name}'s favourite fruit is {v}.", "What is {name}'s favourite fruit? {name}'s favourite fruit is",
     detail::fruits},
}};

/// The people needles are about (a stream's needles are about different people).
inline constexpr std::array<std::string_view, 16> needle_names{"Marta",  "Tobias", "Ingrid", "Kenji",  "Amara", "Lukas",
                                                               "Priya",  "Mateo",  "Sofia",  "Dmitri", "Leila", "Oscar",
                                                               "Hannah", "Rafael", "Yuki",   "Nadia"};

/// The kind called `name`, or nullptr.
inline const needle_kind* find_needle_kind(std::string_view name) {
  for (const auto& k : needle_kinds)
    if (k.name == name) return &k;
  return nullptr;
}

/// `pattern` with "{name}" replaced by `name` and "{v}" by `value`.
inline std::string fill_needle(std::string_view pattern, std::string_view name, std::string_view value) {
  return fmt::format(fmt::runtime(pattern), fmt::arg("name", name), fmt::arg("v", value));
}

/// The layout of the needle streams.
struct needle_layout {
  std::vector<std::int64_t> distances;  ///< tokens from the end of a needle statement to its question
  std::vector<std::string> kinds;       ///< kinds the needles cycle through (names in needle_kinds)
  std::int64_t per_stream = 1;          ///< needles in one stream
  std::int64_t gap = 1024;              ///< prose tokens between two needles of a stream
  /// The most prose tokens one stream takes (the prefix before the first needle is up to one gap,
  /// or a quarter of the farthest distance when the stream holds one needle; up to 32 tokens per
  /// needle to reach a line start): --text must hold more.
  std::int64_t text_needed() const { return first_gap() + (per_stream - 1) * gap + farthest() + 32 * per_stream + 32; }
  /// The most prose before the first needle.
  std::int64_t first_gap() const { return per_stream == 1 ? farthest() / 4 : gap; }
  std::int64_t farthest() const { return *std::max_element(distances.begin(), distances.end()); }
};

/// Needle stream `index` holding keys `first`, first + 1, ..., first + n - 1: an intro, then from
/// a random line start of `text`, a random prefix of prose, each needle statement on its own line
/// with `gap` tokens of prose between them, and prose up to the last question. Needle values,
/// names and positions are drawn from (seed, index). `line_start[i]`: token i of `text` begins a line.
inline retrieval_stream make_needles(const llama_model* m, std::span<const llama_token> text,
                                     const std::vector<bool>& line_start, const needle_layout& lay, std::int64_t first,
                                     std::int64_t n, std::int64_t index, std::uint64_t seed) {
  INFKV_REQUIRE(n >= 1 && n <= std::int64_t(lay.kinds.size()), "needles in a stream", n, "must be in [1, ",
                lay.kinds.size(), "] (the needle kinds): each asks its own question");
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(index) + 7777u);
  std::array<std::string_view, 16> names = needle_names;
  std::shuffle(names.begin(), names.end(), rng);
  const auto total = std::int64_t(text.size());
  const std::int64_t span = lay.text_needed();
  if (total <= span)
    infkv_tools::fail("--needle: the --text has {} tokens, a stream needs {} of its prose", total, span);
  const auto line_after = [&](std::int64_t i, std::int64_t limit) {  // the first line start in [i, limit), else i
    for (std::int64_t j = i; j < limit; ++j)
      if (line_start[std::size_t(j)]) return j;
    return i;
  };
  std::int64_t cur = line_after(std::uniform_int_distribution<std::int64_t>(1, total - span)(rng), total - span + 32);
  const std::int64_t start = cur;
  retrieval_stream s;
  s.tokens = tokenize(m, "There are important facts hidden inside a long text. Find them and remember them.\n", true);
  const std::int64_t prefix = std::uniform_int_distribution<std::int64_t>(0, lay.first_gap())(rng);
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t cut = line_after(cur + (j == 0 ? prefix : lay.gap), cur + (j == 0 ? prefix : lay.gap) + 32);
    s.tokens.insert(s.tokens.end(), text.begin() + cur, text.begin() + cut);
    cur = cut;
    probe key;
    key.prefix = j == 0 ? cut - start : 0;
    key.trial = first + j;
    key.kind = lay.kinds[std::size_t(key.trial) % lay.kinds.size()];
    const std::string name(names[std::size_t(j)]);
    const needle_kind* nk = find_needle_kind(key.kind);
    INFKV_REQUIRE(nk != nullptr, "needle kind", key.kind, "is not one of the kinds infkv-stream knows");
    if (nk->values.empty())
      key.needle = std::to_string(std::uniform_int_distribution<int>(int(std::pow(10, nk->digits - 1)),
                                                                     int(std::pow(10, nk->digits)) - 1)(rng));
    else
      key.needle = std::string(nk->values[std::size_t(rng() % nk->values.size())]);
    const std::string statement = fill_needle(nk->statement, name, key.needle);
    const std::string question = "\n" + fill_needle(nk->question, name, key.needle);
    key.key_at = std::int64_t(s.tokens.size());
    const auto stmt = tokenize(m, statement + "\n", false);
    s.tokens.insert(s.tokens.end(), stmt.begin(), stmt.end());
    key.key_end = std::int64_t(s.tokens.size());
    key.question = tokenize(m, question, false);
    add_probes(s, key, lay.distances);
  }
  order_probes(s);
  const std::int64_t end_at = s.probes.back().at;
  s.tokens.insert(s.tokens.end(), text.begin() + cur, text.begin() + cur + (end_at - std::int64_t(s.tokens.size())));
  return s;
}

/// `s` cut to the questions asked within its first `limit` tokens (and the tokens up to the last
/// of them); no questions and no tokens when none is.
inline retrieval_stream within(const retrieval_stream& s, std::int64_t limit) {
  retrieval_stream out;
  for (const auto& p : s.probes)
    if (p.at <= limit) out.probes.push_back(p);
  if (!out.probes.empty()) out.tokens.assign(s.tokens.begin(), s.tokens.begin() + out.probes.back().at);
  return out;
}

/// True when the answer contains the needle, ignoring case.
inline bool contains_needle(std::string answer, std::string needle) {
  const auto lower = [](std::string& x) {
    for (auto& c : x) c = char(std::tolower(static_cast<unsigned char>(c)));
  };
  lower(answer), lower(needle);
  return answer.find(needle) != std::string::npos;
}

/// The most cells a question and its answer take.
inline std::int64_t ask_room(const llama_model* m, const retrieval_stream& s, std::int64_t gen) {
  std::size_t q = 0;
  for (const auto& p : s.probes) q = std::max(q, p.question.size() + tokenize(m, " " + p.needle, false).size());
  return std::int64_t(q) + gen;
}

/// Streams `rs` through a fresh runner of policy `k` in blocks of s.block (a block is cut where a
/// question is asked), evicting after each; asks each question where it belongs and decodes up
/// to `gen` answer tokens. `done(trial)` is called after each question.
inline std::vector<passkey_trial> run_retrieval(const llama_model* m, kind k, settings s, const retrieval_stream& rs,
                                                std::int64_t gen,
                                                const std::function<void(const passkey_trial&)>& done) {
  s.ask_room = ask_room(m, rs, gen);
  auto r = make_runner(m, k, s, std::int64_t(rs.tokens.size()), s.block);
  std::vector<passkey_trial> out;
  const auto n = std::int64_t(rs.tokens.size());
  std::size_t next = 0;
  for (std::int64_t at = 0; at < n;) {
    std::int64_t end = std::min(n, (at / s.block + 1) * s.block);
    if (next < rs.probes.size()) end = std::min(end, rs.probes[next].at);
    r->feed(std::span(rs.tokens).subspan(std::size_t(at), std::size_t(end - at)));
    r->evict();
    at = end;
    for (; next < rs.probes.size() && rs.probes[next].at == at; ++next) {
      const auto t0 = std::chrono::steady_clock::now();
      passkey_trial t;
      t.p = rs.probes[next];
      t.key_kept = r->cached_in(t.p.key_at, t.p.key_end);
      const auto a = r->ask(t.p.question, tokenize(m, " " + t.p.needle, false), gen);
      t.answer = a.text, t.needle_logprob = a.expected_logprob;
      t.success = contains_needle(t.answer, t.p.needle);
      t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      out.push_back(t);
      if (done) done(out.back());
    }
  }
  INFKV_REQUIRE(next == rs.probes.size(), "retrieval questions asked", next, "of ", rs.probes.size(),
                ": a question lies beyond the stream");
  return out;
}

}  // namespace stream
