// infkv-stream's needles without a model (tools/stream/needles.hpp): the greedy grade on word
// boundaries, the draw of a stream's needles (several people per kind, distinct values), and the
// token layout of a statement and its question, with a word-level tokenizer written here.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include "needles.hpp"

namespace {

/// A word-level tokenizer: a newline, a run of letters or digits (with the blanks before it), or
/// any other character (with the blanks before it) is one token; ids are given in order of first
/// sight, so equal pieces get equal ids.
struct word_tokenizer {
  std::map<std::string, std::int32_t>* ids;
  std::vector<std::string>* pieces;
  std::vector<std::int32_t> operator()(const std::string& text) const {
    std::vector<std::int32_t> out;
    std::size_t i = 0;
    while (i < text.size()) {
      std::size_t j = i;
      if (text[j] == '\n') {
        ++j;
      } else {
        while (j < text.size() && text[j] == ' ') ++j;
        if (j < text.size() && std::isalnum(static_cast<unsigned char>(text[j])))
          while (j < text.size() && std::isalnum(static_cast<unsigned char>(text[j]))) ++j;
        else if (j < text.size() && text[j] != '\n')
          ++j;
      }
      const std::string p = text.substr(i, j - i);
      const auto [it, added] = ids->emplace(p, std::int32_t(ids->size()));
      if (added) pieces->push_back(p);
      out.push_back(it->second);
      i = j;
    }
    return out;
  }
};

std::string detok(const std::vector<std::string>& pieces, const std::vector<std::int32_t>& t) {
  std::string s;
  for (const auto id : t) s += pieces[std::size_t(id)];
  return s;
}

}  // namespace

TEST_CASE("the greedy grade matches the value as the answer's first words, on word boundaries, any case") {
  using stream::answer_matches;
  CHECK(answer_matches(" teal.", "teal"));
  CHECK(answer_matches(" Teal\nAnd the", "teal"));
  CHECK(answer_matches("teal", "teal"));
  CHECK(answer_matches(" iced tea, please", "iced tea"));
  CHECK(answer_matches(" 68041.", "68041"));
  // Must fail: inside a longer word, after another word, a reworded or different value.
  CHECK_FALSE(answer_matches(" steal", "teal"));
  CHECK_FALSE(answer_matches(" teals", "teal"));
  CHECK_FALSE(answer_matches(" a teal", "teal"));
  CHECK_FALSE(answer_matches(" every week", "tennis"));
  CHECK_FALSE(answer_matches(" car", "Volvo"));
  CHECK_FALSE(answer_matches(" 680412", "68041"));
  CHECK_FALSE(answer_matches(" iced teapot", "iced tea"));
  CHECK_FALSE(answer_matches("", "teal"));
  CHECK_FALSE(answer_matches(" teal", ""));
}

TEST_CASE("contains_word finds a word only on word boundaries") {
  CHECK(stream::contains_word("the colour is Teal, I think", "teal"));
  CHECK(stream::contains_word("teal", "teal"));
  CHECK_FALSE(stream::contains_word("do not steal", "teal"));
  CHECK_FALSE(stream::contains_word("teals and tealish", "teal"));
  CHECK_FALSE(stream::contains_word("", "teal"));
}

TEST_CASE("a stream's needles: several people per kind, distinct people, distinct values within a kind") {
  const std::vector<std::string> kinds{"colour", "car", "number", "word"};
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    const auto ns = stream::draw_needles(kinds, 12, 3, rng);
    REQUIRE(ns.size() == 12);
    std::set<std::string> people;
    std::map<std::string, std::set<std::string>> values;
    std::map<std::string, int> per_kind;
    for (std::size_t j = 0; j < ns.size(); ++j) {
      const auto& n = ns[j];
      CHECK(n.kind == kinds[j % kinds.size()]);
      people.insert(n.person);
      values[n.kind].insert(n.value);
      ++per_kind[n.kind];
      // The value is one of its candidates, exactly once; candidates are distinct.
      CHECK(std::count(n.candidates.begin(), n.candidates.end(), n.value) == 1);
      CHECK(std::set<std::string>(n.candidates.begin(), n.candidates.end()).size() == n.candidates.size());
      CHECK(n.candidates.size() >= 8);
      if (n.kind == "number") CHECK(n.value.size() == 5);
    }
    CHECK(people.size() == 12);
    for (const auto& k : kinds) {
      CHECK(per_kind[k] == 3);
      CHECK(values[k].size() == 3);  // three people of a kind never share a value
    }
  }
  // The same seed draws the same needles; another seed draws others.
  std::mt19937_64 a(7), b(7), c(8);
  const auto x = stream::draw_needles(kinds, 12, 3, a), y = stream::draw_needles(kinds, 12, 3, b),
             z = stream::draw_needles(kinds, 12, 3, c);
  bool same = true, differ = false;
  for (std::size_t j = 0; j < x.size(); ++j) {
    same = same && x[j].person == y[j].person && x[j].value == y[j].value;
    differ = differ || x[j].person != z[j].person || x[j].value != z[j].value;
  }
  CHECK(same);
  CHECK(differ);
}

