// infkv-stream: the policies and the runners that stream text through one bounded llama.cpp
// context each: a session that evicts with an infkv policy, the full cache (no eviction), and the
// sliding window with recompute (a fresh cache per block).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <infkv/llama_cpp.hpp>

#include "errors.hpp"
#include "policy_catalog.hpp"

#include "ask.hpp"
#include "llama_util.hpp"

namespace stream {

using kind = infkv_tools::policy_kind;
using policy_info = infkv_tools::policy_entry;
using infkv_tools::find_policy;

/// Settings shared by every run. beta (inf_mllm_bias) defaults to 8: on SmolLM2-135M it was the
/// best of 0 / 0.5 / 2 / 4 / 8 / 32 over the first 3000 KJV tokens at budget 256, and of 2 / 8 at
/// budget 1024 on held-out KJV text (docs/evaluation.md).
struct settings : infkv_tools::policy_knobs {
  std::int64_t budget = 1024;      ///< cache slots kept after each eviction
  std::int64_t block = 128;        ///< tokens decoded between evictions
  int threads = 2;                 ///< llama.cpp and scoring threads
  bool keep_positions = false;     ///< leave holes at the original positions instead of compacting
  bool compact_positions = false;  ///< with an archive: compact all the same (an archive implies keep otherwise)
  std::int64_t position_gap = 0;   ///< compacting: narrow gaps to at most this many positions (0: close them)
  std::int64_t position_span = 0;  ///< compacting: narrow gaps as little as keeps positions below this (0: unset)
  std::int64_t ask_room = 0;       ///< cells beyond the cache for a question and its answer (runner::ask); 0: none
  infkv::reduction reduce = infkv::reduction::mean;  ///< heads and layers -> one score per token
  std::optional<infkv::dtype> key_type{};            ///< the session's key copies (unset: the cache's own)
  /// Where the policies read the keys: llama.cpp's cache where it can (automatic), or copies.
  infkv::llama_cpp::key_source keys = infkv::llama_cpp::key_source::automatic;
  std::int32_t archive_bits = 0;        ///< archive what evictions remove at this many bits (0: no archive)
  std::int64_t archive_mib = 256;       ///< the archive's capacity
  std::int32_t archive_page = 16;       ///< slots per archive page (16 answered more needles than 8 or 32 at 2K)
  std::int64_t recall_tokens = 0;       ///< recall before each question, at most this many slots (0: none)
  std::int32_t recall_candidates = 32;  ///< archive pages scored exactly per recall (the best by their bounds)
  std::int32_t recall_neighbours = 1;   ///< a recalled page brings this many adjoining pages on each side
  /// Rank candidates at this distance before the newest cached token (recall_options::distance;
  /// -1: where they land).
  std::int64_t recall_distance = -1;
  std::int64_t prefetch_tokens = 0;  ///< after each eviction, recall at most this many slots for the window (0: none)
  bool recall_bias = true;           ///< recall scores with the policy's recency bias (inf_mllm_bias)
  /// Single turn: each question's prompt is prefilled with the question known, every eviction
  /// scoring against its queries (proxy queries, computed as `proxy` says).
  bool question_known = false;
  /// Keep whole segments first (session_options::whole_segments), a segment being a sentence or
  /// line of the stream's text (sentence_counter).
  bool whole_segments = false;
  /// Move the cached cells together after each eviction (session_options::gather_cells), through
  /// sequence 1.
  bool gather_cells = false;
  /// Score a sliding-window model's global layers only (session_options::score_global_layers).
  bool score_global_layers = false;
  infkv::llama_cpp::proxy_mode proxy = infkv::llama_cpp::proxy_mode::after_cache;
  /// Context reconstruction (KVzip) scores every eviction, the cached tokens repeated this many
  /// per pass (session::evict_reconstructed; the policy gives only its protected tokens); 0: the
  /// policy's own scores.
  std::int64_t reconstruct = 0;
  /// llama.cpp's K and V cache type (q8_0, q4_0: quantized full caches, llama.cpp then attends with
  /// flash attention, which its quantized V cache needs).
  ggml_type cache_type = GGML_TYPE_F16;
};

/// Cells and batch room one reconstruction pass needs beside the cache: the chunk, the previous
/// chunk's tail and the prompt (kvpress's, about 20 tokens).
inline std::int64_t reconstruct_room(const settings& s) { return s.reconstruct > 0 ? s.reconstruct + 64 : 0; }

/// The parameters of a runner's context: `cells` plus the question room, batches of a block or a
/// question, two sequences when questions are asked.
inline llama_context_params runner_params(const settings& s, std::int64_t cells, std::int64_t n_batch) {
  auto p = context_params(std::uint32_t(cells + s.ask_room), std::uint32_t(std::max(n_batch, s.ask_room)), s.threads,
                          s.ask_room > 0 || s.archive_bits > 0 || s.gather_cells ? 2 : 1);
  p.type_k = p.type_v = s.cache_type;
  if (s.cache_type != GGML_TYPE_F16) p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  return p;
}

/// The budget (with its protected tokens) a policy evicts to; nullopt for full and recompute.
inline std::optional<infkv::budget> policy_budget(kind k, const settings& s) {
  return infkv_tools::policy_budget(k, s.budget, s);
}

/// Fails naming `flag` = `value` before anything is allocated when `cells` cache cells (llama.cpp's
/// K/V of type `t` plus the session's f16 key copies) cannot fit in the memory available now; `who`
/// needs them.
inline void check_cells(const llama_model* m, std::string_view flag, std::int64_t value, std::string_view who,
                        double cells, ggml_type t = GGML_TYPE_F16) {
  const model_shape sh(m);
  const double per_cell = double(sh.kv_bytes(1, t) + sh.key_copy_bytes(1)), avail = memory_available();
  if (avail > 0 && cells * per_cell > avail)
    infkv_tools::fail(
        "{} = {}: {} needs {:.0f} cache cells, about {:.0f} MiB of K/V and key copies ({:.1f} KiB a "
        "cell), but {:.0f} MiB of memory are available",
        flag, value, who, cells, cells * per_cell / 1048576.0, per_cell / 1024.0, avail / 1048576.0);
}

/// One context streaming one token sequence. `feed` decodes the next tokens with logits for
/// each; `evict` brings the cache back to the budget. `max_feed` is the most tokens fed between
/// two evictions: the cache never holds more than budget + max_feed slots.
class runner {
 public:
  explicit runner(const llama_model* m) : model_(m), shape_(m) {}
  virtual ~runner() = default;
  runner(const runner&) = delete;
  runner& operator=(const runner&) = delete;

