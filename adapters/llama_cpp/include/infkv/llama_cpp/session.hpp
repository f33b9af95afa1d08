// infkv llama.cpp adapter: a session over one llama_context and one sequence id. It observes
// post-RoPE queries through `cb_eval` and keeps each layer's recent ones, copied straight from the
// graph (detail/layer_cache.hpp), on the decodes whose queries the next eviction reads
// (session_options::evicts_above); policies score llama.cpp's own K (V) rows where they lie, found
// through the cells the graph writes them to, or, where that cannot be (key_source), a host copy
// of each layer's keys (values) taken at every decode (memory() says what the session holds);
// its position <-> slot bookkeeping is detail/positions.hpp (llama.h has no public cell ->
// position map), its options and reports session_options.hpp. It evicts by removing position runs
// with llama_memory_seq_rm and, in compact mode, closes the gaps with llama_memory_seq_add
// (llama.cpp re-rotates its K; the session re-rotates its own copy). Per-token granularity: head
// and layer scores are combined by the chosen reduction.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <llama.h>

#include <infkv/cpu.hpp>
#include <infkv/infkv.hpp>

#include "capture.hpp"
#include "detail/archive_link.hpp"
#include "detail/layer_cache.hpp"
#include "detail/positions.hpp"
#include "model_info.hpp"
#include "session_options.hpp"

namespace infkv::llama_cpp {

/// A session over one llama_context and sequence. Usage: construct from the model, `attach` to
/// the context parameters, create the context, `bind` it, then `decode` and `evict`.
/// Not copyable or movable (the context holds its address).
class session {
  /// One layer's K and V cache tensors in llama.cpp (key_source::engine).
  struct cache_tensors {
    const ggml_tensor* k = nullptr;
    const ggml_tensor* v = nullptr;
  };

