// infkv llama.cpp adapter: what a session is configured with and what it reports: the position
// mode, the memory calls it makes, its options (and the options a policy needs), the metadata of
// decoded tokens, where its time went, the bytes it holds, and what one eviction did.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <llama.h>

#include <infkv/cpu/executor.hpp>
#include <infkv/infkv.hpp>

namespace infkv::llama_cpp {

/// What happens to positions after an eviction.
enum class position_mode : std::uint8_t {
  compact,  ///< close the gaps (llama_memory_seq_add): positions stay 0..n-1; needs can_shift
  keep,     ///< original positions, holes left (M-RoPE models, or by choice)
};

/// Where the keys (and values) a policy scores come from.
enum class key_source : std::uint8_t {
  /// llama.cpp's cache where the session can read it (decided at the first decode: one cache of
  /// f32, f16 or bf16 rows in host memory, V in rows where values are read, no sliding-window
  /// layers, no archive, no H2O), a copy otherwise.
  automatic,
  copy,    ///< a host copy of every cached token's K (V) rows, taken from the graph at every decode
  engine,  ///< llama.cpp's cache, read where it lies when a policy scores (raises where it cannot)
};

/// How the queries of a question known in advance (proxy queries: `session::evict(p, b, question,
/// mode)`) are computed. Both decode the question on the scratch sequence (session_options::
/// scratch_seq) and leave it empty again; the session's own sequence is untouched.
enum class proxy_mode : std::uint8_t {
  /// At every eviction the question is decoded after the cache, sharing the session's cells: its
  /// queries have attended to what the cache holds then. One decode of the question per eviction.
  after_cache,
  /// The question is decoded once, alone (it attends to itself only), at the first eviction that
  /// asks; at every eviction its queries are turned to the positions after the cache. One decode
  /// in all; needs a RoPE infkv can turn (normal or NeoX), or none.
  alone,
};

/// The llama.cpp memory calls a session makes to change the cache: llama.h's by default. An engine
/// that wraps its memory passes its own; tests pass failing ones to check that the session's
/// bookkeeping still follows the memory when the engine refuses.
struct memory_calls {
  std::function<bool(llama_memory_t, llama_seq_id, llama_pos, llama_pos)> seq_rm = llama_memory_seq_rm;
  std::function<void(llama_memory_t, llama_seq_id, llama_pos, llama_pos, llama_pos)> seq_add = llama_memory_seq_add;
  std::function<bool(llama_memory_t)> can_shift = llama_memory_can_shift;
  /// The archive's route to the cache's rows (session_options::archive): cells shared into the
  /// scratch sequence, its state read, and a state written back into it.
  std::function<void(llama_memory_t, llama_seq_id, llama_seq_id, llama_pos, llama_pos)> seq_cp = llama_memory_seq_cp;
  std::function<std::size_t(llama_context*, std::uint8_t*, std::size_t, llama_seq_id)> state_get =
      [](llama_context* c, std::uint8_t* dst, std::size_t n, llama_seq_id s) {
        return llama_state_seq_get_data(c, dst, n, s);
      };
  std::function<std::size_t(llama_context*, const std::uint8_t*, std::size_t, llama_seq_id)> state_set =
      [](llama_context* c, const std::uint8_t* src, std::size_t n, llama_seq_id s) {
        return llama_state_seq_set_data(c, src, n, s);
      };
};

/// Session configuration.
struct session_options {
  llama_seq_id seq = 0;      ///< the sequence the session owns
  std::int64_t window = 32;  ///< recent queries kept per layer (0: none, for policies that read none)
  /// Type of the host copy of the keys (and values): f32 or f16. Unset: the cache's own (f16 for
  /// an f16 cache, the default; f32 for f32 and bf16 caches; f16 for quantized ones). Set to
  /// another type than the cache's, it asks for the copy (key_source::automatic takes it).
  std::optional<dtype> key_type{};
  /// Where the scored keys come from: llama.cpp's own cache needs no copy (the session then holds
  /// the window queries and each cached token's cell, and asks for no key node of the graph).
  key_source keys = key_source::automatic;
  /// The caller evicts as soon as size() exceeds this (a block stream's budget + block - 1, or
  /// capacity + slack): the session then observes queries only on the decodes whose tokens can
  /// fall in that eviction's window (the last `window` before it), and every other decode runs
  /// llama.cpp's graph unsplit. An eviction that reads window queries the session did not observe
  /// raises. Unset: queries are observed at every decode. Ignored while H2O observes every decode.
  std::optional<std::int64_t> evicts_above{};
  bool values = false;  ///< also read the values (value-norm policies)
  /// Observe the graph (queries, and the keys' cells or copies). false: no cb_eval at all, no
  /// host copies, nothing to re-rotate; for policies that read neither (streaming_llm, window),
  /// which then cost the decode nothing. Evicting with a policy that reads them raises.
  bool capture = true;
  reduction reduce = reduction::mean;  ///< heads and layers -> one score per token
  /// Keep whole segments first (cpu::select_whole_segments over the per-token scores): a
  /// sentence, a line, an image tile or frame group stays whole or leaves whole while the room
  /// allows, the rest is filled token by token. Segments come from token_meta.
  bool whole_segments = false;
  /// On a model with sliding-window layers (Gemma 3; llama.cpp's iSWA cache), the policies score
  /// its global layers only: a sliding layer's queries look one window back, and their scores
  /// over older keys, which that layer never attends to, outweigh the global layers'. Which
  /// layers are global is found once, at the first eviction, from llama.cpp's state (the global
  /// layers' cache's rows matched against the key copies). No effect on other models.
  bool score_global_layers = false;
  position_mode positions = position_mode::compact;  ///< falls back to keep when the memory cannot shift
  /// Compact mode: the gap between two kept runs is narrowed to at most this many positions
  /// instead of closed (0: positions 0..n-1), so runs far apart in the stream stay apart; the
  /// positions then span at most (kept slots) x (1 + position_gap). Recall needs
  /// recall_options::distance with it (the recaller's landing rule closes gaps).
  std::int64_t position_gap = 0;
  /// Compact mode, instead of a fixed gap: at each compaction the gaps are narrowed to the largest
  /// gap that keeps the cached positions within [0, position_span) (0: unset), so runs keep as
  /// much of their spacing in the stream as fits, e.g. a model's trained context less a block
  /// and a question. Recall needs recall_options::distance with it, as with position_gap.
  std::int64_t position_span = 0;
  std::optional<h2o> track_h2o{};  ///< accumulate H2O scores at every decode
  /// Threads for scoring and re-rotation: a lent pool, or (threads > 1 without one) a pool the
  /// session keeps for its whole life.
  cpu::executor executor{};
  float scale = 0.f;      ///< attention scale; 0 = 1/sqrt(head_dim)
  memory_calls memory{};  ///< how the cache is changed (llama.h by default)
  /// Keep the stream in an archive, for `session::recall`: per_token pages of every layer's K and
  /// V, read from llama.cpp's cache and written through (each eviction first archives what the
  /// stream wrote since the last, so nothing leaves the cache unarchived). Needs positions = keep
  /// (recalled rows go back at their own positions), an f32 or f16 cache in one unified stream,
  /// and `scratch_seq`.
  std::optional<archive_options> archive{};
  /// A sequence of the context nobody else uses: the archive reads and writes the cache's rows
  /// through it (llama_state_seq_*), recall and proxy queries decode their question on it; each
  /// leaves it empty after every call.
  llama_seq_id scratch_seq = -1;
  /// After each eviction, move the cached cells that lie at or above the number of slots kept
  /// into the free cells below it (through `scratch_seq`: llama_state_seq_*), so that llama.cpp
  /// writes the next decode's tokens into one run of cells rather than into the cells a scoring
  /// policy's eviction scattered, which its CPU flash attention decodes measurably slower
  /// (docs/performance.md, section 1). Acts where the policies read llama.cpp's cache
  /// (key_source::automatic found it readable, or engine) and no position shift is pending from
  /// an earlier eviction; the cells are moved before this eviction's compaction shift. Needs
  /// `scratch_seq`; not on M-RoPE models (their tokens share positions).
  bool gather_cells = false;

