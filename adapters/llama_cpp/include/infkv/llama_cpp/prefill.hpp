// infkv llama.cpp adapter: budgeted block-wise prefill (Kim & Bae, arXiv 2604.16734) of a mixed
// input stream (text tokens, image tiles, video frames, audio as rows of input embeddings, e.g.
// what mtmd_get_output_embd returns) through a session. Each chunk of input becomes one segment;
// `block_prefill::plan` cuts the stream into blocks that end where a chunk ends when one does;
// each block is decoded (one llama_batch per chunk piece: a batch holds token ids or embeddings,
// not both), then the session is evicted back to the budget with the policy, so the cache never
// holds more than budget + block slots.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <llama.h>

#include <infkv/infkv.hpp>

#include "session.hpp"

namespace infkv::llama_cpp {

/// One piece of input in stream order: text token ids, or `n_tokens` rows of input embeddings.
struct chunk {
  std::span<const llama_token> tokens{};  ///< token ids (text chunks); empty for embeddings
  std::span<const float> embd{};          ///< n_tokens rows of llama_model_n_embd_inp floats, row-major
  std::int64_t n_tokens = 0;              ///< rows of `embd` (embedding chunks only)
  modality kind = modality::text;         ///< recorded on the cached tokens
  /// Explicit positions (keep mode only): one per token, or for embeddings on an M-RoPE model
  /// 4 per token, section-major (t of every token, then y, x, z), as llama_batch.pos wants them.
  /// Empty: positions continue from the session's next position.
  std::span<const llama_pos> positions{};
  /// Stream positions an explicitly positioned chunk takes (mtmd_input_chunk_get_n_pos); the next
  /// implicitly positioned chunk starts at positions[0] + n_pos or later (session::reserve_positions),
  /// in this prefill and the next. 0: one past its largest t position.
  std::int64_t n_pos = 0;
  /// Decode with non-causal attention (mtmd_decode_use_non_causal): the chunk must fit one block
  /// and one micro-batch, it is never split.
  bool non_causal = false;