  /// Decodes `toks`, the next tokens of the stream (`extend`: append to the current cache even
  /// where the runner would otherwise rebuild it, as generation does).
  virtual void feed(std::span<const llama_token> toks, bool extend = false) = 0;
  /// Evicts down to the budget; returns the slots removed. With `question` (a question known in
  /// advance) a session scores against its queries (settings::proxy); the others ignore it.
  virtual std::int64_t evict(std::span<const llama_token> question) = 0;
  std::int64_t evict() { return evict({}); }
  /// From now on the caller evicts as soon as slots() exceeds `above` (a session then observes
  /// queries only on the decodes the next eviction reads: session::evicts_above).
  virtual void evicts_above(std::int64_t above) { (void)above; }
  /// Tokens cached now.
  virtual std::int64_t slots() const = 0;
  /// Bytes of the host copies the runner keeps beside the llama.cpp cache (keys, queries).
  virtual std::int64_t host_bytes() const { return 0; }
  /// Bytes of the archive's pages held (archive::held_bytes), 0 without an archive.
  virtual std::int64_t archive_bytes() const { return 0; }
  /// Where the time went: the session's split, or the decodes and memory calls of the others.
  virtual infkv::llama_cpp::session_stats stats() const { return stats_; }
  /// How many of the stream's tokens [begin, end) (indices in feed order) are cached now.
  std::int64_t cached_in(std::int64_t begin, std::int64_t end) const {
    return std::int64_t(std::lower_bound(cached_.begin(), cached_.end(), end) -
                        std::lower_bound(cached_.begin(), cached_.end(), begin));
  }

  /// Asks `question` without changing the stream (ask_aside at the stream's next position). The
  /// session never sees these decodes: nothing is captured, scored or tracked. Needs
  /// settings::ask_room >= question + the longest candidate + gen.
  virtual answer ask(std::span<const llama_token> question, std::span<const std::vector<llama_token>> candidates,
                     std::int64_t gen) {
    return ask_aside(ctx_.get(), next_pos(), question, candidates, gen, stats_);
  }

