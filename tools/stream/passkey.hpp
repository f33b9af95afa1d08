// infkv-stream's retrieval tests. --passkey: a random 5-digit pass key stated once, then a repeated
// filler sentence (a sanity check: anything that differs from the filler stands out). --needle:
// needle statements (a number, a word or a short fact, each about its own person, --people of
// them per kind) planted into real prose from --text, --needles of them per stream, --needle-gap
// tokens of prose apart, each on its own line (needles.hpp lays them out). The stream goes through
// the bounded cache in blocks with eviction exactly as the text stream does; DISTANCE tokens after
// each key (for each DISTANCE asked) the question is asked on a second llama.cpp sequence that
// shares the cache (runner::ask), so asking changes nothing the stream goes on with. Two grades
// per question: the forced choice (the true value's log-probability ranks first among its kind's
// candidates, teacher-forced after the question) and the greedy answer (it begins with the value,
// on word boundaries, ignoring case).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "needles.hpp"
#include "runner.hpp"

namespace stream {

/// One question asked along a retrieval stream.
struct probe {
  std::int64_t trial = 0;        ///< the key's number (keys counted over every stream)
  std::int64_t stream = 0;       ///< the stream it is planted in
  std::string kind = "passkey";  ///< passkey, or the needle's kind (needle_kinds)
  std::string person;            ///< whom the needle is about (empty for the passkey)
  std::string needle;            ///< the value the answer must give
  std::vector<llama_token> question;
  std::vector<std::vector<llama_token>> choices;  ///< the candidates' tokens, teacher-forced after the question
  std::vector<std::string> candidates;            ///< ... and their values
  std::size_t truth = 0;                          ///< the true one among them
  std::int64_t key_at = 0;                        ///< stream index where the key statement starts
  std::int64_t key_end = 0;                       ///< ... and ends
  std::int64_t at = 0;                            ///< asked after the stream's first `at` tokens
  std::int64_t prefix = 0;  ///< filler sentences (passkey) or prose tokens (needle) before the stream's first key
  std::int64_t distance() const { return at - key_end; }
  std::int64_t key_tokens() const { return key_end - key_at; }
  /// Whether the forced choice has alternatives to rank the true value against.
  bool forced() const { return choices.size() > 1; }
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
  std::int64_t key_kept = 0;      ///< tokens of the key statement cached when the question is asked
  std::vector<double> logprobs;   ///< each candidate's log-probability after the question (teacher forcing)
  double needle_logprob = 0.0;    ///< ... the true value's
  std::int64_t rank = 0;          ///< 1 + the candidates scoring at least as high as the true one (forced choice)
  std::size_t best_other = 0;     ///< the best-scoring other candidate (when there is one)
  bool forced_success = false;    ///< the true value ranks first (strictly) among its candidates
  bool success = false;           ///< the greedy answer begins with the value (answer_matches)
  double seconds = 0.0;           ///< asking and answering (recall included)
  std::int64_t key_recalled = 0;  ///< tokens of the key statement cached after the recall before the question
  double recall_seconds = 0.0;    ///< the recall before the question (session_stats::recall)
  /// Decoding the stream so far (session_stats::decode): prefilling the context block by block,
  /// against a bounded cache for an evicting runner (less than re-prefilling it whole)
  double decode_seconds = 0.0;
  std::int64_t archive_bytes = 0;  ///< the archive's pages held (archive::held_bytes) when asked
  std::int64_t cache_bytes = 0;    ///< the cache's slots at the question, K and V in the cache's type
  std::int64_t full_bytes = 0;     ///< every stream token before the question, K and V in the cache's type
  /// The best other candidate's log-probability (-inf when there is none).
  double best_other_logprob() const {
    return p.forced() ? logprobs[best_other] : -std::numeric_limits<double>::infinity();
  }
};

/// One policy's questions.
struct passkey_run {
  std::string policy;
  std::vector<passkey_trial> trials;
  std::string note;  ///< why the policy was skipped, if it was
  double seconds = 0.0;
};

/// Greedy successes over questions.
inline double success_rate(std::span<const passkey_trial> t) {
  std::int64_t ok = 0;
  for (const auto& x : t) ok += x.success;
  return t.empty() ? 0.0 : double(ok) / double(t.size());
}

/// Forced-choice successes over the questions that have alternatives (NaN when none has).
inline double forced_rate(std::span<const passkey_trial> t) {
  std::int64_t ok = 0, n = 0;
  for (const auto& x : t)
    if (x.p.forced()) ok += x.forced_success, ++n;
  return n == 0 ? std::numeric_limits<double>::quiet_NaN() : double(ok) / double(n);
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
  key.candidates = {key.needle};
  key.choices = {tokenize(m, " " + key.needle, false)};
  std::vector<std::int64_t> whole;  // the distances rounded up to whole filler sentences, within the stream
  for (const std::int64_t d : distances)
    whole.push_back(std::min<std::int64_t>(reps_of(d) * unit, std::int64_t(s.tokens.size()) - key.key_end));
  add_probes(s, key, whole);
  order_probes(s);
  return s;
}

/// The layout of the needle streams.
struct needle_layout {
  std::vector<std::int64_t> distances;  ///< tokens from the end of a needle statement to its question
  std::vector<std::string> kinds;       ///< kinds the streams take theirs from in turn (names in needle_kinds)
  std::int64_t per_stream = 1;          ///< needles in one stream
  std::int64_t people = 1;              ///< needles (people) of one kind in a stream
  std::int64_t gap = 1024;              ///< prose tokens between two needles of a stream
  std::string header = "Question: ";    ///< put before each question ("{name}": the person)
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
/// (newline tokens before and after it, at a line start of the prose where one lies within 32
/// tokens) with `gap` tokens of prose between them, and prose up to the last question. The stream
/// takes kinds_in_stream(n, people) kinds from lay.kinds, in turn from where the previous stream
/// stopped; needle j is of the (j mod kinds)-th of them (draw_needles). Values, names and
/// positions are drawn from (seed, index). `line_start[i]`: token i of `text` begins a line.
inline retrieval_stream make_needles(const llama_model* m, std::span<const llama_token> text,
                                     const std::vector<bool>& line_start, const needle_layout& lay, std::int64_t first,
                                     std::int64_t n, std::int64_t index, std::uint64_t seed) {
  const std::int64_t n_kinds = kinds_in_stream(n, lay.people);
  INFKV_REQUIRE(n >= 1 && n_kinds <= std::int64_t(lay.kinds.size()), "needles in a stream", n, "of ", lay.people,
                " people per kind take ", n_kinds, " kinds, more than the ", lay.kinds.size(), " given");
  std::mt19937_64 rng(seed * 1000003u + std::uint64_t(index) + 7777u);
  std::vector<std::string> kinds;
  for (std::int64_t i = 0; i < n_kinds; ++i)
    kinds.push_back(lay.kinds[std::size_t(first / lay.people + i) % lay.kinds.size()]);
  const auto specs = draw_needles(kinds, n, lay.people, rng);
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
  const auto tok = [&](const std::string& x) { return tokenize(m, x, false); };
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t cut = line_after(cur + (j == 0 ? prefix : lay.gap), cur + (j == 0 ? prefix : lay.gap) + 32);
    s.tokens.insert(s.tokens.end(), text.begin() + cur, text.begin() + cut);
    cur = cut;
    const needle_spec& spec = specs[std::size_t(j)];
    const auto planted = plant_needle<llama_token>(tok, spec, lay.header);
    probe key;
    key.prefix = j == 0 ? cut - start : 0;
    key.trial = first + j;
    key.stream = index;
    key.kind = spec.kind, key.person = spec.person, key.needle = spec.value;
    key.key_at = std::int64_t(s.tokens.size());
    s.tokens.insert(s.tokens.end(), planted.statement.begin(), planted.statement.end());
    key.key_end = std::int64_t(s.tokens.size());
    key.question = planted.question;
    key.choices = planted.choices, key.candidates = spec.candidates, key.truth = planted.truth;
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

/// The most cells a question and its answer take.
inline std::int64_t ask_room(const retrieval_stream& s, std::int64_t gen) {
  std::size_t q = 0;
  for (const auto& p : s.probes)
    for (const auto& c : p.choices) q = std::max(q, p.question.size() + c.size());
  return std::int64_t(q) + gen;
}

/// Asks `pr` of runner `r` where the stream stands (after its first pr.at tokens) and grades the
/// answer: forced choice among the candidates and up to `gen` greedy tokens.
inline passkey_trial ask_and_grade(runner& r, const probe& pr, std::int64_t gen) {
  const auto t0 = std::chrono::steady_clock::now();
  passkey_trial t;
  t.p = pr;
  t.best_other = t.p.truth;
  t.key_kept = r.cached_in(t.p.key_at, t.p.key_end);
  const auto before = r.stats();
  const auto a = r.ask(t.p.question, t.p.choices, gen);
  t.key_recalled = r.cached_in(t.p.key_at, t.p.key_end);
  t.recall_seconds = r.stats().recall - before.recall;
  t.decode_seconds = before.decode;
  t.archive_bytes = r.archive_bytes();
  t.cache_bytes = r.kv_bytes(r.slots());
  t.full_bytes = r.kv_bytes(t.p.at);
  t.answer = a.text, t.logprobs = a.logprobs;
  t.needle_logprob = t.logprobs[t.p.truth];
  t.rank = forced_rank(t.logprobs, t.p.truth);
  for (std::size_t c = 0; c < t.logprobs.size(); ++c)
    if (c != t.p.truth && (t.best_other == t.p.truth || t.logprobs[c] > t.logprobs[t.best_other])) t.best_other = c;
  t.forced_success = t.p.forced() && t.rank == 1;
  t.success = answer_matches(t.answer, t.p.needle);
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

/// Streams `rs` through a fresh runner of policy `k` in blocks of s.block (a block is cut where a
/// question is asked), evicting after each; asks each question where it belongs and decodes up
/// to `gen` answer tokens. `done(trial)` is called after each question. With
/// s.question_known (single turn) every question gets a prompt of its own instead: a fresh runner
/// prefills the stream's first `at` tokens in blocks of s.block, each eviction scoring against
/// the question's queries, then asks it.
inline std::vector<passkey_trial> run_retrieval(const llama_model* m, kind k, settings s, const retrieval_stream& rs,
                                                std::int64_t gen,
                                                const std::function<void(const passkey_trial&)>& done) {
  s.ask_room = ask_room(rs, gen);
  std::vector<passkey_trial> out;
  if (s.question_known) {
    for (const auto& pr : rs.probes) {
      auto r = make_runner(m, k, s, pr.at, s.block);
      r->stream_logits = false;
      for (std::int64_t at = 0; at < pr.at;) {
        const std::int64_t end = std::min(pr.at, at + s.block);
        r->feed(std::span(rs.tokens).subspan(std::size_t(at), std::size_t(end - at)));
        r->evict(pr.question);
        at = end;
      }
      out.push_back(ask_and_grade(*r, pr, gen));
      if (done) done(out.back());
    }
    return out;
  }
  auto r = make_runner(m, k, s, std::int64_t(rs.tokens.size()), s.block);
  r->stream_logits = false;  // no perplexity here: the questions decode their own logits
  const auto n = std::int64_t(rs.tokens.size());
  std::size_t next = 0;
  for (std::int64_t at = 0; at < n;) {
    std::int64_t end = std::min(n, (at / s.block + 1) * s.block);
    if (next < rs.probes.size()) end = std::min(end, rs.probes[next].at);
    r->feed(std::span(rs.tokens).subspan(std::size_t(at), std::size_t(end - at)));
    r->evict();
    at = end;
    for (; next < rs.probes.size() && rs.probes[next].at == at; ++next) {
      out.push_back(ask_and_grade(*r, rs.probes[next], gen));
      if (done) done(out.back());
    }
  }
  INFKV_REQUIRE(next == rs.probes.size(), "retrieval questions asked", next, "of ", rs.probes.size(),
                ": a question lies beyond the stream");
  return out;
}

}  // namespace stream