  /// Number of input tokens (rows) of the chunk.
  std::int64_t size() const { return tokens.empty() ? n_tokens : std::int64_t(tokens.size()); }
  /// True for an embedding chunk (no token ids).
  bool is_embd() const { return tokens.empty(); }
};

/// A text chunk of token ids.
inline chunk text_chunk(std::span<const llama_token> tokens) { return {.tokens = tokens}; }

/// An embedding chunk: `n_tokens` rows of input embeddings of one image tile, video frame or audio piece.
inline chunk embd_chunk(std::span<const float> embd, std::int64_t n_tokens, modality kind,
                        std::span<const llama_pos> positions = {}, std::int64_t n_pos = 0) {
  return {.embd = embd, .n_tokens = n_tokens, .kind = kind, .positions = positions, .n_pos = n_pos};
}

/// What one block did, given to prefill_options::on_block after its eviction.
struct block_report {
  std::int64_t index = 0;      ///< block number
  block_range range{};         ///< input tokens [begin, end) of the block
  std::int64_t decoded = 0;    ///< slots the session held after decoding the block
  eviction_result eviction{};  ///< what the eviction after the block did (empty when none was due)
};

/// Settings of one prefill besides the policy and the schedule.
struct prefill_options {
  std::int64_t sinks = 0;        ///< first positions every eviction keeps
  std::int64_t recent = 0;       ///< last positions every eviction keeps
  bool logits_last = true;       ///< logits for the last input token
  bool evict_after_last = true;  ///< evict after the last block too
  /// The question, when it is known before the prompt is prefilled (single turn): every eviction
  /// then scores against its queries (proxy queries, computed as `proxy` says; session::evict
  /// with a question) instead of each block's own last queries, which know nothing of it. The
  /// policy must read window queries; the session needs session_options::scratch_seq and the
  /// context room for the question beside budget + block. The question's own tokens are not
  /// decoded here: put them in the last chunk (or decode them after), as without it.
  std::span<const llama_token> question{};
  proxy_mode proxy = proxy_mode::after_cache;           ///< how the question's queries are computed
  std::function<void(const block_report&)> on_block{};  ///< called after every block
};

/// What a prefill did. On a failed llama_decode it stops: `status` is the code, `failed_block`
/// and `failed_chunk` say where, `decoded` how many input tokens went in before it; the session's
/// bookkeeping matches the llama memory (the failed decode was rolled back).
struct prefill_result {
  std::vector<block_range> blocks;  ///< planned blocks, input token ranges
  std::int64_t blocks_done = 0;     ///< blocks decoded (and evicted)
  std::int64_t decoded = 0;         ///< input tokens decoded
  std::int64_t peak = 0;            ///< most slots the session held
  std::int64_t evicted = 0;         ///< slots evicted by the prefill
  std::int32_t first_segment = 0;   ///< segment of chunks[0]; chunk i has first_segment + i
  std::int32_t status = 0;          ///< 0, or the failing llama_decode's return value
  std::int64_t failed_block = -1;   ///< block of the failed decode, -1 when none
  std::int64_t failed_chunk = -1;   ///< chunk of the failed decode, -1 when none
  bool ok() const { return status == 0; }
};

/// Per-token metadata of `chunks` as planned: segment first_segment + i for chunk i, its
/// modality, and the input index as position.
inline std::vector<token> input_tokens(std::span<const chunk> chunks, std::int32_t first_segment = 0) {
  std::vector<token> t;
  for (std::size_t c = 0; c < chunks.size(); ++c)
    for (std::int64_t i = 0; i < chunks[c].size(); ++i)
      t.push_back({std::int64_t(t.size()), first_segment + std::int32_t(c), chunks[c].kind});
  return t;
}

/// Positions llama_batch.pos carries per embedding row: 4 for M-RoPE models (an image's rows then
/// share one t position, and `chunk::positions` holds 4 per row), else 1.
inline std::int64_t pos_per_embd(const llama_model* m) {
  const auto r = llama_model_rope_type(m);
  return r == LLAMA_ROPE_TYPE_MROPE || r == LLAMA_ROPE_TYPE_IMROPE ? GGML_MROPE_SECTIONS : 1;
}

namespace detail {

/// Checks one chunk against the model and the session's position mode.
inline void validate_chunk(const chunk& c, std::size_t i, const llama_model* m, position_mode mode) {
  const std::string at = "chunks[" + std::to_string(i) + "]";
  INFKV_REQUIRE(c.tokens.empty() || c.embd.empty(), at + ".embd.size()", c.embd.size(),
                "a chunk holds token ids or embeddings, not both (tokens.size() = ", c.tokens.size(), ")");
  INFKV_REQUIRE(c.size() > 0, at + ".size()", c.size(), "a chunk needs at least one token or embedding row");
  if (c.is_embd()) {
    const std::int64_t n_embd = llama_model_n_embd_inp(m);
    INFKV_REQUIRE(std::int64_t(c.embd.size()) == c.n_tokens * n_embd, at + ".embd.size()", c.embd.size(),
                  "must be n_tokens (", c.n_tokens, ") * llama_model_n_embd_inp (", n_embd, ")");
  } else {
    INFKV_REQUIRE(c.n_tokens == 0 || c.n_tokens == c.size(), at + ".n_tokens", c.n_tokens,
                  "a text chunk takes its size from tokens.size() = ", c.tokens.size());
  }
  if (c.positions.empty()) {
    INFKV_REQUIRE(c.n_pos == 0, at + ".n_pos", c.n_pos, "applies to explicit positions only");
    return;
  }
  INFKV_REQUIRE(mode == position_mode::keep, at + ".positions.size()", c.positions.size(),
                "explicit positions need the session in position_mode::keep (compaction renumbers them)");
  const std::int64_t per = c.is_embd() ? pos_per_embd(m) : 1;
  INFKV_REQUIRE(std::int64_t(c.positions.size()) == c.size() * per, at + ".positions.size()", c.positions.size(),
                "must be ", per, " * ", c.size(), " (positions per token * tokens)");
  for (std::size_t k = 0; k < c.positions.size(); ++k)
    INFKV_REQUIRE(c.positions[k] >= 0, at + ".positions[" + std::to_string(k) + "]", c.positions[k], "must be >= 0");
  INFKV_REQUIRE(c.n_pos >= 0, at + ".n_pos", c.n_pos, "must be >= 0");
}

/// Restores causal attention when a non-causal chunk is done (or throws).
struct causal_scope {
  llama_context* ctx;
  bool on;
  causal_scope(llama_context* c, bool non_causal) : ctx(c), on(non_causal) {
    if (on) llama_set_causal_attn(ctx, false);
  }
  ~causal_scope() {
    if (on) llama_set_causal_attn(ctx, true);
  }
  causal_scope(const causal_scope&) = delete;
  causal_scope& operator=(const causal_scope&) = delete;
};

}  // namespace detail

/// Prefills `chunks` into `s` block by block: plans blocks with `schedule` over the chunks'
/// segments, decodes each block, then evicts back to schedule.budget with `p` (protecting
/// opt.sinks, opt.recent and what the policy protects). A session that already holds more than
/// the budget is evicted first; a session that holds anything plans its first block of
/// schedule.block tokens, so the cache never exceeds budget + block slots. All arguments are
/// checked before anything is decoded. Cost: the decodes plus one eviction per block. With `h2o`
/// the session accumulates H2O's scores at every decode (session_options::for_policy(h2o{})),
/// non-causal chunks included as if causal. With opt.question every eviction scores against the
/// question's queries (the query-aware mode; one decode of the question aside per eviction with
/// proxy_mode::after_cache, one in all with alone).
template <policy P>
prefill_result prefill(session& s, std::span<const chunk> chunks, const P& p, const block_prefill& schedule,
                       const prefill_options& opt = {}) {
  llama_context* ctx = s.context();
  INFKV_REQUIRE(ctx != nullptr, "ctx", "null", "bind a context before prefilling");
  const llama_model* m = llama_get_model(ctx);
  schedule.validate();
  p.validate();
  const budget b{.capacity = schedule.budget, .sinks = opt.sinks, .recent = opt.recent};
  INFKV_REQUIRE(opt.sinks >= 0, "prefill_options.sinks", opt.sinks, "must be >= 0");
  INFKV_REQUIRE(opt.recent >= 0, "prefill_options.recent", opt.recent, "must be >= 0");
  const policy_spec spec = p.spec();
  const budget pb = spec.protect(b);
  INFKV_REQUIRE(schedule.budget >= pb.sinks + pb.recent, "block_prefill.budget", schedule.budget,
                "cannot hold the protected tokens of ", spec.name, ": sinks (", pb.sinks, ") + recent (", pb.recent,
                ")");
  s.require_captures(spec);
  const auto n_question = std::int64_t(opt.question.size());
  if (n_question > 0)
    INFKV_REQUIRE(spec.reads_queries() && !spec.accumulates(), "prefill_options.question.size()", n_question, spec.name,
                  " reads no window queries, so a question cannot steer it: prefill without one");
  const std::int64_t n_ctx = llama_n_ctx(ctx);
  INFKV_REQUIRE(n_ctx >= schedule.peak() + n_question, "llama_n_ctx(ctx)", n_ctx,
                "the context cannot hold block_prefill.budget (", schedule.budget, ") + block (", schedule.block,
                ") slots", n_question > 0 ? " + the question's tokens" : "",
                ": create it with n_ctx >= ", schedule.peak() + n_question);
  for (std::size_t i = 0; i < chunks.size(); ++i) detail::validate_chunk(chunks[i], i, m, s.mode());

  prefill_result res;
  std::int32_t seg0 = 0;
  for (const auto& t : s.tokens()) seg0 = std::max(seg0, t.segment + 1);
  res.first_segment = seg0;
  const auto meta = input_tokens(chunks, seg0);
  block_prefill plan_with = schedule;
  if (s.size() > 0) plan_with.first_block_fills_budget = false;
  res.blocks = plan_with.plan(meta);
  if (res.blocks.empty()) return res;

  std::vector<std::int64_t> start(chunks.size() + 1, 0);  // input index of each chunk's first token
  for (std::size_t c = 0; c < chunks.size(); ++c) start[c + 1] = start[c] + chunks[c].size();
  const std::int64_t n_ubatch = llama_n_ubatch(ctx), n_batch = llama_n_batch(ctx);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (!chunks[c].non_causal) continue;
    const bool one_block = std::ranges::any_of(
        res.blocks, [&](const block_range& r) { return r.begin <= start[c] && start[c + 1] <= r.end; });
    INFKV_REQUIRE(one_block && chunks[c].size() <= std::min(n_ubatch, n_batch),
                  "chunks[" + std::to_string(c) + "].size()", chunks[c].size(),
                  "a non-causal chunk must fit one block (block_prefill.block = ", schedule.block,
                  ") and one micro-batch (llama_n_ubatch = ", n_ubatch, ")");
  }