 public:
  explicit session(const llama_model* model, session_options opt = {})
      : model_(model), opt_(opt), observer_(checked_layers(model), opt.values, [this](const node_rows& r) {
          if (r.kind == node_kind::key && pass_capture_) return take_pass_keys(r);
          layers_[std::size_t(r.layer)].take(r);
        }) {
    INFKV_REQUIRE(opt_.window >= 0, "session_options.window", opt_.window, "must be >= 0");
    INFKV_REQUIRE(!opt_.key_type || *opt_.key_type != dtype::bf16, "session_options.key_type", "bf16",
                  "must be f32 or f16 (keys are re-rotated in place: bf16 would lose precision at every shift)");
    INFKV_REQUIRE(opt_.seq >= 0, "session_options.seq", opt_.seq, "must be >= 0");
    INFKV_REQUIRE(opt_.position_gap >= 0, "session_options.position_gap", opt_.position_gap, "must be >= 0");
    INFKV_REQUIRE(opt_.position_gap == 0 || opt_.positions == position_mode::compact, "session_options.position_gap",
                  opt_.position_gap, "narrows gaps in position_mode::compact; with keep the gaps stay whole");
    INFKV_REQUIRE(opt_.position_span >= 0, "session_options.position_span", opt_.position_span, "must be >= 0");
    INFKV_REQUIRE(opt_.position_span == 0 || opt_.positions == position_mode::compact, "session_options.position_span",
                  opt_.position_span, "bounds compacted positions; with position_mode::keep the gaps stay whole");
    INFKV_REQUIRE(opt_.position_span == 0 || opt_.position_gap == 0, "session_options.position_span",
                  opt_.position_span, "and position_gap = ", opt_.position_gap, ": choose one");
    book_ = detail::position_book(opt_.position_gap, opt_.position_span);
    if (opt_.track_h2o) opt_.track_h2o->validate();
    INFKV_REQUIRE(opt_.capture || (!opt_.values && !opt_.track_h2o), "session_options.capture", "false",
                  opt_.values ? "values = true" : "track_h2o", " needs the graph observed: set capture = true");
    INFKV_REQUIRE(opt_.memory.seq_rm && opt_.memory.seq_add && opt_.memory.can_shift, "session_options.memory", "empty",
                  "every call must be set (the defaults are llama.h's)");
    if (opt_.executor.threads > 1 && opt_.executor.pool == nullptr) {
      pool_ = std::make_unique<cpu::thread_pool>(opt_.executor.threads);
      opt_.executor.pool = pool_.get();
    }
    cpu::workers(opt_.executor, 1);  // checks the executor
    if (opt_.archive) {
      INFKV_REQUIRE(opt_.positions == position_mode::keep || llama_model_n_swa(model) == 0, "session_options.positions",
                    "compact",
                    "an archive on a model with sliding-window layers needs position_mode::keep (recall into "
                    "compacted positions is built for one cache of global layers)");
      INFKV_REQUIRE(opt_.scratch_seq >= 0 && opt_.scratch_seq != opt_.seq, "session_options.scratch_seq",
                    opt_.scratch_seq, "an archive needs a second sequence of the context (not seq = ", opt_.seq, ")");
      INFKV_REQUIRE(!opt_.track_h2o, "session_options.track_h2o", "set",
                    "an archive recalls with a policy that reads queries; H2O's running scores cannot follow it");
      archive_.emplace(model, *opt_.archive);
    }
    INFKV_REQUIRE(!opt_.gather_cells || (opt_.scratch_seq >= 0 && opt_.scratch_seq != opt_.seq),
                  "session_options.scratch_seq", opt_.scratch_seq,
                  "gather_cells moves cells through a second sequence of the context (not seq = ", opt_.seq, ")");
    INFKV_REQUIRE(!opt_.evicts_above || *opt_.evicts_above >= 0, "session_options.evicts_above", *opt_.evicts_above,
                  "must be >= 0");
    INFKV_REQUIRE(opt_.keys != key_source::engine || opt_.capture, "session_options.keys", "engine",
                  "needs capture = true (the cells are found in the graph)");
    INFKV_REQUIRE(!opt_.score_global_layers || opt_.capture, "session_options.score_global_layers", "true",
                  "needs capture = true (the global layers are found among the key copies)");
    layers_.assign(std::size_t(llama_model_n_layer(model)), layer_cache(opt_.key_type.value_or(dtype::f16)));
    rope_ = model_rope(model);
    INFKV_REQUIRE(!opt_.gather_cells || rope_.supported, "session_options.gather_cells", "true",
                  "moves cells one position at a time; this model's RoPE (", rope_.kind,
                  ") gives tokens shared positions");
    layer_rope_.assign(layers_.size(), rope_);
    n_swa_ = llama_model_n_swa(model);
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  /// Routes `p.cb_eval` to the session (a callback already set keeps being called) and records
  /// the RoPE overrides of `p`. For a model with sliding-window layers (llama.cpp's iSWA cache,
  /// Gemma 3) it sets `p.swa_full`: llama.cpp shifts positions (compact mode) only when the
  /// sliding layers' cache is as large as the others'. Call before creating the context from `p`.
  void attach(llama_context_params& p) {
    if (opt_.capture) observer_.install(p);
    key_type_ =
        opt_.key_type.value_or(p.type_k == GGML_TYPE_F32 || p.type_k == GGML_TYPE_BF16 ? dtype::f32 : dtype::f16);
    layers_.assign(layers_.size(), layer_cache(key_type_));
    type_k_ = p.type_k, type_v_ = p.type_v;
    rope_ = model_rope(model_, p.rope_freq_base, p.rope_freq_scale);
    layer_rope_.assign(layers_.size(), rope_);
    if (n_swa_ > 0) p.swa_full = true;
    attached_ = true;
  }

  /// Binds the context created from the attached parameters. The sequence must be empty.
  void bind(llama_context* ctx) {
    if (ctx == nullptr) infkv::fail("infkv: ctx = null: a llama_context is required");
    INFKV_REQUIRE(attached_, "attached", "false", "call attach(params) before creating the context");
    ctx_ = ctx;
    mem_ = llama_get_memory(ctx);
    if (mem_ == nullptr) infkv::raise<engine_error>("infkv: llama_get_memory(ctx) = null: the context has no memory");
    // llama.cpp asserts (ends the process) on a sequence id beyond the context's.
    INFKV_REQUIRE(opt_.seq < std::int64_t(llama_n_seq_max(ctx)), "session_options.seq", opt_.seq,
                  "must be below the context's n_seq_max = ", llama_n_seq_max(ctx));
    const llama_pos pmax = llama_memory_seq_pos_max(mem_, opt_.seq);
    INFKV_REQUIRE(pmax < 0, "llama_memory_seq_pos_max(seq)", pmax, "the sequence must be empty at bind");
    if (archive_ || opt_.gather_cells) {
      INFKV_REQUIRE(opt_.scratch_seq < std::int64_t(llama_n_seq_max(ctx)), "session_options.scratch_seq",
                    opt_.scratch_seq, "must be below the context's n_seq_max = ", llama_n_seq_max(ctx));
      INFKV_REQUIRE(llama_memory_seq_pos_max(mem_, opt_.scratch_seq) < 0, "session_options.scratch_seq",
                    opt_.scratch_seq, "must be an empty sequence at bind (", archive_ ? "the archive" : "gather_cells",
                    " uses it)");
    }
    shift_ =
        opt_.positions == position_mode::compact && opt_.memory.can_shift(mem_) && (rope_.supported || !rope_.has_rope);
    // llama.cpp's cache can be read by the policies unless something needs the copies (decided
    // for good at the first decode, which also shows where the rows lie).
    const char* why_not = opt_.keys == key_source::copy ? "copy"
                          : opt_.archive                ? "the archive recalls rows into the copies"
                          : opt_.track_h2o              ? "H2O scores every decode against the copies"
                          : n_swa_ > 0                  ? "llama.cpp drops sliding-window layers' old cells itself"
                          : !readable(type_k_)          ? "type_k is quantized"
                          : opt_.values && !readable(type_v_)                    ? "type_v is quantized"
                          : opt_.key_type && *opt_.key_type != dtype_of(type_k_) ? "key_type differs from the cache's"
                                                                                 : nullptr;
    if (why_not != nullptr && opt_.keys == key_source::engine)
      infkv::raise<invalid_argument>("infkv: session_options.keys = engine: ", why_not,
                                     ": the policies cannot score llama.cpp's rows; use key_source::copy");
    decided_ = !opt_.capture || why_not != nullptr;
  }

  llama_context* context() const { return ctx_; }
  const session_options& options() const { return opt_; }
  /// The position mode in effect (compact only where the memory can shift).
  position_mode mode() const { return shift_ ? position_mode::compact : position_mode::keep; }
  /// The model's RoPE (from its metadata).
  const rope_info& rope() const { return rope_; }
  /// The type of the host key (and value) copies: session_options::key_type, or the cache's own
  /// (known once attached).
  dtype key_type() const { return key_type_; }
  /// The RoPE layer `layer` applies: read from its key node after the first decode (layers may
  /// differ, e.g. Gemma 3's sliding layers), the model's before.
  const rope_info& layer_rope(std::int32_t layer) const {
    INFKV_REQUIRE(layer >= 0 && layer < n_layers(), "layer", layer, "must be in [0, ", n_layers(), ")");
    return layer_rope_[std::size_t(layer)];
  }
  /// From now on the caller evicts as soon as size() exceeds `above` (session_options::
  /// evicts_above; nullopt: queries are observed at every decode again).
  void evicts_above(std::optional<std::int64_t> above) {
    INFKV_REQUIRE(!above || *above >= 0, "evicts_above", above.value_or(0), "must be >= 0");
    opt_.evicts_above = above;
  }
  /// Where the scored keys come from now: engine once the first decode showed llama.cpp's rows
  /// readable (key_source), copy otherwise (also before the first decode decides).
  key_source keys() const { return engine_ ? key_source::engine : key_source::copy; }
  /// The bytes the session holds now (capacity of its buffers) and llama.cpp's K and V bytes.
  session_memory memory() const {
    session_memory m;
    for (const auto& l : layers_) {
      m.keys += l.key_bytes(), m.values += l.value_bytes(), m.queries += l.query_bytes();
      if (ctx_ != nullptr)
        m.kv += std::int64_t(llama_n_ctx(ctx_)) * std::int64_t(ggml_row_size(type_k_, l.n_head_kv() * l.head_dim()) +
                                                               ggml_row_size(type_v_, l.n_head_kv() * l.head_dim()));
    }
    for (const auto* v : {&alone_, &turned_})  // proxy_mode::alone's queries of the question
      for (const auto& q : *v) m.queries += std::int64_t(q.capacity() * sizeof(float));
    for (const auto& h : h2o_) m.h2o += h.bytes();
    m.workspace = workspace_ ? std::int64_t(workspace_->span().size()) : 0;
    m.tokens = book_.bytes() + std::int64_t(cells_.capacity() * sizeof(std::int32_t));
    m.archive = archive_ ? archive_->bytes() : 0;
    for (const auto& r : recon_) m.scores += std::int64_t(r.data.capacity() * sizeof(float));
    m.gather = std::int64_t(gather_buf_.capacity());
    return m;
  }
  /// Where the time went since bind (or the last reset_stats()).
  const session_stats& stats() const { return stats_; }
  /// The archive of what evictions removed (session_options::archive), or null.
  const infkv::archive* archive() const { return archive_ ? &archive_->store() : nullptr; }
  void reset_stats() { stats_ = {}; }
  /// Metadata of the cached tokens, in the session's slot order.
  std::span<const token> tokens() const { return book_.tokens(); }
  /// Each cached slot's position in the stream as keep mode would hold it: tokens()'s positions
  /// in keep mode, and in compact mode their positions before every compaction moved them.
  std::span<const std::int64_t> origins() const { return book_.origins(); }
  std::int64_t size() const { return book_.size(); }
  std::int32_t n_layers() const { return std::int32_t(layers_.size()); }
  /// Position the next decoded token gets: one past the newest cached position (llama.cpp wants
  /// consecutive positions), or the stream's next position when nothing is cached; at least the
  /// end of what reserve_positions() took.
  std::int64_t next_pos() const { return book_.next_pos(); }
  /// Marks the stream positions below `end` as taken (keep mode only): an M-RoPE image puts all
  /// its rows at one t but takes mtmd_input_chunk_get_n_pos stream positions, which the text
  /// after it must skip. prefill calls it after every explicitly positioned chunk.
  void reserve_positions(std::int64_t end) {
    INFKV_REQUIRE(end >= 0 && end <= max_position, "end", end, "must be in [0, 2^62]");
    INFKV_REQUIRE(mode() == position_mode::keep, "end", end,
                  "reserving positions needs position_mode::keep (compaction renumbers them)");
    book_.reserve(end);
  }

  /// The inputs a policy scores for one layer: keys and values (when read) as rows of llama.cpp's
  /// cache (key_source::engine: one cell per page) or of the session's copies (one page), window
  /// queries and their positions, tokens, H2O's accumulated scores (track_h2o), the layer's RoPE.
  /// The rows are valid until the next decode or eviction.
  layer_inputs<const_paged_rows> inputs(std::int32_t layer) {
    INFKV_REQUIRE(layer >= 0 && layer < n_layers(), "layer", layer, "must be in [0, ", n_layers(), ")");
    auto& l = layers_[std::size_t(layer)];
    const rope_info& r = layer_rope_[std::size_t(layer)];
    const cache_tensors c = engine_ ? caches_[std::size_t(layer)] : cache_tensors{};
    return {
        .keys = engine_ ? cache_rows(c.k, l) : one_page(l.keys()),
        .values = c.v != nullptr ? cache_rows(c.v, l) : one_page(l.values()),
        .queries = l.queries(),
        .query_pos = l.query_pos(),
        .tokens = book_.tokens(),
        .scale = opt_.scale,
        .accumulated = std::size_t(layer) < h2o_.size() ? h2o_[std::size_t(layer)].scores().view() : const_score_view{},
        .rotary = r.has_rope && r.supported ? std::optional(r.params) : std::nullopt};
  }
  /// The layers the policies score: every layer, or with session_options::score_global_layers on
  /// a model with sliding-window layers its global ones, found once from llama.cpp's state of the
  /// session's sequence (detail::global_layers_of; the archive's finding when it has one).
  const std::vector<std::int32_t>& scored_layers() {
    if (!scored_.empty()) return scored_;
    if (!opt_.score_global_layers || n_swa_ == 0) {
      for (std::int32_t l = 0; l < n_layers(); ++l) scored_.push_back(l);
      return scored_;
    }
    if (archive_ && !archive_->global_layers().empty()) return scored_ = archive_->global_layers();
    INFKV_REQUIRE(ctx_ != nullptr && size() > 0, "size()", size(),
                  "the global layers (session_options::score_global_layers) are found among cached tokens: decode "
                  "first");
    const auto& lc = layers_[0];
    std::vector<std::uint8_t> buf(llama_state_seq_get_size(ctx_, opt_.seq));
    const std::size_t got = opt_.memory.state_get(ctx_, buf.data(), buf.size(), opt_.seq);
    if (got != buf.size())
      infkv::raise<engine_error>("infkv: llama_state_seq_get_data(seq = ", opt_.seq, ") = ", got, " of ", buf.size(),
                                 " bytes: the global layers (session_options::score_global_layers) cannot be found");
    const auto parts = detail::parse_kv_states(buf, n_layers(), std::int64_t(lc.n_head_kv()) * lc.head_dim(), true);
    const auto slot = detail::cell_slots(buf, parts[0], detail::slots_by_position(tokens()));
    return scored_ =
               detail::global_layers_of(buf, parts[0], slot, all_inputs(), n_layers(), lc.n_head_kv(), lc.head_dim());
  }

  /// H2O state of one layer (requires session_options.track_h2o).
  const cpu::h2o_state& h2o_scores(std::int32_t layer) const {
    require_h2o();
    INFKV_REQUIRE(layer >= 0 && layer < std::int32_t(h2o_.size()), "layer", layer, "must be in [0, ", h2o_.size(),
                  ") (H2O states exist after the first decode)");
    return h2o_[std::size_t(layer)];
  }

  /// Decodes `tokens` at positions next_pos(), next_pos() + 1, ...; logits for the last token
  /// (or all when `all_logits`). Returns llama_decode's status; bookkeeping grows only on 0.
  std::int32_t decode(std::span<const llama_token> tokens, token_meta meta = {}, bool all_logits = false) {
    INFKV_REQUIRE(!tokens.empty(), "tokens.size()", 0, "decode needs at least one token");
    llama_batch b = llama_batch_init(std::int32_t(tokens.size()), 0, 1);
    const std::int64_t p0 = next_pos();
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      b.token[i] = tokens[i];
      b.pos[i] = llama_pos(p0 + std::int64_t(i));
      b.n_seq_id[i] = 1;
      b.seq_id[i][0] = opt_.seq;
      b.logits[i] = all_logits || i + 1 == tokens.size();
    }
    b.n_tokens = std::int32_t(tokens.size());
    struct guard {
      llama_batch& b;
      ~guard() { llama_batch_free(b); }
    } g{b};
    return decode(b, meta);
  }