  /// Whether a feed computes the logits of every token it decodes (perplexity needs them; the
  /// retrieval streams do not, and the full cache then computes the last token's only).
  bool stream_logits = true;

  /// Logits of the i-th token of the last feed.
  std::span<const float> logits(std::int64_t i) const { return logits_at(ctx_.get(), first_out_ + i); }
  llama_context* context() const { return ctx_.get(); }
  /// Bytes of K and V of `cells` cache cells in the context's cache type.
  std::int64_t kv_bytes(std::int64_t cells) const { return shape_.kv_bytes(cells, kv_type_); }
  /// Bytes of the K/V buffers llama.cpp allocated (computed: n_ctx * layers * 2 * kv_heads * head_dim
  /// elements of the cache type).
  std::int64_t kv_alloc_bytes() const { return kv_bytes(llama_n_ctx(ctx_.get())); }
  /// Bytes of the sequence's state as llama.cpp serialises it (llama_state_seq_get_size: the cells in use).
  std::int64_t kv_state_bytes() const { return std::int64_t(llama_state_seq_get_size(ctx_.get(), 0)); }
  const model_shape& shape() const { return shape_; }

 protected:
  /// The position the stream's next token takes.
  virtual std::int64_t next_pos() const = 0;

  /// Creates the runner's context with `p` (`cells` names its size in the error).
  void create_context(const llama_context_params& p, std::int64_t cells) {
    kv_type_ = p.type_k;
    ctx_.reset(llama_init_from_model(const_cast<llama_model*>(model_), p));
    if (!ctx_) infkv_tools::engine_fail("infkv-stream: cannot create a context of {} cells", cells);
  }

  /// answer_on of this runner's context.
  answer answer_on(llama_seq_id seq, std::span<const llama_token> question,
                   std::span<const std::vector<llama_token>> candidates, std::int64_t pos0, std::int64_t gen) {
    return stream::answer_on(ctx_.get(), seq, question, candidates, pos0, gen, stats_);
  }

  /// Decodes `toks` on sequence `seq` at positions pos0, pos0 + 1, ... with logits from batch
  /// index `out_from` on.
  void plain_decode(std::span<const llama_token> toks, std::int64_t pos0, std::int64_t out_from, llama_seq_id seq = 0) {
    decode_plain(ctx_.get(), toks, pos0, out_from, seq, stats_);
    first_out_ = out_from;
  }

  /// Records that the next `n` tokens of the stream were appended to the cache.
  void note_fed(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) cached_.push_back(fed_++);
  }

  const llama_model* model_;
  model_shape shape_;
  context_ptr ctx_;
  std::int64_t first_out_ = 0;
  ggml_type kv_type_ = GGML_TYPE_F16;
  std::vector<std::int64_t> cached_;  ///< stream indices of the cached tokens, ascending (= position order)
  std::int64_t fed_ = 0;
  infkv::llama_cpp::session_stats stats_;  ///< runners without a session: decodes and memory calls
};

/// The options of a session that evicts with policy `k`: what the policy captures
/// (session_options::for_policy), f16 key copies, the run's reduction, positions and threads.
inline infkv::llama_cpp::session_options session_options_for(kind k, const settings& s) {
  const infkv::llama_cpp::session_options base{
      .key_type = s.key_type,
      .keys = s.keys,
      .reduce = s.reduce,
      .positions = s.keep_positions ? infkv::llama_cpp::position_mode::keep : infkv::llama_cpp::position_mode::compact,
      .position_gap = s.position_gap,
      .position_span = s.position_span,
      .executor = {s.threads}};
  auto o = infkv_tools::with_policy(
      k, s, [&](const auto& p) { return infkv::llama_cpp::session_options::for_policy(p, base); });
  if (s.archive_bits > 0) {  // sequence 1, where questions are asked aside, is the archive's scratch sequence too
    infkv::archive_options a;
    a.key_bits = a.value_bits = s.archive_bits;
    a.page_tokens = s.archive_page;
    a.capacity_bytes = std::size_t(s.archive_mib) << 20;
    o.archive = a;
    o.scratch_seq = 1;
  }
  if (s.question_known || s.reconstruct > 0 || s.gather_cells) o.scratch_seq = 1;
  o.gather_cells = s.gather_cells;
  if (s.reconstruct > 0) o.capture = true;  // the passes' queries and keys
  o.whole_segments = s.whole_segments;      // proxy queries decode the question there, as questions are asked
  o.score_global_layers = s.score_global_layers;
  return o;
}

