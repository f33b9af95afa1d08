// infkv-stream's needles, without a model: the kinds of needle statement, the people they are
// about, how the needles of one stream are drawn (several people per kind, distinct values within
// a kind, so that a value must be bound to its person), how a statement and its question are laid
// out in tokens (any tokenizer), and how a greedy answer is graded (the value as the answer's
// first words, case-insensitive, on word boundaries).
//
// Layout: a statement is planted as  NL PREFIX VALUE SUFFIX NL  ("\nMarta's car is a" " Volvo" "."
// "\n"), each piece tokenised on its own, so it always stands on its own line; the question is
//  NL QUESTION NL PREFIX  ("\nQuestion: What car does Marta drive?" "\n" "Marta's car is a"): it
// ends with the statement's own prefix tokens, the very tokens planted, so the model only has to
// complete the value. The forced choice scores every candidate value of the kind as
// VALUE SUFFIX (" Volvo" "."): the suffix ends the value, so that no candidate wins by being the
// start of a longer one.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "errors.hpp"

namespace stream {

/// The needle protocol's version, recorded in infkv-stream's JSON: 2 is the layout above with
/// several people per kind and the forced choice (docs/evaluation.md, "The needle protocol").
inline constexpr int needle_protocol = 2;

/// A kind of needle: a statement about a person, "{name}" + `prefix` + " " + value + `suffix`,
/// and the question line that asks it back. Values are drawn from `values`, or are random
/// numbers of `digits` digits when it is empty.
struct needle_kind {
  std::string_view name, prefix, suffix, question;
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
inline constexpr std::array<std::string_view, 8> pets{"hamster",  "parrot",   "lizard", "rabbit",
                                                      "goldfish", "tortoise", "ferret", "canary"};
inline constexpr std::array<std::string_view, 8> cars{"Volvo", "Toyota", "Renault", "Ford",
                                                      "Honda", "Fiat",   "Skoda",   "Tesla"};
inline constexpr std::array<std::string_view, 8> jobs{"dentist",   "pilot",       "chemist",    "plumber",
                                                      "librarian", "firefighter", "journalist", "banker"};
inline constexpr std::array<std::string_view, 8> sports{"tennis",    "chess", "hockey",  "volleyball",
                                                        "badminton", "golf",  "cricket", "baseball"};
inline constexpr std::array<std::string_view, 8> languages{"Portuguese", "Swahili", "Finnish", "Japanese",
                                                           "Polish",     "Turkish", "Dutch",   "Korean"};
inline constexpr std::array<std::string_view, 8> drinks{"espresso", "lemonade", "cocoa",     "cider",
                                                        "smoothie", "kombucha", "milkshake", "iced tea"};
inline constexpr std::array<std::string_view, 8> fruits{"mango",  "kiwi", "banana",  "papaya",
                                                        "cherry", "lime", "coconut", "blueberry"};
}  // namespace detail

/// Candidates a kind of random numbers offers per stream (the forced choice's alternatives).
inline constexpr std::size_t number_candidates = 8;

/// The needle kinds, in the order a stream's kinds are taken from them by default.
inline constexpr std::array<needle_kind, 12> needle_kinds{{
    {"number", "The magic number of {name} is", ".", "What is the magic number of {name}?", {}, 5},
    {"word", "The secret word of {name} is", ".", "What is the secret word of {name}?", detail::words},
    {"fact", "The home town of {name} is", ".", "What is the home town of {name}?", detail::cities},
    {"colour", "The favourite colour of {name} is", ".", "What is the favourite colour of {name}?", detail::colours},
    {"pet", "The pet of {name} is a", ".", "What is the pet of {name}?", detail::pets},
    {"car", "The car of {name} is a", ".", "What is the car of {name}?", detail::cars},
    {"job", "The job of {name} is a", ".", "What is the job of {name}?", detail::jobs},
    {"sport", "The sport of {name} is", ".", "What is the sport of {name}?", detail::sports},
    {"code", "The door code of {name} is", ".", "What is the door code of {name}?", {}, 4},
    {"language", "The language of {name} is", ".", "What is the language of {name}?", detail::languages},
    {"drink", "The favourite drink of {name} is", ".", "What is the favourite drink of {name}?", detail::drinks},
    {"fruit", "The favourite fruit of {name} is", ".", "What is the favourite fruit of {name}?", detail::fruits},
}};

/// The people needles are about (the needles of one stream are about different people).
inline constexpr std::array<std::string_view, 16> needle_names{"Marta",  "Tobias", "Ingrid", "Kenji",  "Amara", "Lukas",
                                                               "Priya",  "Mateo",  "Sofia",  "Dmitri", "Leila", "Oscar",
                                                               "Hannah", "Rafael", "Yuki",   "Nadia"};

/// The kind called `name`, or nullptr.
inline const needle_kind* find_needle_kind(std::string_view name) {
  for (const auto& k : needle_kinds)
    if (k.name == name) return &k;
  return nullptr;
}

/// `pattern` with "{name}" replaced by `name`.
inline std::string fill_name(std::string_view pattern, std::string_view name) {
  return fmt::format(fmt::runtime(pattern), fmt::arg("name", name));
}

/// The most people of one kind a stream can hold: every kind offers at least this many values.
inline std::int64_t max_people_per_kind() {
  std::size_t n = number_candidates;
  for (const auto& k : needle_kinds)
    if (!k.values.empty()) n = std::min(n, k.values.size());
  return std::int64_t(n);
}

/// One needle of a stream: its kind, person and value, and the values it is chosen among (every
/// value of its kind in the stream's draw; `value` is one of them).
struct needle_spec {
  std::string kind, person, value;
  std::vector<std::string> candidates;
};

/// Kinds a stream of `n` needles with `people` people per kind uses.
inline std::int64_t kinds_in_stream(std::int64_t n, std::int64_t people) { return (n + people - 1) / people; }

/// The `n` needles of one stream, about `people` people per kind: needle j is of kind
/// kinds[j % kinds.size()] and about the j-th of the shuffled names; within a kind the values are
/// distinct (drawn without replacement). `kinds` holds kinds_in_stream(n, people) names.
inline std::vector<needle_spec> draw_needles(std::span<const std::string> kinds, std::int64_t n, std::int64_t people,
                                             std::mt19937_64& rng) {
  INFKV_REQUIRE(people >= 1 && people <= max_people_per_kind(), "people per needle kind", people, "must be in [1, ",
                max_people_per_kind(), "]");
  INFKV_REQUIRE(n >= 1 && n <= std::int64_t(needle_names.size()), "needles in a stream", n, "must be in [1, ",
                needle_names.size(), "] (the people)");
  INFKV_REQUIRE(std::int64_t(kinds.size()) == kinds_in_stream(n, people), "needle kinds of a stream", kinds.size(),
                "must be ", kinds_in_stream(n, people), " for ", n, " needles of ", people, " people per kind");
  std::array<std::string_view, needle_names.size()> names = needle_names;
  std::shuffle(names.begin(), names.end(), rng);
  std::vector<std::vector<std::string>> pool(kinds.size()), drawn(kinds.size());
  for (std::size_t k = 0; k < kinds.size(); ++k) {
    const needle_kind* nk = find_needle_kind(kinds[k]);
    INFKV_REQUIRE(nk != nullptr, "needle kind", kinds[k], "is not one of the kinds infkv-stream knows");
    if (nk->values.empty()) {
      std::uniform_int_distribution<std::int64_t> d(1, 9);
      while (pool[k].size() < number_candidates) {  // distinct numbers of `digits` digits, no leading 0
        std::string v = std::to_string(d(rng));
        for (int i = 1; i < nk->digits; ++i) v += char('0' + rng() % 10);
        if (std::find(pool[k].begin(), pool[k].end(), v) == pool[k].end()) pool[k].push_back(v);
      }
    } else {
      for (const auto v : nk->values) pool[k].emplace_back(v);
    }
    drawn[k] = pool[k];
    std::shuffle(drawn[k].begin(), drawn[k].end(), rng);
  }
  std::vector<needle_spec> out;
  for (std::int64_t j = 0; j < n; ++j) {
    const auto k = std::size_t(j) % kinds.size();
    out.push_back({kinds[k], std::string(names[std::size_t(j)]), drawn[k][std::size_t(j) / kinds.size()], pool[k]});
  }
  return out;
}

/// A needle in tokens: the statement as planted (own line), the question (ending with the
/// statement's prefix tokens), the candidates' tokens (value and suffix) and which is true.
template <class Token>
struct planted_needle {
  std::vector<Token> statement, question, prefix;
  std::vector<std::vector<Token>> choices;
  std::size_t truth = 0;
};

/// Lays `n` out with `tok` (std::string -> std::vector<Token>, no special tokens): see the top of
/// this file. `header`: text put before the question ("{name}": the person; "" for none).
template <class Token, class Tokenize>
planted_needle<Token> plant_needle(const Tokenize& tok, const needle_spec& n, std::string_view header = {}) {
  const needle_kind* nk = find_needle_kind(n.kind);
  INFKV_REQUIRE(nk != nullptr, "needle kind", n.kind, "is not one of the kinds infkv-stream knows");
  const auto truth = std::find(n.candidates.begin(), n.candidates.end(), n.value);
  INFKV_REQUIRE(truth != n.candidates.end(), "needle value", n.value, "is not among its kind's candidates");
  const std::vector<Token> nl = tok(std::string("\n")), suffix = tok(std::string(nk->suffix));
  planted_needle<Token> p;
  p.prefix = tok(fill_name(nk->prefix, n.person));
  for (const auto& c : n.candidates) {
    auto v = tok(" " + c);
    v.insert(v.end(), suffix.begin(), suffix.end());
    p.choices.push_back(std::move(v));
  }
  p.truth = std::size_t(truth - n.candidates.begin());
  const auto append = [](std::vector<Token>& to, const std::vector<Token>& x) {
    to.insert(to.end(), x.begin(), x.end());
  };
  append(p.statement, nl), append(p.statement, p.prefix), append(p.statement, p.choices[p.truth]);
  append(p.statement, nl);
  append(p.question, nl), append(p.question, tok(fill_name(header, n.person) + fill_name(nk->question, n.person)));
  append(p.question, nl), append(p.question, p.prefix);
  return p;
}

namespace detail {
inline bool word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }
inline bool same_ci(char a, char b) {
  return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
}
/// `word` at `pos` of `text`, ignoring case, with no letter or digit just before or after it.
inline bool word_at(std::string_view text, std::size_t pos, std::string_view word) {
  if (word.empty() || pos + word.size() > text.size()) return false;
  for (std::size_t i = 0; i < word.size(); ++i)
    if (!same_ci(text[pos + i], word[i])) return false;
  const bool before = pos > 0 && word_char(text[pos - 1]) && word_char(word.front());
  const bool after = pos + word.size() < text.size() && word_char(text[pos + word.size()]) && word_char(word.back());
  return !before && !after;
}
}  // namespace detail