  /// Decodes a caller-built batch: every entry must belong to the session's sequence only and
  /// carry its position. Returns llama_decode's status; bookkeeping grows only on 0; after a
  /// failure any partly processed micro-batches are removed again so the memory matches it.
  std::int32_t decode(const llama_batch& batch, token_meta meta = {}) {
    INFKV_REQUIRE(ctx_ != nullptr, "ctx", "null", "bind a context before decoding");
    INFKV_REQUIRE(batch.n_tokens > 0, "batch.n_tokens", batch.n_tokens, "must be > 0");
    // llama.cpp asserts (ends the process) on a batch larger than n_batch.
    INFKV_REQUIRE(std::uint32_t(batch.n_tokens) <= llama_n_batch(ctx_), "batch.n_tokens", batch.n_tokens,
                  "exceeds the context's n_batch = ", llama_n_batch(ctx_), ": split it into several decodes");
    INFKV_REQUIRE(batch.pos != nullptr, "batch.pos", "null", "the session needs explicit positions");
    INFKV_REQUIRE(batch.n_seq_id != nullptr && batch.seq_id != nullptr, "batch.seq_id", "null",
                  "the session needs explicit sequence ids");
    for (std::int32_t i = 0; i < batch.n_tokens; ++i)
      INFKV_REQUIRE(batch.n_seq_id[i] == 1 && batch.seq_id[i][0] == opt_.seq,
                    "batch.seq_id[" + std::to_string(i) + "][0]", batch.seq_id[i][0],
                    "every entry must belong to the session's sequence ", opt_.seq, " only");
    const std::int64_t n = batch.n_tokens;
    INFKV_REQUIRE(meta.segments.empty() || std::int64_t(meta.segments.size()) == n, "meta.segments.size()",
                  meta.segments.size(), "must be batch.n_tokens (", n, ") or 0");
    const observe_set what = observing(n);
    if (opt_.capture)
      for (auto& l : layers_)
        l.begin(n, what.queries ? (opt_.track_h2o ? n : opt_.window) : 0, what.keys, llama_n_ctx(ctx_), opt_.window);
    observer_.begin(what);
    std::int32_t rc = 0;
    {
      const stopwatch w{stats_.decode};
      rc = llama_decode(ctx_, batch);
    }
    observer_.end();
    stats_.capture += observer_.seconds();
    std::string why = observer_.error();
    if (rc == 0 && why.empty() && opt_.capture)
      for (std::int32_t l = 0; l < n_layers() && why.empty(); ++l) {
        const auto& r = observer_.layers()[std::size_t(l)];
        const auto want = [&](bool w) { return w ? n : 0; };
        if (r.n_q != want(what.queries) || r.n_k != want(what.keys) || r.n_v != want(what.values))
          why = "infkv: layer " + std::to_string(l) + ": cb_eval saw " + std::to_string(r.n_q) + " query, " +
                std::to_string(r.n_k) + " key and " + std::to_string(r.n_v) + " value rows for " + std::to_string(n) +
                " tokens (expected " + std::to_string(want(what.queries)) + ", " + std::to_string(want(what.keys)) +
                ", " + std::to_string(want(what.values)) + "); was the context created from attach()ed parameters?";
        else if (engine_ && (std::int64_t(r.cells.size()) != n || r.k_cache != caches_[std::size_t(l)].k))
          why = "infkv: layer " + std::to_string(l) + ": cb_eval saw " + std::to_string(r.cells.size()) +
                " cells written in the K cache the session reads for " + std::to_string(n) + " tokens";
      }
    if (rc == 0 && why.empty() && !decided_) why = decide();
    if (rc != 0 || !why.empty()) {
      if (opt_.capture) {  // every layer keeps the newest window queries that all of them still hold
        std::int64_t held = std::numeric_limits<std::int64_t>::max();
        for (auto& l : layers_) l.abort(), held = std::min(held, l.n_queries());
        for (auto& l : layers_) l.trim(held);
        fresh_ = std::min(fresh_, held);
      }
      rollback(why.empty() ? "llama_decode returned " + std::to_string(rc) : why);
      if (!why.empty()) throw engine_error(why);
      return rc;
    }
    std::vector<std::int64_t> pos(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) pos[std::size_t(i)] = batch.pos[i];
    book_.append(pos, meta.segment, meta.kind, meta.segments,
                 batch.token != nullptr ? std::span<const llama_token>(batch.token, std::size_t(n))
                                        : std::span<const llama_token>{});
    if (opt_.capture) {
      const stopwatch w{stats_.append};
      if (engine_)
        for (const std::int64_t c : observer_.layers()[0].cells) cells_.push_back(std::int32_t(c));
      for (std::int32_t l = 0; l < n_layers(); ++l) {
        layers_[std::size_t(l)].commit(pos);
        const auto& rows = observer_.layers()[std::size_t(l)];
        if (rows.rope.seen && !layer_rope_seen_) layer_rope_[std::size_t(l)] = node_rope_info(rows.rope);
      }
      layer_rope_seen_ = true;  // a layer's RoPE does not change between decodes
    }
    ++stats_.decodes, stats_.decoded_tokens += n;
    stats_.observed += what.splits() ? 1 : 0;
    fresh_ = what.queries ? fresh_ + n : 0;
    decoded_ += n;
    shift_pending_ = false;  // llama.cpp applied any pending shift of its keys before this decode
    if (opt_.track_h2o) {
      const stopwatch w{stats_.h2o};
      observe_h2o(pos);
    }
    for (auto& l : layers_) l.trim(opt_.window);
    verify();
    return 0;
  }

  /// Evicts down to `b` (after the policy's protection): scores every layer with `p`, combines heads and
  /// layers with the session's reduction, keeps the top tokens, removes the others' position
  /// runs from the llama memory, then compacts positions in compact mode. H2O scores from what
  /// the session accumulated at every decode (session_options.track_h2o); a union (`union_of`)
  /// cannot evict cached slots that share a position (M-RoPE images): it raises.
  template <policy P>
  eviction_result evict(const P& p, const budget& b) {
    p.validate();
    const policy_spec spec = p.spec();
    require_captures(spec);
    if (spec.protect(b).keep_count(size()) >= size()) return {0, size(), {}, false};
    return evict_scored(p, b, false);
  }

  /// Evicts down to `b` as evict(p, b) does, but the policy scores against the queries of
  /// `question` (the token ids of a question known in advance: proxy queries, computed as `mode`
  /// says, at the positions right after the cache) in place of the window's: the query-aware mode
  /// of block-wise prefill. The policy must read window queries (SnapKV, the Inf-MLLM-style
  /// policies, TOVA, Expected Attention: its last `window` of the question's queries). Needs
  /// session_options::scratch_seq, and room in the context for the question's tokens beside the
  /// cache. Cost: one llama_decode of the question per eviction (after_cache), or one in all
  /// (alone) and a rotation of its queries per eviction; session_stats::proxy.
  template <policy P>
  eviction_result evict(const P& p, const budget& b, std::span<const llama_token> question,
                        proxy_mode mode = proxy_mode::after_cache) {
    p.validate();
    const policy_spec spec = p.spec();
    INFKV_REQUIRE(!question.empty(), "question.size()", 0, "an eviction against a question needs its tokens");
    INFKV_REQUIRE(spec.reads_queries() && !spec.accumulates(), "policy", spec.name,
                  "reads no window queries, so a question cannot steer it: evict(p, b) without one");
    require_captures(spec);
    if (spec.protect(b).keep_count(size()) >= size()) return {0, size(), {}, false};
    proxy(question, mode);
    return evict_scored(p, b, true);
  }

  /// Each layer's queries of `question` (proxy queries) at the positions right after the cache
  /// (proxy_positions()), computed as `mode` says: what evict(p, b, question, mode) scores
  /// against. Valid until the next decode, eviction or proxy call.
  std::span<const const_tensor_view> proxy(std::span<const llama_token> question,
                                           proxy_mode mode = proxy_mode::after_cache) {
    INFKV_REQUIRE(!question.empty(), "question.size()", 0, "proxy queries need the question's tokens");
    const stopwatch w{stats_.proxy};
    proxy_queries(question, mode);
    return proxy_views_;
  }
  /// The positions of the last proxy() queries.
  std::span<const std::int64_t> proxy_positions() const { return proxy_pos_; }