/// An infkv session over a context of budget + max_feed cells, evicting with one policy.
class session_runner final : public runner {
 public:
  session_runner(const llama_model* m, kind k, const settings& s, std::int64_t max_feed)
      : runner(m),
        kind_(k),
        set_(s),
        budget_(*policy_budget(k, s)),
        cap_(s.budget + max_feed),
        session_(m, session_options_for(k, s)) {
    budget_.validate();
    auto p = runner_params(s, cap_ + reconstruct_room(s), std::max(max_feed, reconstruct_room(s)));
    if (s.reconstruct > 0) p.n_seq_max = 2;  // the passes decode on sequence 1
    session_.attach(p);
    const auto& rope = session_.rope();
    if (k == kind::expected_attention && rope.has_rope && !rope.supported)
      infkv_tools::fail(
          "--policy expected_attention: the model's RoPE ({}) is not one infkv can turn back "
          "(normal and NeoX only); its queries cannot be taken to before RoPE",
          rope.kind);
    set_.rotary = rope.has_rope ? std::optional(rope.params) : std::nullopt;
    create_context(p, cap_);
    session_.bind(ctx_.get());
  }

  void feed(std::span<const llama_token> toks, bool) override {
    if (set_.whole_segments) {  // sentences and lines
      segments_.resize(toks.size());
      for (std::size_t i = 0; i < toks.size(); ++i) segments_[i] = sentences_.next(model_, toks[i]);
    }
    const std::int32_t rc = session_.decode(
        toks,
        {.segments = set_.whole_segments ? std::span<const std::int32_t>(segments_) : std::span<const std::int32_t>()},
        true);
    if (rc != 0) infkv_tools::engine_fail("infkv-stream: llama_decode of {} tokens returned {}", toks.size(), rc);
    first_out_ = 0;
    note_fed(toks.size());
    INFKV_REQUIRE(session_.size() <= cap_, "session slots", session_.size(), "exceed budget + block = ", cap_,
                  ": the cache is not bounded");
  }

  std::int64_t evict(std::span<const llama_token> question) override {
    if (session_.size() <= set_.budget) return 0;
    std::vector<std::int64_t> before;  // positions in stream order, aligned with cached_
    for (const auto& t : session_.tokens()) before.push_back(t.pos);
    std::sort(before.begin(), before.end());
    const auto r = set_.reconstruct > 0 ? session_.evict_reconstructed(budget_, {.chunk = set_.reconstruct})
                                        : infkv_tools::with_policy(kind_, set_, [&](const auto& p) {
                                            return question.empty() ? session_.evict(p, budget_)
                                                                    : session_.evict(p, budget_, question, set_.proxy);
                                          });
    INFKV_REQUIRE(session_.size() <= set_.budget, "session slots after eviction", session_.size(),
                  "exceed --budget = ", set_.budget);
    std::size_t out = 0;
    for (std::size_t i = 0; i < before.size(); ++i) {
      const bool gone = std::any_of(r.removed.begin(), r.removed.end(),
                                    [&](const auto& run) { return before[i] >= run.begin && before[i] < run.end; });
      if (!gone) cached_[out++] = cached_[i];
    }
    cached_.resize(out);
    INFKV_REQUIRE(std::int64_t(out) == session_.size(), "infkv-stream: tracked stream tokens", out,
                  "differ from the session's slots ", session_.size());
    if (set_.prefetch_tokens > 0) {  // live prefetching: what the window's queries need comes back
      infkv_tools::with_policy(kind_, set_, [&](const auto& p) {
        return session_.recall(p, budget_, recall_options(set_.prefetch_tokens));
      });
      track_session();
    }
    return r.evicted;
  }