  /// `base` (defaults otherwise) set to capture what `policy` reads (capture_needs_of): its
  /// window queries, the values where it weights by them, nothing at all where it reads nothing
  /// (streaming_llm), H2O's running scores where it reads accumulated attention.
  template <policy P>
  static session_options for_policy(const P& policy, session_options base = {}) {
    const capture_needs needs = capture_needs_of(policy);
    base.window = needs.queries;
    base.values = needs.values;
    base.capture = needs.observes();
    base.track_h2o.reset();
    if (const auto a = policy.spec().accumulates())
      base.track_h2o = h2o{.normalize_lifetime = a->normalize_lifetime, .forgetting = a->forgetting};
    return base;
  }
};

/// Metadata given to the tokens of one decode call.
struct token_meta {
  std::int32_t segment = 0;
  modality kind = modality::text;
  /// One segment per token of the batch (e.g. a text's sentences and lines), in place of
  /// `segment`; empty: every token gets `segment`.
  std::span<const std::int32_t> segments{};
};

/// Where a session's time went, in seconds, accumulated since bind (or reset_stats()).
struct session_stats {
  double decode = 0;      ///< llama_decode: the graph, the capture callbacks and llama.cpp's K-shift included
  double capture = 0;     ///< inside cb_eval: copying Q / K (V) rows out of the graph (part of decode)
  double append = 0;      ///< after each decode: rows into the host copies (f16 conversion, query windows)
  double h2o = 0;         ///< H2O's attention of every decoded query (track_h2o)
  double score = 0;       ///< the policy's pipeline: scores and selection (from llama.cpp's cache or the copies)
  double seq_rm = 0;      ///< llama_memory_seq_rm
  double seq_add = 0;     ///< llama_memory_seq_add (llama.cpp rotates its K at the next decode)
  double host_evict = 0;  ///< compacting the host copies, query windows and H2O states
  double rerotate = 0;    ///< re-rotating the host keys and queries after a position compaction
  double archive = 0;     ///< reading new rows out of llama.cpp's cache and quantizing them (archive)
  double recall = 0;      ///< recall: ranking, scoring, restoring rows (its archiving and removal included)
  double proxy = 0;  ///< proxy queries: decoding a known question aside and turning its queries (evict with a question)
  double reconstruct = 0;  ///< context reconstruction: the passes decoded aside and their scores (KVzip)
  double gather = 0;       ///< moving cells together after an eviction (session_options::gather_cells)
  std::int64_t decodes = 0, decoded_tokens = 0, evictions = 0;
  std::int64_t gathered = 0;  ///< cells moved by gather_cells
  std::int64_t observed = 0;  ///< decodes whose graph was split to copy rows out (the others ran unsplit)
  /// The session's own work outside llama_decode.
  double overhead() const {
    return append + h2o + score + seq_rm + seq_add + host_evict + rerotate + archive + proxy + reconstruct + gather;
  }
};

/// How session::reconstruct repeats the cached tokens (context reconstruction, KVzip). The
/// prompts are kvpress's KVzipPress's for a model without a chat template.
struct reconstruction_options {
  std::int64_t chunk = 512;  ///< cached tokens repeated per pass (kvpress: 2048): bounds the pass's memory
  std::int64_t tail = 8;     ///< the previous chunk's last tokens quoted after `next` (kvpress: 8)
  std::int64_t sinks = 4;    ///< the first tokens every later pass also attends to (kvpress's n_sink)
  std::string first = "\n\nRepeat the previous context exactly.";
  std::string next = "\n\nRepeat the part of the previous context exactly, starting with";
  std::string suffix = "\n";  ///< after the prompt, before the chunk
  /// Token ids used in place of first, next and suffix where not empty (the texts are tokenized
  /// with the model's vocabulary otherwise).
  std::vector<llama_token> first_ids{}, next_ids{}, suffix_ids{};
};

/// Bytes a session holds beside llama.cpp's cache (`session::memory()`), and llama.cpp's own K and
/// V for comparison.
struct session_memory {
  std::int64_t keys = 0;     ///< host copies of the cached keys, every layer (in the key type)
  std::int64_t values = 0;   ///< host copies of the values (policies that weight by value norms)
  std::int64_t queries = 0;  ///< window queries, the queries kept of the last decode, a question's (proxy_mode::alone)
  std::int64_t h2o = 0;      ///< H2O's accumulators (track_h2o)
  std::int64_t workspace = 0;  ///< the pipeline's workspace, kept between evictions
  std::int64_t tokens = 0;     ///< the position bookkeeping (and each cached token's cell, key_source::engine)
  std::int64_t archive = 0;    ///< the archive (session_options::archive), allocated at bind
  std::int64_t scores = 0;     ///< the last reconstruct()'s scores (a float per layer, KV head and slot)
  std::int64_t gather = 0;     ///< gather_cells' buffer: the state of the most cells one eviction moved
  /// llama.cpp's K and V of the context's cells: n_ctx x layers x KV heads x head_dim in its K and V
  /// types (computed; 0 before the first decode shows the heads).
  std::int64_t kv = 0;
  std::int64_t total() const { return keys + values + queries + h2o + workspace + tokens + archive + scores + gather; }
};

/// What one recall did.
struct recall_report {
  std::int64_t pages = 0;               ///< archive pages recalled from (they stay archived)
  std::int64_t tokens = 0;              ///< slots brought back (as many cached slots were displaced)
  std::vector<std::int64_t> positions;  ///< the positions brought back
};

/// What one eviction did.
struct eviction_result {
  std::int64_t evicted = 0;           ///< slots removed
  std::int64_t kept = 0;              ///< slots left
  std::vector<position_run> removed;  ///< position runs removed, before any shift
  bool shifted = false;               ///< positions were compacted
};

}  // namespace infkv::llama_cpp