  /// Context-reconstruction scores (KVzip: Kim et al., arXiv 2505.23416; kvpress's KVzipPress) of
  /// every cached slot, one [KV heads][size()] matrix per layer (empty for layers not scored, see
  /// scored_layers()): the cached tokens are repeated in time order, `o.chunk` at a time, on the
  /// scratch sequence after the cache (o.first, or o.next and the previous chunk's last o.tail
  /// tokens; o.suffix; the chunk), and each slot of a chunk scores the largest softmax probability
  /// any query of its pass (of the slot's KV head's group) gives it over the first o.sinks slots,
  /// the chunk and the pass's own keys (cpu::reconstruction_into). The scratch sequence is emptied
  /// after every pass. Needs the cached tokens' ids (decode() records them; recalled slots and
  /// embeddings have none), session_options::scratch_seq, and room in the context for one pass
  /// beside the cache. Extra memory during the call: one pass's queries and keys per layer (f32).
  /// Cost: one llama_decode of about size() + passes x (prompt + tail) tokens in all
  /// (session_stats::reconstruct). Valid until the next call.
  std::span<const score_matrix> reconstruct(const reconstruction_options& o = {}) {
    INFKV_REQUIRE(ctx_ != nullptr, "ctx", "null", "bind a context before reconstructing");
    INFKV_REQUIRE(o.chunk >= 1, "reconstruction_options.chunk", o.chunk, "must be >= 1");
    INFKV_REQUIRE(o.tail >= 0, "reconstruction_options.tail", o.tail, "must be >= 0");
    INFKV_REQUIRE(o.sinks >= 0, "reconstruction_options.sinks", o.sinks, "must be >= 0");
    INFKV_REQUIRE(size() > 0, "size()", 0, "nothing is cached to reconstruct");
    if (engine_ && shift_pending_)
      infkv::fail(
          "infkv: reconstruct: the last eviction moved positions, and llama.cpp re-rotates the keys the scores "
          "read at its next decode: decode before reconstructing (or use key_source::copy)");
    const stopwatch w{stats_.reconstruct};
    struct release {  // a pass's rows are not kept, whether the call succeeds or not
      session& s;
      ~release() {
        for (auto& v : s.pass_keys_) std::vector<float>().swap(v);
        for (auto& l : s.layers_) l.shrink_queries();
      }
    } released{*this};
    const std::int64_t n = size();
    const std::span<const llama_token> ids = book_.ids();
    for (std::int64_t s = 0; s < n; ++s)
      INFKV_REQUIRE(ids[std::size_t(s)] >= 0, "slot " + std::to_string(s) + " token id", ids[std::size_t(s)],
                    "is unknown (recalled from the archive or decoded from embeddings): context reconstruction "
                    "repeats the cached tokens");
    const auto prompt = [&](const std::vector<llama_token>& ids_given, const std::string& text, const char* what) {
      return ids_given.empty() ? tokenize(text, what) : ids_given;
    };
    const std::vector<llama_token> first = prompt(o.first_ids, o.first, "reconstruction_options.first"),
                                   next = prompt(o.next_ids, o.next, "reconstruction_options.next"),
                                   suffix = prompt(o.suffix_ids, o.suffix, "reconstruction_options.suffix");
    std::vector<std::int64_t> order(static_cast<std::size_t>(n));  // slots in time order
    std::iota(order.begin(), order.end(), std::int64_t(0));
    std::ranges::stable_sort(order, {}, [&](std::int64_t s) { return tokens()[std::size_t(s)].pos; });
    const std::vector<std::int32_t>& scored = scored_layers();
    recon_.assign(layers_.size(), score_matrix{});
    const std::int64_t p0 = next_pos();
    std::vector<llama_token> pass;
    std::vector<float> keys;
    std::vector<token> key_tokens;
    std::vector<std::int64_t> qpos;
    for (std::int64_t a = 0; a < n; a += o.chunk) {
      const std::int64_t b = std::min(n, a + o.chunk), sink = std::min(o.sinks, a);
      pass.assign((a == 0 ? first : next).begin(), (a == 0 ? first : next).end());
      for (std::int64_t i = a - std::min(o.tail, o.chunk); a > 0 && i < a; ++i)  // the previous chunk's tail
        pass.push_back(ids[std::size_t(order[std::size_t(i)])]);
      pass.insert(pass.end(), suffix.begin(), suffix.end());
      for (std::int64_t i = a; i < b; ++i) pass.push_back(ids[std::size_t(order[std::size_t(i)])]);
      const auto m = std::int64_t(pass.size());
      INFKV_REQUIRE(n + m <= std::int64_t(llama_n_ctx(ctx_)), "reconstruction_options.chunk", o.chunk, "a pass of ", m,
                    " tokens does not fit the context beside the ", n, " cached (n_ctx = ", llama_n_ctx(ctx_), ")");
      INFKV_REQUIRE(m <= std::int64_t(llama_n_batch(ctx_)), "reconstruction_options.chunk", o.chunk, "a pass of ", m,
                    " tokens exceeds the context's n_batch = ", llama_n_batch(ctx_));
      if (const std::string why = decode_aside(pass, p0, true, "context reconstruction", true); !why.empty())
        infkv::raise<engine_error>("infkv: context reconstruction: ", why, "; nothing was evicted");
      qpos.resize(std::size_t(m));
      std::iota(qpos.begin(), qpos.end(), p0);
      const std::int64_t nk = sink + (b - a) + m;
      for (const std::int32_t l : scored) {
        const layer_inputs<const_paged_rows> in = inputs(l);
        const std::int32_t hkv = in.keys.n_heads, d = std::int32_t(in.keys.head_dim);
        if (recon_[std::size_t(l)].rows == 0) recon_[std::size_t(l)] = score_matrix(hkv, n);
        keys.resize(std::size_t(nk * hkv * d));
        key_tokens.resize(std::size_t(nk));
        for (std::int64_t k = 0; k < sink + (b - a); ++k) {  // the sinks, then the chunk
          const std::int64_t slot = order[std::size_t(k < sink ? k : a + k - sink)];
          key_tokens[std::size_t(k)] = tokens()[std::size_t(slot)];
          for (std::int32_t h = 0; h < hkv; ++h)
            to_f32(in.keys.type, in.keys.row(slot, h), keys.data() + (k * hkv + h) * d, d);
        }
        const std::vector<float>& own = pass_keys_[std::size_t(l)];  // the pass's keys, f32 [m][hkv][d]
        INFKV_REQUIRE(std::int64_t(own.size()) == m * hkv * d, "layer " + std::to_string(l) + " pass keys", own.size(),
                      "must hold ", m, " x ", hkv, " x ", d, " floats");
        std::copy(own.begin(), own.end(), keys.begin() + std::ptrdiff_t((sink + b - a) * hkv * d));
        for (std::int64_t i = 0; i < m; ++i) key_tokens[std::size_t(sink + b - a + i)] = {p0 + i, 0, modality::text};
        const layer_inputs<> pass_in{.keys = nhd(static_cast<const void*>(keys.data()), dtype::f32, nk, hkv, d),
                                     .queries = layers_[std::size_t(l)].batch_queries(),
                                     .query_pos = qpos,
                                     .tokens = key_tokens,
                                     .scale = opt_.scale};
        score_matrix got(hkv, nk);
        const cpu::workspace work(std::size_t(cpu::workers(opt_.executor, hkv)) *
                                  cpu::detail::window_scratch_bytes(pass_in));
        cpu::reconstruction_into(pass_in, got.view(), work.span().data(), opt_.executor);
        for (std::int32_t h = 0; h < hkv; ++h)
          for (std::int64_t i = a; i < b; ++i) recon_[std::size_t(l)](h, order[std::size_t(i)]) = got(h, sink + i - a);
      }
    }
    return recon_;
  }

  /// Evicts down to `b` by context-reconstruction scores (reconstruct(o)): the KV heads and scored
  /// layers combined into one score per token with the session's reduction, then the first
  /// b.sinks and last b.recent tokens kept and the highest scores after them (whole positions or
  /// whole segments first, as evict does). The query-agnostic score of KVzip: no question needed.
  eviction_result evict_reconstructed(const budget& b, const reconstruction_options& o = {}) {
    b.validate();
    if (b.keep_count(size()) >= size()) return {0, size(), {}, false};
    const std::span<const score_matrix> per_layer = reconstruct(o);
    std::optional<stopwatch> w{std::in_place, stats_.score};
    score_matrix row(1, size());
    std::int64_t units = 0;
    for (const score_matrix& m : per_layer)
      if (m.rows > 0) cpu::detail::reduce_into(row.view(), m.view(), opt_.reduce, units == 0), units += m.rows;
    cpu::detail::finish_reduction(row.view(), opt_.reduce, units);
    const std::int64_t cap = b.keep_count(size());
    const keep_set keep = book_.shares_positions() || opt_.whole_segments
                              ? select_whole(row.row(0), cap, b.sinks, b.recent)
                              : cpu::select_top(row, tokens(), b);
    w.reset();
    return apply(keep);
  }

 private:
  /// evict's scoring and removal, with the window queries, or (`proxy`) with proxy_queries().
  template <policy P>
  eviction_result evict_scored(const P& p, const budget& b, bool proxy) {
    const policy_spec spec = p.spec();
    INFKV_REQUIRE(!spec.second || !book_.shares_positions(), spec.name, "two policies",
                  "cannot evict whole positions (cached slots share a position, e.g. M-RoPE images): use one policy");
    INFKV_REQUIRE(!spec.second || !opt_.whole_segments, spec.name, "two policies",
                  "cannot keep whole segments (session_options.whole_segments): use one policy");
    if (!proxy && spec.reads_queries() && opt_.evicts_above && !opt_.track_h2o)
      INFKV_REQUIRE(fresh_ >= std::min(opt_.window, decoded_), "session_options.evicts_above", *opt_.evicts_above,
                    "this eviction at size() = ", size(), " reads the last ", opt_.window,
                    " queries, but only the last ", fresh_,
                    " decoded tokens were observed: evict as soon as size() exceeds evicts_above, or leave it unset");
    if (engine_ && shift_pending_ && spec.needs().observes())
      infkv::fail(
          "infkv: evict: the last eviction moved positions, and llama.cpp re-rotates the keys the policy "
          "reads at its next decode: decode before evicting again (or use key_source::copy)");
    std::optional<stopwatch> w{std::in_place, stats_.score};
    const cpu::backend be{opt_.executor};
    const std::vector<std::int32_t>& scored = scored_layers();
    layers_in_.clear();
    for (const std::int32_t l : scored) {
      layers_in_.push_back(inputs(l));
      if (proxy) layers_in_.back().queries = proxy_views_[std::size_t(l)], layers_in_.back().query_pos = proxy_pos_;
      if (spec.reads_queries())
        INFKV_REQUIRE(layers_in_.back().queries.n_slots > 0, "layer " + std::to_string(l) + " queries", 0,
                      "decode at least one token after the last eviction before scoring with ", spec.name);
    }
    const plan pl = make_plan(be, spec, b, shape_of(layers_in_.front()),
                              {.g = granularity::per_token, .r = opt_.reduce, .n_layers = std::int32_t(scored.size())});
    if (!workspace_ || workspace_->span().size() < pl.workspace_bytes) workspace_.emplace(pl.workspace_bytes);
    const std::span<const layer_inputs<const_paged_rows>> layers(layers_in_);
    if (book_.shares_positions() || opt_.whole_segments) {
      // M-RoPE images: whole positions only (seq_rm removes by position); or whole segments first
      const score_view s = run_decision_scores(pl, be, layers, workspace_->span());
      const keep_set keep =
          select_whole({s.data, std::size_t(s.cols)}, pl.keep_per_unit, pl.effective.sinks, pl.effective.recent);
      w.reset();
      return apply(keep);
    }
    std::vector<std::int64_t> offsets(std::size_t(pl.offsets_size())), slots(std::size_t(pl.kept_total));
    const keep_view out{slots.data(), offsets.data(), pl.units, pl.shape.n_slots};
    run(pl, be, layers, workspace_->span(), out);
    w.reset();
    return apply(keep_set::from_view(out));
  }