  /// With --recall, brings back from the archive what the question needs first (decoded aside on
  /// the scratch sequence), then asks it aside as every runner does.
  answer ask(std::span<const llama_token> question, std::span<const std::vector<llama_token>> candidates,
             std::int64_t gen) override {
    if (set_.recall_tokens > 0) {
      infkv_tools::with_policy(kind_, set_, [&](const auto& p) {
        return session_.recall(p, budget_, recall_options(set_.recall_tokens), question);
      });
      track_session();
    }
    return runner::ask(question, candidates, gen);
  }

  void evicts_above(std::int64_t above) override { session_.evicts_above(above); }
  std::int64_t slots() const override { return session_.size(); }
  std::int64_t next_pos() const override { return session_.next_pos(); }
  infkv::llama_cpp::session_stats stats() const override { return session_.stats(); }

  /// What the session holds beside llama.cpp's cache (session::memory()).
  std::int64_t host_bytes() const override { return session_.memory().total(); }
  std::int64_t archive_bytes() const override {
    return session_.archive() ? std::int64_t(session_.archive()->held_bytes()) : 0;
  }

 private:
  infkv::cpu::recall_options recall_options(std::int64_t tokens) const {
    return {.budget_tokens = tokens,
            .candidates = set_.recall_candidates,
            .recency_bias = set_.recall_bias,
            .neighbours = set_.recall_neighbours,
            .distance = set_.recall_distance >= 0 ? std::optional(set_.recall_distance) : std::nullopt};
  }
  /// After a recall: the stream tokens cached are the session's origins (a slot's stream index).
  void track_session() {
    cached_.clear();
    for (const auto o : session_.origins()) cached_.push_back(o);
    std::sort(cached_.begin(), cached_.end());
  }

  kind kind_;
  settings set_;
  infkv::budget budget_;
  std::int64_t cap_;
  infkv::llama_cpp::session session_;
  std::vector<std::int32_t> segments_;  // the segment of each token of a feed
  sentence_counter sentences_;          // ... with whole_segments
};

/// No eviction: a context large enough for the whole stream.
class full_runner final : public runner {
 public:
  full_runner(const llama_model* m, const settings& s, std::int64_t total, std::int64_t max_feed) : runner(m) {
    auto p = runner_params(s, total, max_feed);
    create_context(p, total);
  }
  void feed(std::span<const llama_token> toks, bool) override {
    plain_decode(toks, n_, stream_logits ? 0 : std::int64_t(toks.size()) - 1);
    n_ += std::int64_t(toks.size());
    note_fed(toks.size());
  }
  std::int64_t evict(std::span<const llama_token>) override { return 0; }
  std::int64_t slots() const override { return n_; }
  std::int64_t next_pos() const override { return n_; }

 private:
  std::int64_t n_ = 0;
};

/// Sliding window with recompute: each fed block goes into a cleared cache after the last
/// `budget` tokens before it (positions from 0), so every block sees an exact, freshly computed
/// window. Costs (budget + block) tokens of compute per block.
class recompute_runner final : public runner {
 public:
  recompute_runner(const llama_model* m, const settings& s, std::int64_t max_feed) : runner(m), budget_(s.budget) {
    auto p = runner_params(s, s.budget + max_feed, s.budget + max_feed);
    create_context(p, s.budget + max_feed);
  }
  void feed(std::span<const llama_token> toks, bool extend) override {
    if (extend && n_ > 0) {
      plain_decode(toks, n_, 0);
      n_ += std::int64_t(toks.size());
    } else {
      n_ = rebuild(toks) + std::int64_t(toks.size());
    }
    history_.insert(history_.end(), toks.begin(), toks.end());
    note_fed(toks.size());
  }
  std::int64_t evict(std::span<const llama_token>) override {
    const std::int64_t gone = std::max<std::int64_t>(0, n_ - budget_);
    n_ = std::min(n_, budget_);
    cached_.erase(cached_.begin(), cached_.begin() + gone);
    return gone;
  }
  std::int64_t slots() const override { return n_; }
  std::int64_t next_pos() const override { return n_; }
  /// The question goes after the last `budget` tokens of the stream in a rebuilt cache, as a
  /// block would; the next feed rebuilds the cache anyway.
  answer ask(std::span<const llama_token> question, std::span<const std::vector<llama_token>> candidates,
             std::int64_t gen) override {
    const std::int64_t prefix = rebuild({});
    n_ = 0;  // nothing of the stream to extend: the next feed starts afresh
    return answer_on(0, question, candidates, prefix, gen);
  }