TEST_CASE("draw_needles refuses more people per kind than a kind has values, and the wrong number of kinds") {
  std::mt19937_64 rng(1);
  const std::vector<std::string> one{"colour"}, two{"colour", "car"};
  CHECK_THROWS(stream::draw_needles(one, 9, 9, rng));  // colours offer 8 values
  CHECK_THROWS(stream::draw_needles(one, 6, 3, rng));  // 6 needles of 3 people per kind take 2 kinds
  CHECK_NOTHROW(stream::draw_needles(two, 6, 3, rng));
  const std::vector<std::string> bad{"colour", "nope"};
  CHECK_THROWS(stream::draw_needles(bad, 4, 2, rng));
}

TEST_CASE("a statement stands on its own line and the question ends with its own prefix tokens") {
  std::map<std::string, std::int32_t> ids;
  std::vector<std::string> pieces;
  const word_tokenizer tok{&ids, &pieces};
  std::mt19937_64 rng(3);
  std::vector<std::string> kinds;
  for (const auto& k : stream::needle_kinds) kinds.emplace_back(k.name);
  for (const auto& n : stream::draw_needles(kinds, 12, 1, rng)) {
    const auto p = stream::plant_needle<std::int32_t>(tok, n, "Question: ");
    const auto nl = tok("\n");
    REQUIRE(nl.size() == 1);
    // NL PREFIX VALUE SUFFIX NL, and nothing else.
    REQUIRE(p.statement.size() == 2 + p.prefix.size() + p.choices[p.truth].size());
    CHECK(p.statement.front() == nl[0]);
    CHECK(p.statement.back() == nl[0]);
    CHECK(std::count(p.statement.begin(), p.statement.end(), nl[0]) == 2);
    CHECK(std::equal(p.prefix.begin(), p.prefix.end(), p.statement.begin() + 1));
    CHECK(std::equal(p.choices[p.truth].begin(), p.choices[p.truth].end(),
                     p.statement.begin() + 1 + std::ptrdiff_t(p.prefix.size())));
    // The question's last tokens: a newline, then exactly the statement's prefix tokens.
    REQUIRE(p.question.size() > p.prefix.size() + 2);
    CHECK(std::equal(p.prefix.begin(), p.prefix.end(), p.question.end() - std::ptrdiff_t(p.prefix.size())));
    CHECK(p.question[p.question.size() - p.prefix.size() - 1] == nl[0]);
    CHECK(p.question.front() == nl[0]);
    const std::string stmt = detok(pieces, p.statement);
    const stream::needle_kind* nk = stream::find_needle_kind(n.kind);
    REQUIRE(nk != nullptr);
    CHECK(stmt.find(stream::fill_name(nk->prefix, n.person)) == 1);  // the prefix at the line start
    CHECK(stmt.find(n.person) != std::string::npos);
    CHECK(stmt.find(" " + n.value) != std::string::npos);
    CHECK(detok(pieces, p.question).find("Question: ") == 1);
    // One choice per candidate, the true one the value's; the others are the other values.
    REQUIRE(p.choices.size() == n.candidates.size());
    CHECK(n.candidates[p.truth] == n.value);
    for (std::size_t c = 0; c < p.choices.size(); ++c) {
      const std::string text = detok(pieces, p.choices[c]);
      CHECK(text.find(" " + n.candidates[c]) == 0);
      CHECK((c == p.truth) == (p.choices[c] == p.choices[p.truth]));
    }
  }
}

TEST_CASE("plant_needle refuses a value that is not among the candidates") {
  std::map<std::string, std::int32_t> ids;
  std::vector<std::string> pieces;
  const word_tokenizer tok{&ids, &pieces};
  const stream::needle_spec n{"colour", "Marta", "chartreuse", {"teal", "pink"}};
  CHECK_THROWS(stream::plant_needle<std::int32_t>(tok, n));
}