  /// Decodes `question` on the scratch sequence at positions p0, p0 + 1, ..., after the
  /// session's cells (`share`: they are shared into it first) or alone, and leaves each layer's
  /// queries of it in layer_cache::batch_queries(); the scratch sequence is emptied again.
  /// Returns why it failed (empty on success). `what` names the caller.
  std::string decode_aside(std::span<const llama_token> question, std::int64_t p0, bool share, const char* what,
                           bool keys = false) {
    INFKV_REQUIRE(ctx_ != nullptr, "ctx", "null", "bind a context before ", what);
    INFKV_REQUIRE(opt_.capture, "session_options.capture", "false", what, " reads queries: capture must be on");
    INFKV_REQUIRE(std::uint32_t(question.size()) <= llama_n_batch(ctx_), "question.size()", question.size(),
                  "exceeds the context's n_batch = ", llama_n_batch(ctx_));
    const llama_seq_id sc = opt_.scratch_seq;
    INFKV_REQUIRE(sc >= 0 && sc != opt_.seq && sc < std::int64_t(llama_n_seq_max(ctx_)), "session_options.scratch_seq",
                  sc, what,
                  " decodes the question on a second sequence of the context: one nobody else uses, not seq (",
                  opt_.seq, "), below n_seq_max (", llama_n_seq_max(ctx_), ")");
    INFKV_REQUIRE(llama_memory_seq_pos_max(mem_, sc) < 0, "session_options.scratch_seq", sc,
                  "must be an empty sequence (", what, " decodes the question on it)");
    if (share) opt_.memory.seq_cp(mem_, opt_.seq, sc, -1, -1);
    const auto n = std::int64_t(question.size());
    llama_batch batch = llama_batch_init(std::int32_t(n), 0, 1);
    struct guard {
      llama_batch& b;
      ~guard() { llama_batch_free(b); }
    } g{batch};
    for (std::int64_t i = 0; i < n; ++i) {
      batch.token[i] = question[std::size_t(i)];
      batch.pos[i] = llama_pos(p0 + i);
      batch.n_seq_id[i] = 1;
      batch.seq_id[i][0] = sc;
      batch.logits[i] = i + 1 == n;
    }
    batch.n_tokens = std::int32_t(n);
    for (auto& l : layers_) l.begin(n, n, false, llama_n_ctx(ctx_));
    if (keys) pass_keys_.resize(layers_.size()), pass_seen_.assign(layers_.size(), 0), pass_capture_ = true;
    observer_.begin({.queries = true, .keys = keys});
    const std::int32_t rc = llama_decode(ctx_, batch);
    observer_.end();
    pass_capture_ = false;
    route().clear_scratch();
    std::string why = rc != 0 ? "llama_decode of the question returned " + std::to_string(rc) : observer_.error();
    for (std::int32_t l = 0; why.empty() && l < n_layers(); ++l)
      if (observer_.layers()[std::size_t(l)].n_q != n || (keys && pass_seen_[std::size_t(l)] != n))
        why = "cb_eval saw " + std::to_string(observer_.layers()[std::size_t(l)].n_q) + " query rows" +
              (keys ? " and " + std::to_string(pass_seen_[std::size_t(l)]) + " key rows" : std::string()) +
              " of layer " + std::to_string(l) + " for " + std::to_string(n) + " tokens";
    if (rc == 0) shift_pending_ = false;  // llama.cpp turned any pending shift of its keys in this decode
    return why;
  }

  /// One row of per-token scores' keep set where slots go whole: M-RoPE images' shared positions
  /// (always), or whole segments first (session_options::whole_segments).
  keep_set select_whole(std::span<const float> row, std::int64_t cap, std::int64_t sinks, std::int64_t recent) const {
    return book_.shares_positions() ? cpu::select_whole_positions(row, tokens(), cap, sinks, recent)
                                    : cpu::select_whole_segments(row, tokens(), cap, sinks, recent);
  }

  /// A pass's key rows of one layer, f32, into pass_keys_ (decode_aside with keys).
  void take_pass_keys(const node_rows& r) {
    auto& v = pass_keys_[std::size_t(r.layer)];
    std::int64_t& seen = pass_seen_[std::size_t(r.layer)];
    if (seen == 0) v.clear();
    const std::int64_t row = r.heads * r.head_dim;
    v.resize(std::size_t((seen + r.n_tokens) * row));
    for (std::int64_t i = 0; i < r.n_tokens; ++i)
      for (std::int64_t h = 0; h < r.heads; ++h)
        r.row_to(i, h, dtype::f32, v.data() + (seen + i) * row + h * r.head_dim, nullptr);
    seen += r.n_tokens;
  }

  /// `text`'s tokens (no special tokens added or parsed); `what` names the option it comes from.
  std::vector<llama_token> tokenize(const std::string& text, const char* what) const {
    const llama_vocab* v = llama_model_get_vocab(model_);
    std::vector<llama_token> out(text.size() + 8);
    std::int32_t n =
        llama_tokenize(v, text.data(), std::int32_t(text.size()), out.data(), std::int32_t(out.size()), false, false);
    INFKV_REQUIRE(n >= 0, what, text, "llama_tokenize failed on it");
    out.resize(std::size_t(n));
    return out;
  }

  /// proxy_views_ and proxy_pos_: each layer's queries of `question` at the positions after the
  /// cache, computed as `mode` says.
  void proxy_queries(std::span<const llama_token> question, proxy_mode mode) {
    const auto n = std::int64_t(question.size());
    const std::int64_t p0 = next_pos();
    proxy_pos_.resize(std::size_t(n));
    for (std::int64_t i = 0; i < n; ++i) proxy_pos_[std::size_t(i)] = p0 + i;
    proxy_views_.clear();
    if (mode == proxy_mode::after_cache) {
      if (const std::string why = decode_aside(question, p0, true, "proxy queries"); !why.empty())
        infkv::raise<engine_error>("infkv: proxy queries: ", why, "; nothing was evicted");
      for (const auto& l : layers_) proxy_views_.push_back(l.batch_queries());
      return;
    }
    if (!std::ranges::equal(alone_tokens_, question)) {  // the first pass, once per question
      for (std::int32_t l = 0; l < n_layers(); ++l) {
        const rope_info& r = layer_rope_[std::size_t(l)];
        INFKV_REQUIRE(!r.has_rope || r.supported, "proxy_mode", "alone", "layer ", l, "'s RoPE (", r.kind,
                      ") is not one infkv can turn to other positions: use proxy_mode::after_cache");
      }
      alone_tokens_.clear();
      if (const std::string why = decode_aside(question, p0, false, "proxy queries"); !why.empty())
        infkv::raise<engine_error>("infkv: proxy queries: ", why, "; nothing was evicted");
      alone_.assign(layers_.size(), {});
      for (std::size_t l = 0; l < layers_.size(); ++l) {
        const const_tensor_view q = layers_[l].batch_queries();
        const auto* f = static_cast<const float*>(q.data);
        alone_[l].assign(f, f + q.n_slots * q.n_heads * q.head_dim);
      }
      alone_tokens_.assign(question.begin(), question.end());
      alone_pos_ = p0;
    }
    turned_.resize(layers_.size());
    const std::vector<std::int64_t> delta(std::size_t(n), p0 - alone_pos_);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      turned_[l] = alone_[l];
      const auto& lc = layers_[l];
      const tensor_view v = nhd(turned_[l].data(), dtype::f32, n, lc.n_head(), lc.head_dim());
      const rope_info& r = layer_rope_[l];
      if (r.has_rope && delta[0] != 0) cpu::rerotate(v, delta, r.params, opt_.executor);
      proxy_views_.push_back(v);
    }
  }

 public:
  /// Brings back from the archive what `question` needs before it is asked: its post-RoPE queries
  /// come from decoding it after the cache on the scratch sequence (sharing the session's cells;
  /// removed again, the session's sequence is untouched), then recall as below with them.
  template <policy P>
  recall_report recall(const P& p, const budget& b, const cpu::recall_options& o,
                       std::span<const llama_token> question) {
    INFKV_REQUIRE(archive_.has_value(), "session_options.archive", "unset",
                  "recall needs a session created with an archive");
    INFKV_REQUIRE(!question.empty(), "question.size()", 0, "recall needs the question's tokens");
    const stopwatch w{stats_.recall};
    const std::int64_t p0 = next_pos();
    if (const std::string why = decode_aside(question, p0, true, "recall"); !why.empty())
      infkv::raise<engine_error>("infkv: recall: ", why, "; nothing was recalled");
    std::vector<std::int64_t> qpos;
    for (std::int64_t i = 0; i < std::int64_t(question.size()); ++i) qpos.push_back(p0 + i);
    std::vector<const_tensor_view> queries;
    for (auto& l : layers_) queries.push_back(l.batch_queries());
    return recall_with(p, b, o, queries, qpos);
  }