 private:
  /// Clears the cache and decodes the last `budget` tokens of the stream, then `toks` (logits
  /// for `toks`, or for the last token when there are none); returns the tokens before `toks`.
  std::int64_t rebuild(std::span<const llama_token> toks) {
    llama_memory_clear(llama_get_memory(ctx_.get()), true);
    const std::size_t prefix = std::min<std::size_t>(std::size_t(budget_), history_.size());
    std::vector<llama_token> all(history_.end() - std::ptrdiff_t(prefix), history_.end());
    all.insert(all.end(), toks.begin(), toks.end());
    if (!all.empty()) plain_decode(all, 0, std::min<std::int64_t>(std::int64_t(prefix), std::int64_t(all.size()) - 1));
    return std::int64_t(prefix);
  }

  std::int64_t budget_;
  std::int64_t n_ = 0;
  std::vector<llama_token> history_;
};

/// llama.cpp's own context shift, as its examples do it (no infkv, no callback): a context of
/// budget + max_feed cells; when the next feed does not fit, keep the first `sinks` tokens,
/// remove half of the rest (llama_memory_seq_rm) and move the other half down over the gap
/// (llama_memory_seq_add). The cache then holds between about half and all of its cells.
class shift_runner final : public runner {
 public:
  shift_runner(const llama_model* m, const settings& s, std::int64_t max_feed)
      : runner(m), n_ctx_(s.budget + max_feed), keep_(s.sinks) {
    auto p = runner_params(s, n_ctx_, max_feed);
    create_context(p, n_ctx_);
    if (!llama_memory_can_shift(llama_get_memory(ctx_.get())))
      infkv_tools::fail(
          "--policy context_shift: this model's cache cannot shift positions (llama_memory_can_shift = false)");
    INFKV_REQUIRE(keep_ + max_feed < n_ctx_, "--sinks", keep_, "leaves no room to shift in a context of ", n_ctx_,
                  " cells with blocks of ", max_feed);
  }
  void feed(std::span<const llama_token> toks, bool) override {
    const auto n = std::int64_t(toks.size());
    while (n_ + n > n_ctx_) {  // llama.cpp's examples: discard half of what follows n_keep
      const std::int64_t discard = (n_ - keep_) / 2;
      llama_memory_t mem = llama_get_memory(ctx_.get());
      bool ok = false;
      {
        const infkv::llama_cpp::stopwatch w{stats_.seq_rm};
        ok = llama_memory_seq_rm(mem, 0, llama_pos(keep_), llama_pos(keep_ + discard));
      }
      if (!ok) infkv_tools::engine_fail("infkv-stream: llama_memory_seq_rm(0, {}, {}) = false", keep_, keep_ + discard);
      {
        const infkv::llama_cpp::stopwatch w{stats_.seq_add};
        llama_memory_seq_add(mem, 0, llama_pos(keep_ + discard), llama_pos(n_), llama_pos(-discard));
      }
      cached_.erase(cached_.begin() + keep_, cached_.begin() + keep_ + discard);
      n_ -= discard, pending_ += discard;
      ++stats_.evictions;
    }
    plain_decode(toks, n_, 0);
    n_ += n;
    note_fed(toks.size());
  }
  std::int64_t evict(std::span<const llama_token>) override { return std::exchange(pending_, 0); }
  std::int64_t slots() const override { return n_; }
  std::int64_t next_pos() const override { return n_; }

 private:
  std::int64_t n_ctx_, keep_;
  std::int64_t n_ = 0, pending_ = 0;  // cached tokens; tokens discarded since the last evict()
};

/// A runner for policy `k`: `total` is the stream's length (for full), `max_feed` the most
/// tokens fed between two evictions.
inline std::unique_ptr<runner> make_runner(const llama_model* m, kind k, const settings& s, std::int64_t total,
                                           std::int64_t max_feed) {
  switch (k) {
    case kind::full: return std::make_unique<full_runner>(m, s, total, max_feed);
    case kind::recompute: return std::make_unique<recompute_runner>(m, s, max_feed);
    case kind::context_shift: return std::make_unique<shift_runner>(m, s, max_feed);
    default: return std::make_unique<session_runner>(m, k, s, max_feed);
  }
}

}  // namespace stream
