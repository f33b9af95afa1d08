// infkv-stream: perplexity of a token stream through one runner, block by block: decode a block
// with logits for every token, score each token's negative log-likelihood (the first one from the
// previous block's last logits) before the eviction, then evict back to the budget.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runner.hpp"

namespace stream {

/// What one block of the stream measured.
struct block_record {
  std::int64_t index = 0;       ///< block number from 0
  std::int64_t tokens = 0;      ///< text tokens up to the end of this block (skipped ones included)
  std::int64_t scored = 0;      ///< tokens of the block with a prediction (the stream's first has none)
  double nll = 0.0;             ///< summed negative log-likelihood of the block's scored tokens
  double block_ppl = 0.0;       ///< exp(nll / scored)
  double running_ppl = 0.0;     ///< over every scored token so far
  double window_ppl = 0.0;      ///< over the last `smooth` blocks (moving average in the log domain)
  std::int64_t slots_peak = 0;  ///< cached tokens after the decode, before the eviction
  std::int64_t slots = 0;       ///< cached tokens after the eviction
  std::int64_t evicted = 0;
  std::int64_t kv_alloc_bytes = 0;  ///< llama.cpp K/V buffers (computed from n_ctx)
  std::int64_t kv_state_bytes = 0;  ///< llama_state_seq_get_size after the eviction
  std::int64_t host_bytes = 0;      ///< the session's key/query copies
  std::int64_t rss_bytes = 0;       ///< process RSS after the block
  double seconds = 0.0;             ///< decode + scoring + eviction of the block
  double tok_per_s = 0.0;
};

/// One policy's whole run.
struct stream_run {
  std::string policy;
  std::vector<block_record> blocks;
  double seconds = 0.0;  ///< the sum of its blocks' seconds
  std::int64_t tokens = 0;
  std::int64_t skipped = 0;                ///< text tokens before the stream's first (--skip)
  std::string note;                        ///< why the run covers fewer tokens than asked, if it does
  infkv::llama_cpp::session_stats time{};  ///< where the seconds went (runner::stats)
};

/// Figures of one run for the summary table.
struct run_summary {
  double ppl = 0.0;              ///< over every scored token
  double early_ppl = 0.0;        ///< first 10% of the blocks after warm-up
  double late_ppl = 0.0;         ///< last 10% of the blocks after warm-up
  std::int64_t warm_blocks = 0;  ///< blocks that count as after warm-up
  double tok_per_s = 0.0;
  std::int64_t max_slots = 0, kv_alloc_bytes = 0, peak_rss = 0, evictions = 0;
};

/// One policy's stream, a block at a time: decode a block of `toks` (the text's tokens from index
/// `skipped` on) through `r`, score its tokens, evict. Several steppers can take turns (--interleave):
/// a run's seconds are the sum of its own blocks', whatever ran between them.
class stream_stepper {
 public:
  stream_stepper(runner& r, std::string policy, std::span<const llama_token> toks, std::int64_t skipped,
                 const settings& s, std::int64_t smooth)
      : r_(r), toks_(toks), s_(s), smooth_(smooth) {
    out_.policy = std::move(policy);
    out_.skipped = skipped;
  }
  bool done() const { return at_ >= std::int64_t(toks_.size()); }
  std::int64_t n_blocks() const { return (std::int64_t(toks_.size()) + s_.block - 1) / s_.block; }

  /// Streams the next block; returns its record.
  const block_record& step() {
    const auto t0 = std::chrono::steady_clock::now();
    const auto blk = toks_.subspan(std::size_t(at_),
                                   std::size_t(std::min<std::int64_t>(s_.block, std::int64_t(toks_.size()) - at_)));
    r_.feed(blk);
    block_record rec{.index = index_, .tokens = out_.skipped + at_ + std::int64_t(blk.size())};
    for (std::size_t i = 0; i < blk.size(); ++i) {
      if (i == 0 && prev_.empty()) continue;
      rec.nll += token_nll(i == 0 ? std::span<const float>(prev_) : r_.logits(std::int64_t(i) - 1), blk[i]);
      ++rec.scored;
    }
    const auto last = r_.logits(std::int64_t(blk.size()) - 1);
    prev_.assign(last.begin(), last.end());
    rec.slots_peak = r_.slots();
    rec.evicted = r_.evict();
    rec.slots = r_.slots();
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rec.tok_per_s = double(blk.size()) / rec.seconds;
    total_nll_ += rec.nll, total_scored_ += rec.scored;
    rec.block_ppl = rec.scored ? std::exp(rec.nll / double(rec.scored)) : NAN;
    rec.running_ppl = total_scored_ ? std::exp(total_nll_ / double(total_scored_)) : NAN;
    double wn = rec.nll;
    std::int64_t wc = rec.scored;
    for (std::int64_t j = std::int64_t(out_.blocks.size()) - 1; j >= 0 && j > index_ - smooth_; --j)
      wn += out_.blocks[std::size_t(j)].nll, wc += out_.blocks[std::size_t(j)].scored;
    rec.window_ppl = wc ? std::exp(wn / double(wc)) : NAN;
    rec.kv_alloc_bytes = r_.kv_alloc_bytes();
    rec.kv_state_bytes = r_.kv_state_bytes();
    rec.host_bytes = r_.host_bytes();
    rec.rss_bytes = rss_bytes();
    out_.seconds += rec.seconds;
    out_.blocks.push_back(rec);
    at_ += std::int64_t(blk.size()), ++index_;
    return out_.blocks.back();
  }

  /// The whole run (after the last step).
  stream_run finish() {
    out_.tokens = std::int64_t(toks_.size());
    out_.time = r_.stats();
    return std::move(out_);
  }

 private:
  runner& r_;
  std::span<const llama_token> toks_;
  const settings& s_;
  std::int64_t smooth_;
  stream_run out_;
  std::vector<float> prev_;  // logits of the previous block's last token
  double total_nll_ = 0.0;
  std::int64_t total_scored_ = 0, at_ = 0, index_ = 0;
};

/// exp of the mean NLL over `blocks`.
inline double ppl_of(std::span<const block_record> blocks) {
  double n = 0.0;
  std::int64_t c = 0;
  for (const auto& b : blocks) n += b.nll, c += b.scored;
  return c ? std::exp(n / double(c)) : NAN;
}

/// Summary of a run. Warm-up: the blocks that end within budget + block tokens (no eviction can
/// have happened before them); early / late: the first / last 10% (at least one block) of the rest.
inline run_summary summarise(const stream_run& run, const settings& s) {
  run_summary r;
  std::span<const block_record> all(run.blocks);
  r.ppl = ppl_of(all);
  std::size_t first = 0;
  while (first < all.size() && all[first].tokens - run.skipped <= s.budget + s.block) ++first;
  const auto warm = all.subspan(first);
  r.warm_blocks = std::int64_t(warm.size());
  if (!warm.empty()) {
    const std::size_t tenth = std::max<std::size_t>(1, warm.size() / 10);
    r.early_ppl = ppl_of(warm.first(tenth));
    r.late_ppl = ppl_of(warm.last(tenth));
  } else {
    r.early_ppl = r.late_ppl = NAN;
  }
  r.tok_per_s = run.seconds > 0 ? double(run.tokens) / run.seconds : 0.0;
  for (const auto& b : all) {
    r.max_slots = std::max(r.max_slots, b.slots_peak);
    r.kv_alloc_bytes = std::max(r.kv_alloc_bytes, b.kv_alloc_bytes);
    r.peak_rss = std::max(r.peak_rss, b.rss_bytes);
    r.evictions += b.evicted > 0;
  }
  return r;
}

}  // namespace stream