  /// Brings back from the archive what the window queries need (the last decoded tokens'), as
  /// recall(p, b, o, question) does with the question's.
  template <policy P>
  recall_report recall(const P& p, const budget& b, const cpu::recall_options& o) {
    INFKV_REQUIRE(archive_.has_value(), "session_options.archive", "unset",
                  "recall needs a session created with an archive");
    INFKV_REQUIRE(ctx_ != nullptr, "ctx", "null", "bind a context before recalling");
    const stopwatch w{stats_.recall};
    std::vector<const_tensor_view> queries;
    for (std::int32_t l = 0; l < n_layers(); ++l) {
      queries.push_back(layers_[std::size_t(l)].queries());
      INFKV_REQUIRE(queries.back().n_slots > 0, "layer " + std::to_string(l) + " queries", 0,
                    "decode at least one token before recall: the window queries choose");
    }
    const auto qpos = layers_[0].query_pos();
    return recall_with(p, b, o, queries, std::vector<std::int64_t>(qpos.begin(), qpos.end()));
  }

 private:
  /// Recall for `queries` (per layer) at positions `qpos`: up to `o.budget_tokens` archived slots,
  /// chosen and placed by `cpu::recaller` with `p` (a policy whose score reads queries) under the
  /// cache's budget `b`, in place of as many cached slots (never sinks or the recent window),
  /// which leave the cache (the archive holds them: everything is archived before it can leave).
  /// The recalled rows go back into llama.cpp's cache at their own positions through the scratch
  /// sequence (llama_state_seq_set_data, then llama_memory_seq_cp), and into the session's
  /// copies; their pages stay archived. When the engine refuses the rows, the error says the
  /// cache holds that many slots fewer; the bookkeeping follows the engine either way.
  template <policy P>
  recall_report recall_with(const P& p, const budget& b, const cpu::recall_options& o,
                            std::span<const const_tensor_view> queries, const std::vector<std::int64_t>& qpos) {
    p.validate();
    require_captures(p.spec());
    INFKV_REQUIRE(!shift_ || (opt_.position_gap == 0 && opt_.position_span == 0) || o.distance,
                  "recall_options.distance", "unset",
                  opt_.position_gap > 0 ? "session_options.position_gap" : "session_options.position_span",
                  " needs it: the recaller places candidates as if gaps were closed, so rank them at one distance");
    archive_stream();  // what the stream wrote since the last eviction, first; every layer's inputs
    const cpu::backend be{opt_.executor};
    infkv::archive& store = archive_->store();
    cpu::recall_options opt = o;
    if (archive_->two_caches()) {  // a sliding layer attends to nothing below next_pos() - n_swa again
      const std::int64_t oldest = next_pos() - n_swa_;
      opt.below = std::min(o.below.value_or(oldest), oldest);
      if (opt.layers.empty()) opt.layers = archive_->global_layers();  // so only the global layers' scores say
    }
    cpu::recaller rc(store, p, b, opt, size(), queries[0].n_heads, queries[0].n_slots, be);
    // compact mode: the recaller takes the stream's positions (the archive's) and the compacted
    // ones at which the cache's keys and the queries are rotated
    const bool compacted = shift_;
    std::vector<token> at_origin;
    std::vector<std::int64_t> rotary, qpos_origin;
    std::vector<layer_inputs<const_paged_rows>> in_origin;
    if (compacted) {
      at_origin.assign(tokens().begin(), tokens().end());
      for (std::size_t s = 0; s < at_origin.size(); ++s)
        rotary.push_back(at_origin[s].pos), at_origin[s].pos = origins()[s];
      in_origin = all_in_;
      for (auto& l : in_origin) l.tokens = at_origin;
      for (const std::int64_t q : qpos) qpos_origin.push_back(book_.origin_of(q));
    }
    const cpu::recall_result res =
        rc.recall(store, std::span<const layer_inputs<const_paged_rows>>(compacted ? in_origin : all_in_), queries,
                  compacted ? qpos_origin : qpos, opt_.scale, 0, rotary);
    recall_report rep;
    if (res.recalled.empty()) return rep;
    const std::int64_t m = res.tokens;
    // 1. the recalled rows and tokens staged (their pages stay archived)
    const std::vector<token> back = [&] {
      const auto t = archive_->stage(res.recalled);
      return std::vector<token>(t.begin(), t.end());
    }();
    // 2. the displaced slots' state read (the template of step 3), then they leave
    keep_set keep(size());
    std::vector<std::int64_t> kept;
    for (std::int64_t s = 0, d = 0; s < size(); ++s)
      if (d < std::int64_t(res.displaced.size()) && res.displaced[std::size_t(d)] == s)
        ++d;
      else
        kept.push_back(s);
    keep.add_unit(kept);
    archive_->read_template(route(), keep.evicted_runs(tokens()));
    apply(keep);
    if (compacted) {
      // 3. the recalled tokens take their places in the stream's order: positions 0..n-1 again,
      //    the cached slots after them moved up, their staged keys turned from their origins
      const std::vector<token> old(tokens().begin(), tokens().end());
      const auto n_old = std::int64_t(old.size());
      const std::vector<std::int64_t> delta = book_.insert(back);
      shift_positions(old, std::span(delta).first(std::size_t(n_old)));
      const std::span<const std::int64_t> turn = std::span(delta).subspan(std::size_t(n_old));
      for (std::int32_t l = 0; l < n_layers(); ++l)
        if (layer_rope_[std::size_t(l)].has_rope)
          cpu::rerotate(nhd(static_cast<void*>(archive_->staged(false, l)), dtype::f32, m, layers_[0].n_head_kv(),
                            layers_[0].head_dim()),
                        turn, layer_rope_[std::size_t(l)].params, opt_.executor);
      for (std::int64_t i = 0; i < m; ++i) rep.positions.push_back(tokens()[std::size_t(n_old + i)].pos);
      try {
        archive_->write_back(route(), rep.positions);
      } catch (...) {
        keep_set old_slots(size());
        std::vector<std::int64_t> first(static_cast<std::size_t>(n_old));
        std::iota(first.begin(), first.end(), std::int64_t(0));
        old_slots.add_unit(first);
        book_.keep(old_slots);
        verify();
        throw;
      }
    } else {
      // 3. the staged rows into llama.cpp's cache at their positions
      try {
        archive_->write_back(route());
      } catch (...) {
        verify();
        throw;
      }
      // 4. the session follows: bookkeeping
      for (const token& t : back) {
        const std::int64_t pos = t.pos;
        book_.append({&pos, 1}, t.segment, t.kind);
        rep.positions.push_back(pos);
      }
    }
    // 4. and the key (and value) copies
    for (std::int32_t l = 0; l < n_layers(); ++l)
      layers_[std::size_t(l)].append(archive_->staged(false, l), archive_->staged(true, l), m, llama_n_ctx(ctx_));
    verify();
    rep.pages = std::int64_t(res.pages.size()), rep.tokens = m;
    return rep;
  }

 public:
  /// Removes exactly the slots not in `keep` (one unit over the current slots) and compacts
  /// positions in compact mode: for callers that select themselves.
  eviction_result apply(const keep_set& keep) {
    INFKV_REQUIRE(ctx_ != nullptr, "ctx", "null", "bind a context before evicting");
    INFKV_REQUIRE(keep.n_units() == 1, "keep.n_units()", keep.n_units(), "llama.cpp frees per token: one unit");
    INFKV_REQUIRE(keep.n_slots() == size(), "keep.n_slots()", keep.n_slots(), "must equal size() = ", size());
    eviction_result res;
    res.removed = keep.evicted_runs(tokens());
    if (archive_ && keep.size(0) < size()) archive_stream();  // written through: nothing leaves before it is archived
    ++stats_.evictions;
    for (std::size_t i = 0; i < res.removed.size(); ++i) {
      const auto& r = res.removed[i];
      bool removed = false;
      {
        const stopwatch w{stats_.seq_rm};
        removed = opt_.memory.seq_rm(mem_, opt_.seq, llama_pos(r.begin), llama_pos(r.end));
      }
      if (!removed) {
        const std::vector<position_run> done(res.removed.begin(), res.removed.begin() + std::ptrdiff_t(i));
        std::vector<std::int64_t> left;
        const auto cached = tokens();
        for (std::size_t s = 0; s < cached.size(); ++s)
          if (std::none_of(done.begin(), done.end(),
                           [&](const position_run& d) { return cached[s].pos >= d.begin && cached[s].pos < d.end; }))
            left.push_back(std::int64_t(s));
        keep_set partial(size());
        partial.add_unit(left);
        drop(partial);
        verify();
        infkv::raise<engine_error>("infkv: llama_memory_seq_rm(seq = ", opt_.seq, ", p0 = ", r.begin, ", p1 = ", r.end,
                                   ") = false: the memory cannot remove part of the sequence; ", i, " of ",
                                   res.removed.size(), " runs were removed and the bookkeeping follows them");
      }
    }
    res.evicted = size() - keep.size(0);
    drop(keep);
    std::exception_ptr not_gathered;  // the eviction completes first (compaction included), then it is reported
    if (opt_.gather_cells && engine_ && !shift_pending_) try {
        gather();
      } catch (...) {  // the cells stay where the error left them, and the session knows where
        not_gathered = std::current_exception();
      }
    if (shift_ && !book_.empty()) res.shifted = compact_positions();
    res.kept = size();
    verify();
    if (not_gathered) std::rethrow_exception(not_gathered);
    return res;
  }

  /// Throws naming the option when the session does not capture what `spec` reads
  /// (spec.needs(); session_options::for_policy sets exactly that).
  void require_captures(const policy_spec& spec) const {
    const capture_needs needs = spec.needs();
    if (const auto a = spec.accumulates()) {
      require_h2o();
      INFKV_REQUIRE(
          a->forgetting == opt_.track_h2o->forgetting && a->normalize_lifetime == opt_.track_h2o->normalize_lifetime,
          "h2o.forgetting", a->forgetting, "must match session_options.track_h2o (", opt_.track_h2o->forgetting,
          ", normalize_lifetime ", opt_.track_h2o->normalize_lifetime, ")");
    }
    INFKV_REQUIRE(opt_.capture || !needs.observes(), "session_options.capture", "false", spec.name,
                  " reads the keys or queries: create the session with capture = true "
                  "(session_options::for_policy sets what a policy needs)");
    INFKV_REQUIRE(opt_.values || !needs.values, "session_options.values", "false", spec.name,
                  " weights scores by value norms: create the session with values = true");
    INFKV_REQUIRE(needs.queries <= opt_.window, std::string(spec.name) + ".window", needs.queries,
                  "exceeds the queries the session keeps (session_options.window = ", opt_.window, ")");
  }