  const auto evict = [&] { return n_question > 0 ? s.evict(p, b, opt.question, opt.proxy) : s.evict(p, b); };
  if (s.size() > schedule.budget) res.evicted += evict().evicted;
  res.peak = s.size();
  const std::int64_t per = pos_per_embd(m);
  const std::int64_t n_embd = llama_model_n_embd_inp(m);
  const llama_seq_id seq = s.options().seq;
  const std::int64_t n_input = start.back();
  std::vector<llama_pos> pos;
  std::vector<std::int32_t> n_seq_id;
  std::vector<llama_seq_id> seq_ids;
  std::vector<llama_seq_id*> seq_ptr;
  std::vector<std::int8_t> logits;

  for (std::size_t k = 0; k < res.blocks.size(); ++k) {
    const auto r = res.blocks[k];
    std::size_t c = std::size_t(std::upper_bound(start.begin(), start.end(), r.begin) - start.begin()) - 1;
    for (std::int64_t i = r.begin; i < r.end;) {
      while (start[c + 1] <= i) ++c;
      const chunk& ch = chunks[c];
      const std::int64_t off = i - start[c];
      const std::int64_t n = std::min({r.end, start[c + 1], i + n_batch}) - i;
      const std::int64_t n_sec = ch.is_embd() ? per : 1;
      pos.assign(std::size_t(n * n_sec), 0);
      if (!ch.positions.empty()) {
        for (std::int64_t j = 0; j < n_sec; ++j)
          for (std::int64_t t = 0; t < n; ++t)
            pos[std::size_t(j * n + t)] = ch.positions[std::size_t(j * ch.size() + off + t)];
      } else {
        const std::int64_t p0 = s.next_pos();
        for (std::int64_t j = 0; j < n_sec; ++j)
          for (std::int64_t t = 0; t < n; ++t) pos[std::size_t(j * n + t)] = llama_pos(p0 + t);
      }
      n_seq_id.assign(std::size_t(n), 1);
      seq_ids.assign(std::size_t(n), seq);
      seq_ptr.resize(std::size_t(n));
      for (std::int64_t t = 0; t < n; ++t) seq_ptr[std::size_t(t)] = &seq_ids[std::size_t(t)];
      logits.assign(std::size_t(n), 0);
      if (opt.logits_last && i + n == n_input) logits.back() = 1;
      // llama_decode reads the token ids and embeddings only; the casts do not lead to writes.
      llama_batch batch{};
      batch.n_tokens = std::int32_t(n);
      if (ch.is_embd())
        batch.embd = const_cast<float*>(ch.embd.data() + off * n_embd);
      else
        batch.token = const_cast<llama_token*>(ch.tokens.data() + off);
      batch.pos = pos.data();
      batch.n_seq_id = n_seq_id.data();
      batch.seq_id = seq_ptr.data();
      batch.logits = logits.data();
      std::int32_t rc = 0;
      {
        const detail::causal_scope scope(ctx, ch.non_causal);
        rc = s.decode(batch, {.segment = seg0 + std::int32_t(c), .kind = ch.kind});
      }
      if (rc != 0) {
        res.status = rc;
        res.failed_block = std::int64_t(k);
        res.failed_chunk = std::int64_t(c);
        return res;
      }
      i += n;
      res.decoded = i;
      if (i == start[c + 1] && !ch.positions.empty()) {
        std::int64_t last = ch.positions[0];
        for (std::int64_t t = 0; t < ch.size(); ++t) last = std::max<std::int64_t>(last, ch.positions[std::size_t(t)]);
        s.reserve_positions(ch.n_pos > 0 ? ch.positions[0] + ch.n_pos : last + 1);
      }
    }
    block_report rep{std::int64_t(k), r, s.size(), {0, s.size(), {}, false}};
    res.peak = std::max(res.peak, s.size());
    const bool last = k + 1 == res.blocks.size();
    if (schedule.due(s.size()) && (!last || opt.evict_after_last)) {
      rep.eviction = evict();
      res.evicted += rep.eviction.evicted;
    }
    res.blocks_done = std::int64_t(k) + 1;
    if (opt.on_block) opt.on_block(rep);
  }
  return res;
}

}  // namespace infkv::llama_cpp