/// True when `word` occurs in `text` on word boundaries, ignoring case ("teal" is in "Teal." but
/// not in "steal" or "teals").
inline bool contains_word(std::string_view text, std::string_view word) {
  for (std::size_t i = 0; i + word.size() <= text.size() && !word.empty(); ++i)
    if (detail::word_at(text, i, word)) return true;
  return false;
}

/// The forced-choice grade: 1 + the candidates other than `truth` whose log-probability is at
/// least the true one's (1: the true value ranks first, strictly).
inline std::int64_t forced_rank(std::span<const double> logprobs, std::size_t truth) {
  std::int64_t rank = 1;
  for (std::size_t c = 0; c < logprobs.size(); ++c) rank += c != truth && logprobs[c] >= logprobs[truth];
  return rank;
}

/// The greedy grade: the answer, after leading blanks, begins with `value` as whole words,
/// ignoring case (" Volvo." and " volvo, ..." match Volvo; " a Volvo", " Volvos" and "Volvo" after
/// another word do not).
inline bool answer_matches(std::string_view answer, std::string_view value) {
  std::size_t i = 0;
  while (i < answer.size() && std::isspace(static_cast<unsigned char>(answer[i]))) ++i;
  return detail::word_at(answer, i, value);
}

}  // namespace stream