  /// Checks the bookkeeping against llama_memory_seq_pos_min/max; throws infkv::error on a mismatch
  /// (with sliding-window layers llama.cpp's minimum may lie anywhere up to the newest position:
  /// position_book::check).
  void verify() const {
    if (mem_ == nullptr) return;
    book_.check(llama_memory_seq_pos_min(mem_, opt_.seq), llama_memory_seq_pos_max(mem_, opt_.seq), opt_.seq,
                n_swa_ > 0);
  }

 private:
  /// What a decode of `n` tokens observes: queries when the next eviction can read them (all
  /// while H2O observes, or without evicts_above), K (V) rows while the session keeps copies
  /// (and at the first decode, which decides), the cells where it reads llama.cpp's cache.
  observe_set observing(std::int64_t n) const {
    if (!opt_.capture) return {.queries = false, .keys = false};
    const bool queries =
        opt_.track_h2o || (opt_.window > 0 && (!opt_.evicts_above || size() + n > *opt_.evicts_above - opt_.window));
    return {.queries = queries, .keys = !engine_, .values = opt_.values && !engine_, .cells = engine_ || !decided_};
  }

  /// Cache types whose rows the policies read as they are (row_source types).
  static bool readable(ggml_type t) { return t == GGML_TYPE_F16 || t == GGML_TYPE_F32 || t == GGML_TYPE_BF16; }
  static dtype dtype_of(ggml_type t) {
    return t == GGML_TYPE_F32 ? dtype::f32 : t == GGML_TYPE_BF16 ? dtype::bf16 : dtype::f16;
  }

  /// After the first decode: the policies read llama.cpp's own cache when every layer's K (and V)
  /// rows lie in host memory as [cell][kv_head][head_dim] rows of one cache shared by all layers;
  /// the copies are freed then. An error for key_source::engine where they cannot; empty otherwise.
  std::string decide() {
    std::string why;
    const auto& first = observer_.layers()[0].cells;
    const auto rows_ok = [&](const ggml_tensor* t, const layer_cache& l) {
      return t != nullptr && t->data != nullptr && (t->buffer == nullptr || ggml_backend_buffer_is_host(t->buffer)) &&
             readable(t->type) && t->ne[0] == std::int64_t(l.n_head_kv()) * l.head_dim() &&
             t->nb[0] == ggml_type_size(t->type) && t->nb[1] == t->ne[0] * t->nb[0] &&
             t->ne[1] * t->ne[2] <= std::numeric_limits<std::int32_t>::max();
    };
    for (std::int32_t l = 0; l < n_layers() && why.empty(); ++l) {
      const auto& r = observer_.layers()[std::size_t(l)];
      const auto& lc = layers_[std::size_t(l)];
      const std::string at = "layer " + std::to_string(l);
      if (r.k_cache == nullptr || r.cells.size() != first.size())
        why = at + " writes no K cache the session saw";
      else if (r.cells != first)
        why = at + " writes its K rows to other cells than layer 0 (several caches)";
      else if (!rows_ok(r.k_cache, lc))
        why = at + "'s K cache is not host memory of f16, f32 or bf16 rows";
      else if (opt_.values && (!r.v_rows || !rows_ok(r.v_cache, lc)))
        why = at + "'s V cache holds no rows (flash attention off stores V transposed) or not in host memory";
    }
    decided_ = why.empty() || opt_.keys != key_source::engine;  // engine: asked again (and refused) next time
    if (why.empty()) {
      engine_ = true;
      caches_.assign(layers_.size(), {});
      for (std::size_t l = 0; l < layers_.size(); ++l) {
        caches_[l] = {observer_.layers()[l].k_cache, opt_.values ? observer_.layers()[l].v_cache : nullptr};
        layers_[l].release_rows();
      }
      cells_.reserve(std::size_t(llama_n_ctx(ctx_)));
      return {};
    }
    return opt_.keys == key_source::engine ? "infkv: session_options.keys = engine: " + why + "; use key_source::copy"
                                           : std::string();
  }

  /// Rows of llama.cpp's cache tensor `t` for the cached slots: one cell per page.
  const_paged_rows cache_rows(const ggml_tensor* t, const layer_cache& l) const {
    return {const_page_storage{t->data, std::int64_t(t->nb[1] / ggml_type_size(t->type)), 0, l.head_dim()},
            cells_.data(),
            dtype_of(t->type),
            size(),
            l.n_head_kv(),
            l.head_dim(),
            1};
  }
  /// A copy's rows as one page.
  static const_paged_rows one_page(const_tensor_view t) {
    static constexpr std::int32_t page0 = 0;
    return {
        const_page_storage{t.data, 0, t.slot_stride, t.head_stride}, &page0, t.type, t.n_slots, t.n_heads, t.head_dim,
        std::int32_t(std::max<std::int64_t>(t.n_slots, 1))};
  }

  static std::int32_t checked_layers(const llama_model* model) {
    if (model == nullptr) infkv::fail("infkv: model = null: a llama_model is required");
    return llama_model_n_layer(model);
  }
  void require_h2o() const {
    INFKV_REQUIRE(opt_.track_h2o.has_value(), "session_options.track_h2o", "unset",
                  "H2O needs the attention of every decode: create the session with "
                  "session_options::for_policy(h2o{})");
  }

  /// After a decode the session cannot follow (`why`): removes whatever llama.cpp kept of the
  /// batch beyond the bookkeeping. When the memory refuses, the session cannot follow it (the
  /// batch's keys were not captured) and says so.
  void rollback(const std::string& why) {
    const llama_pos p0 = book_.empty() ? -1 : llama_pos(book_.max_pos() + 1);
    const llama_pos kept = llama_memory_seq_pos_max(mem_, opt_.seq);
    if (kept >= std::max<llama_pos>(p0, 0) && !opt_.memory.seq_rm(mem_, opt_.seq, p0, -1))
      infkv::raise<engine_error>("infkv: llama_memory_seq_rm(seq = ", opt_.seq, ", p0 = ", p0,
                                 ", p1 = -1) = false while rolling back a decode (", why,
                                 "): the memory keeps positions up to ", kept,
                                 ", which the session never captured; clear the "
                                 "sequence and start a new session");
  }

  /// Every layer's inputs into all_in_ (valid until the next decode or eviction).
  std::span<const layer_inputs<const_paged_rows>> all_inputs() {
    all_in_.clear();
    for (std::int32_t l = 0; l < n_layers(); ++l) all_in_.push_back(inputs(l));
    return all_in_;
  }

  /// Archives what the stream wrote since the last call (archive_link::archive_new; the session's
  /// copies give a sliding-window model's sliding layers), leaving every layer's inputs in all_in_.
  void archive_stream() {
    const stopwatch w{stats_.archive};
    archive_->archive_new(route(), tokens(), book_.origins(), all_inputs());
  }

  /// The archive's way to llama.cpp's rows.
  detail::cache_route route() const { return {ctx_, mem_, &opt_.memory, opt_.seq, opt_.scratch_seq}; }

  /// session_options::gather_cells: the slots whose cells lie at or above size() move into the
  /// free cells below it, so that the cached cells are 0..size()-1 and llama.cpp's next decode
  /// writes into the run after them. llama.cpp restores a sequence's state into the free cells it
  /// meets first from its search head, which the eviction's llama_memory_seq_rm left at or below
  /// the first freed cell: the copies go to the free cells below size() in order. Each copy's
  /// layer-0 K row is checked there before the originals leave; anywhere else, the copies are
  /// dropped again and nothing has moved. No shift may be pending (the state carries none).
  void gather() {
    const std::int64_t n = size();
    std::vector<char> taken(std::size_t(llama_n_ctx(ctx_)), 0);
    for (const std::int32_t c : cells_) taken[std::size_t(c)] = 1;
    std::vector<std::int64_t> holes;  // free cells below n, ascending
    for (std::int64_t c = 0; c < n; ++c)
      if (!taken[std::size_t(c)]) holes.push_back(c);
    if (holes.empty()) return;
    const stopwatch w{stats_.gather};
    std::vector<std::int64_t> movers;  // the slots in cells >= n, by cell (the state lists cells in order)
    for (std::int64_t s = 0; s < n; ++s)
      if (cells_[std::size_t(s)] >= n) movers.push_back(s);
    std::sort(movers.begin(), movers.end(),
              [&](std::int64_t a, std::int64_t b) { return cells_[std::size_t(a)] < cells_[std::size_t(b)]; });
    const auto r = route();
    const auto cached = tokens();
    const auto pos = [&](std::int64_t s) { return llama_pos(cached[std::size_t(s)].pos); };
    std::vector<position_run> one;  // each mover's own position
    for (const std::int64_t s : movers) one.push_back({pos(s), pos(s) + 1});
    const std::size_t got = r.read_state(one, gather_buf_);
    if (got != gather_buf_.size())
      infkv::raise<engine_error>("infkv: gather_cells: llama_state_seq_get_data(seq = ", r.scratch, ") = ", got, " of ",
                                 gather_buf_.size(), " bytes: no cell was moved (the eviction is complete)");
    const detail::kv_state st =
        detail::parse_kv_state(gather_buf_, n_layers(), std::int64_t(layers_[0].n_head_kv()) * layers_[0].head_dim());
    bool same = st.cells == std::int64_t(movers.size());  // the cells shared, in cell order
    for (std::size_t c = 0; same && c < movers.size(); ++c)
      same = st.pos(gather_buf_, std::int64_t(c)) == pos(movers[c]);
    if (!same)
      infkv::raise<engine_error>("infkv: gather_cells: llama_state_seq_get_data(seq = ", r.scratch, ") holds ",
                                 st.cells, " cells, not the ", movers.size(),
                                 " shared into it at their positions: no cell was moved (the eviction is complete)");
    const std::size_t put = r.calls->state_set(r.ctx, gather_buf_.data(), gather_buf_.size(), r.scratch);
    const ggml_tensor* k = caches_[0].k;
    const std::size_t row = st.layers[0].k_row;
    bool landed = put == gather_buf_.size();
    for (std::size_t c = 0; landed && c < movers.size(); ++c)
      landed = std::memcmp(gather_buf_.data() + st.k_row(0, std::int64_t(c)),
                           static_cast<const char*>(k->data) + std::size_t(holes[c]) * k->nb[1], row) == 0;
    if (!landed) {
      r.clear_scratch();
      infkv::raise<engine_error>("infkv: gather_cells: llama_state_seq_set_data(seq = ", r.scratch, ") = ", put, " of ",
                                 gather_buf_.size(), " bytes",
                                 put == gather_buf_.size()
                                     ? ", into other cells than the free ones below " + std::to_string(n)
                                     : std::string(),
                                 ": the copies were removed again and no cell was moved (the eviction is complete)");
    }
    for (std::size_t c = 0; c < movers.size(); ++c) {  // the originals leave; their copies join the sequence
      const llama_pos p = pos(movers[c]);
      if (!r.calls->seq_rm(r.mem, r.seq, p, p + 1)) {
        for (std::size_t d = 0; d < c; ++d) {
          r.calls->seq_cp(r.mem, r.scratch, r.seq, pos(movers[d]), pos(movers[d]) + 1);
          cells_[std::size_t(movers[d])] = std::int32_t(holes[d]);
        }
        r.clear_scratch();
        verify();
        infkv::raise<engine_error>("infkv: gather_cells: llama_memory_seq_rm(seq = ", r.seq, ", p0 = ", p,
                                   ", p1 = ", p + 1, ") = false: ", c, " of ", movers.size(),
                                   " cells were moved and the session follows them (the eviction is complete)");
      }
    }
    r.calls->seq_cp(r.mem, r.scratch, r.seq, -1, -1);
    r.clear_scratch();
    for (std::size_t c = 0; c < movers.size(); ++c) cells_[std::size_t(movers[c])] = std::int32_t(holes[c]);
    stats_.gathered += std::int64_t(movers.size());
  }

  void observe_h2o(std::span<const std::int64_t> pos) {
    if (h2o_.empty())
      for (std::int32_t l = 0; l < n_layers(); ++l)
        h2o_.emplace_back(*opt_.track_h2o, layers_[std::size_t(l)].n_head_kv());
    for (std::int32_t l = 0; l < n_layers(); ++l) {
      auto& st = h2o_[std::size_t(l)];
      st.append(size() - st.n_slots());
      auto in = inputs(l);
      in.queries = layers_[std::size_t(l)].batch_queries();  // every query of the batch
      in.query_pos = pos;
      cpu::observe(st, in, opt_.executor);
    }
  }

  /// Keeps the slots of `keep` in the bookkeeping, key copies, query windows and H2O states.
  void drop(const keep_set& keep) {
    const stopwatch w{stats_.host_evict};
    for (auto& l : layers_) l.evict(keep, tokens());
    for (auto& s : h2o_) s.evict(keep);
    if (engine_) {  // the cells follow the slots (the unit is in ascending order)
      std::size_t k = 0;
      for (const std::int64_t s : keep.unit(0)) cells_[k++] = cells_[std::size_t(s)];
      cells_.resize(k);
    }
    book_.keep(keep);
    std::vector<std::pair<std::int64_t, std::int64_t>> same;
    for (const auto& t : tokens()) same.push_back({t.pos, 0});
    std::sort(same.begin(), same.end());
    for (auto& l : layers_) l.remap_queries(same, nullptr, opt_.executor);
  }

  /// Gives the cached tokens positions 0..n-1 in time order (shift_positions). True when anything moved.
  bool compact_positions() {
    const std::vector<token> old(tokens().begin(), tokens().end());
    return shift_positions(old, book_.compact());
  }

  /// Moves the slots that were at `old` positions by `delta` (as many; the bookkeeping moved them
  /// already): llama_memory_seq_add per run of equal delta, those moving down in time order and
  /// then those moving up newest first, so that no run lands among the cells of one not moved
  /// yet; the key copies and window queries re-rotated alike. True when anything moved.
  bool shift_positions(const std::vector<token>& old, std::span<const std::int64_t> delta) {
    const auto order = time_order(old);
    std::vector<std::array<std::int64_t, 3>> runs;  // first position, one past the last, delta
    for (std::size_t i = 0; i < order.size();) {
      const auto d = delta[std::size_t(order[i])];
      std::size_t j = i;
      while (j < order.size() && delta[std::size_t(order[j])] == d) ++j;
      if (d != 0) runs.push_back({old[std::size_t(order[i])].pos, old[std::size_t(order[j - 1])].pos + 1, d});
      i = j;
    }
    const auto move = [&](const std::array<std::int64_t, 3>& r) {
      const stopwatch w{stats_.seq_add};
      opt_.memory.seq_add(mem_, opt_.seq, llama_pos(r[0]), llama_pos(r[1]), llama_pos(r[2]));
    };
    for (const auto& r : runs)
      if (r[2] < 0) move(r);
    for (auto r = runs.rbegin(); r != runs.rend(); ++r)
      if ((*r)[2] > 0) move(*r);
    if (runs.empty()) return false;
    shift_pending_ = engine_;        // llama.cpp turns its keys at the next decode
    if (!opt_.capture) return true;  // no host copies to turn
    const stopwatch w{stats_.rerotate};
    std::vector<std::pair<std::int64_t, std::int64_t>> map;
    for (std::size_t s = 0; s < old.size(); ++s) map.push_back({old[s].pos, delta[s]});
    std::sort(map.begin(), map.end());
    for (std::size_t l = 0; l < layers_.size(); ++l) {  // each layer with its own RoPE
      const cpu::rope* r = layer_rope_[l].has_rope ? &layer_rope_[l].params : nullptr;
      if (r && !engine_) layers_[l].rerotate_keys(delta, *r, opt_.executor);
      layers_[l].remap_queries(map, r, opt_.executor);
    }
    for (auto& s : h2o_) s.shift(tokens());
    return true;
  }

  const llama_model* model_;
  std::unique_ptr<cpu::thread_pool> pool_;  // the session's own threads (before opt_, which points to it)
  session_options opt_;
  graph_observer observer_;
  rope_info rope_;
  std::vector<rope_info> layer_rope_;
  std::int64_t n_swa_ = 0;  // sliding window of the model's SWA layers (0: none)
  llama_context* ctx_ = nullptr;
  llama_memory_t mem_ = nullptr;
  bool attached_ = false;
  bool shift_ = false;
  bool layer_rope_seen_ = false;                               // layer_rope_ read from the graph (at the first decode)
  dtype key_type_ = dtype::f16;                                // the host copies' type (attach)
  ggml_type type_k_ = GGML_TYPE_F16, type_v_ = GGML_TYPE_F16;  // llama.cpp's cache types (attach)
  session_stats stats_;
  detail::position_book book_;  // the cached tokens in slot order, where the stream goes on
  std::vector<layer_cache> layers_;
  std::vector<cpu::h2o_state> h2o_;
  std::vector<layer_inputs<const_paged_rows>> layers_in_;  // the pipeline's inputs, reused across evictions
  std::optional<cpu::workspace> workspace_;                // grown on demand, reused across evictions
  std::optional<detail::archive_link> archive_;            // session_options::archive
  std::vector<layer_inputs<const_paged_rows>> all_in_;     // every layer's inputs (all_inputs)
  std::vector<std::int32_t> scored_;                       // the layers the policies score (scored_layers), once known
  bool decided_ = false;                        // where the keys come from is settled (bind, or the first decode)
  bool engine_ = false;                         // the policies read llama.cpp's cache (cells_, caches_)
  bool shift_pending_ = false;                  // positions moved since the last decode: llama.cpp's K not yet turned
  std::vector<std::int32_t> cells_;             // each cached slot's cell (engine_)
  std::vector<std::uint8_t> gather_buf_;        // gather_cells' state of the cells it moves
  std::vector<cache_tensors> caches_;           // each layer's K and V cache tensors (engine_)
  std::int64_t fresh_ = 0;                      // newest decoded tokens whose queries were observed
  std::int64_t decoded_ = 0;                    // tokens decoded since bind
  std::vector<const_tensor_view> proxy_views_;  // each layer's proxy queries for the eviction under way
  std::vector<std::int64_t> proxy_pos_;         // ... at these positions
  std::vector<llama_token> alone_tokens_;       // proxy_mode::alone: the question of the first pass
  std::vector<std::vector<float>> alone_;       // ... its queries per layer, at positions from alone_pos_
  std::vector<std::vector<float>> turned_;      // ... turned to the eviction's positions
  std::int64_t alone_pos_ = 0;
  std::vector<score_matrix> recon_;            // reconstruct(): each layer's scores
  std::vector<std::vector<float>> pass_keys_;  // ... one pass's keys per layer (f32), during the call
  std::vector<std::int64_t> pass_seen_;        // ... the rows of each layer seen so far
  bool pass_capture_ = false;                  // key rows go to pass_keys_ (a reconstruction pass)
};

}  // namespace infkv::llama_cpp
