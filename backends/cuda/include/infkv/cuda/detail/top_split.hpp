// infkv CUDA backend: keep_top's selection blocks (top_split), the per-unit selection that
// select_steps.hpp's keep_top launches: a first-digit histogram and a gather of the boundary
// digit's keys over many blocks, a block per unit selecting among them, the kept slots emitted by
// many blocks.
#pragma once

#include "block_steps.hpp"
#include "common.hpp"

namespace infkv::cuda::detail {

/// keep_top's selection. Unit u keeps its protected slots and the `want` candidates of smallest
/// key, key(j) = descending score bits << 32 | tie rank << (32 - rank bits) (unique per slot: the
/// rank is), written in slot order at its offset. Parts are runs of `slice` slots; four
/// block-level steps after the ranks:
///  1. histogram, a block per (unit, part): every score checked; the first digit (the key's top
///     12 bits) of each candidate counted in shared memory, then added to the unit's histogram
///     (integer atomics: the same sums in any order).
///  2. gather, a block per (unit, part): the block scans the unit's histogram and finds the digit
///     d holding the wanted rank (every block the same one): smaller digits are kept, larger ones
///     dropped; it counts the slots it keeps for sure and, when only some of d's keys are kept,
///     sorts its keys of digit d by their second digit (the next 8 bits) into its part's region,
///     with where each group starts, and adds their second digits to the unit's histogram of them.
///  3. finish, a block per unit: the second digit d2 holding the rank still wanted, from that
///     histogram; then radix select MSB-first (8-bit digits, 4 bits last) over the groups d2 of
///     the parts only (held in shared memory when `buffer` keys hold them, else read from the
///     regions on each pass) for the unit's bound; then per part its kept count (for sure, its
///     groups below d2, its keys of group d2 under the bound) scanned into its offset.
///  4. emit, a block per (unit, part): each thread counts a run of the part's slots, a block scan
///     gives each its offset, each thread writes its kept slots.
/// So the scores are read by many blocks, and the one block per unit reads only the keys that
/// share the boundary's first 20 bits (most of a unit's row when its scores are close together
/// share the first 12). Every scan over threads or bins is a block scan (block_scan): no thread
/// walks them alone.
struct top_split {
  static constexpr int first_shift = 64 - top_digit, bins = 256;
  static constexpr std::uint32_t guarded_rank = ~std::uint32_t{0};  ///< a protected slot's rank
  score_view s;
  const std::uint32_t* rank;  ///< per slot, guarded_rank when protected
  const std::int64_t* caps;   ///< per unit, or null: `cap` each
  std::int64_t cap, n, guarded, room, units, slice, parts;
  int rb;
  std::int64_t *offsets, *slots;
  status_word* st;
  select_scratch w;
  std::int64_t buffer;  ///< candidate keys the finishing block holds in shared memory
  int threads;          ///< every block's threads

  struct gather_state {
    std::int64_t digit, need;
    std::uint32_t sure, fill;
  };
  struct finish_state {
    std::uint64_t prefix, bound;
    std::int64_t want, second;
    std::uint32_t fill;
    int done;
  };

  std::size_t histogram_shared() const { return shared_round(top_bins * 4); }
  std::size_t gather_shared() const {
    return shared_round(top_bins * 4) + shared_round(std::size_t(threads) * 4) + shared_round(sizeof(gather_state)) +
           2 * shared_round(top_bins2 * 4) + shared_round(std::size_t(slice) * 8);
  }
  std::size_t finish_shared() const {
    return shared_round(bins * 4) + shared_round(std::size_t(threads) * 8) + shared_round(sizeof(finish_state)) +
           shared_round(std::size_t(buffer) * 8);
  }
  std::size_t emit_shared() const { return shared_round(std::size_t(threads) * 8); }

  INFKV_HOST_DEVICE std::uint64_t key(std::int64_t u, std::int64_t j) const {
    const std::uint32_t r = rank[j];
    if (r == guarded_rank) return no_key;
    return (std::uint64_t(descending_bits(s(u, j))) << 32) | (std::uint64_t(r) << (32 - rb));
  }
  /// Candidates unit u keeps besides its protected slots (at most n - guarded of them exist).
  INFKV_HOST_DEVICE std::int64_t wanted(std::int64_t u) const {
    const std::int64_t want = caps ? caps[u] : cap;
    return (want < n ? want : n) - guarded;
  }
  /// Slots unit u keeps: the protected ones and min(need, candidates) others.
  INFKV_HOST_DEVICE std::int64_t kept_count(std::int64_t u) const {
    const std::int64_t want = caps ? caps[u] : cap, m = want < n ? want : n;
    return m > guarded ? m : guarded;
  }
  INFKV_HOST_DEVICE std::int64_t begin(std::int64_t p) const { return p * slice; }
  INFKV_HOST_DEVICE std::int64_t end(std::int64_t p) const { return (p + 1) * slice < n ? (p + 1) * slice : n; }
  /// Where group g (a second digit; top_bins2: the end) of part p of unit u starts in its region.
  INFKV_HOST_DEVICE std::int64_t& group(std::int64_t u, std::int64_t p, std::int64_t g) const {
    return w.groups[(u * parts + p) * (top_bins2 + 1) + g];
  }
  INFKV_HOST_DEVICE static std::uint32_t second_digit(std::uint64_t k) {
    return std::uint32_t(k >> (first_shift - 8)) & std::uint32_t(top_bins2 - 1);
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void histogram(const Ctx& c) const {
    const std::int64_t u = c.block / parts, p = c.block % parts;
    auto* h = reinterpret_cast<std::uint32_t*>(c.shared);
    for (std::int64_t b = c.thread; b < top_bins; b += c.threads) h[b] = 0;
    c.sync();
    for (std::int64_t j = begin(p) + c.thread; j < end(p); j += c.threads) {
      if (const float v = s(u, j); v != v) record(st, encode(fault::nan_score, u, 0, j));
      if (const std::uint64_t k = key(u, j); k != no_key) shared_add(h + (k >> first_shift), 1);
    }
    c.sync();
    for (std::int64_t b = c.thread; b < top_bins; b += c.threads)
      if (h[b] != 0) add_count(w.hist + u * top_bins + b, h[b]);
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void gather(const Ctx& c) const {
    const std::int64_t u = c.block / parts, p = c.block % parts;
    std::byte* at = c.shared;
    auto* h = reinterpret_cast<std::uint32_t*>(at);
    auto* part = reinterpret_cast<std::uint32_t*>(at += shared_round(top_bins * 4));
    auto* z = reinterpret_cast<gather_state*>(at += shared_round(std::size_t(threads) * 4));
    auto* g = reinterpret_cast<std::uint32_t*>(at += shared_round(sizeof(gather_state)));
    auto* cursor = reinterpret_cast<std::uint32_t*>(at += shared_round(top_bins2 * 4));
    auto* held = reinterpret_cast<std::uint64_t*>(at += shared_round(top_bins2 * 4));
    for (std::int64_t b = c.thread; b < top_bins; b += c.threads) h[b] = std::uint32_t(w.hist[u * top_bins + b]);
    for (std::int64_t b = c.thread; b < top_bins2; b += c.threads) g[b] = 0, cursor[b] = 0;
    const std::int64_t want = wanted(u);
    if (c.thread == 0) {  // nothing wanted: no digit kept (digit 0, need 0); fewer than wanted: all
      z->digit = want <= 0 ? 0 : top_bins, z->need = 0, z->sure = 0, z->fill = 0;
    }
    c.sync();
    const std::int64_t total = block_exclusive_scan(c, h, top_bins, part);
    at_wanted_bin(c, h, top_bins, total, want, [&](std::int64_t b, std::int64_t before, std::int64_t next) {
      if (want == next)  // all of this digit: the next one bounds
        z->digit = b + 1, z->need = 0;
      else
        z->digit = b, z->need = want - before;
    });
    c.sync();
    const std::int64_t digit = z->digit, need = z->need;
    std::uint32_t sure = 0;
    for (std::int64_t j = begin(p) + c.thread; j < end(p); j += c.threads) {
      const std::uint64_t k = key(u, j);
      const auto d = std::int64_t(k >> first_shift);
      if (k == no_key || d < digit) {
        ++sure;
      } else if (need > 0 && d == digit) {
#if defined(__CUDA_ARCH__)
        held[atomicAdd(&z->fill, 1u)] = k;
#else
        held[z->fill++] = k;
#endif
        shared_add(g + second_digit(k), 1);
      }
    }
    shared_add(&z->sure, sure);
    c.sync();
    const std::uint32_t fill = z->fill;
    if (c.thread == 0) {
      w.sure[u * parts + p] = z->sure, group(u, p, top_bins2) = fill;
      if (p == 0) w.digit[u] = digit, w.need[u] = need;
    }
    if (need == 0) return;  // (every thread: need is the block's)
    for (std::int64_t b = c.thread; b < top_bins2; b += c.threads)
      if (g[b] != 0) add_count(w.hist2 + u * top_bins2 + b, g[b]);
    block_exclusive_scan(c, g, top_bins2, part);
    for (std::int64_t b = c.thread; b < top_bins2; b += c.threads) group(u, p, b) = g[b];
    for (std::int64_t x = c.thread; x < fill; x += c.threads) {
      const std::uint64_t k = held[x];
      const std::uint32_t b = second_digit(k);
#if defined(__CUDA_ARCH__)
      const std::uint32_t slot = g[b] + atomicAdd(cursor + b, 1u);
#else
      const std::uint32_t slot = g[b] + cursor[b]++;
#endif
      w.cand[u * n + begin(p) + slot] = k;
    }
  }

  /// Calls f(key) for every candidate of group `second` of unit u (from shared memory once held
  /// there).
  template <class Ctx, class F>
  INFKV_HOST_DEVICE void each_candidate(const Ctx& c, std::int64_t u, std::int64_t second, const std::uint64_t* held,
                                        bool buffered, std::int64_t fill, F f) const {
    if (buffered) {
      for (std::int64_t x = c.thread; x < fill; x += c.threads) f(held[x]);
      return;
    }
    for (std::int64_t p = 0; p < parts; ++p) {
      const std::int64_t lo = group(u, p, second), hi = group(u, p, second + 1);
      for (std::int64_t x = lo + c.thread; x < hi; x += c.threads) f(w.cand[u * n + begin(p) + x]);
    }
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void finish(const Ctx& c) const {
    const std::int64_t u = c.block;
    auto* hist = reinterpret_cast<std::uint32_t*>(c.shared);
    auto* part = reinterpret_cast<std::int64_t*>(c.shared + shared_round(bins * 4));
    auto* z =
        reinterpret_cast<finish_state*>(c.shared + shared_round(bins * 4) + shared_round(std::size_t(threads) * 8));
    auto* held = reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::byte*>(z) + shared_round(sizeof(finish_state)));
    const std::int64_t digit = w.digit[u], need = w.need[u];
    if (c.thread == 0) {
      z->fill = 0, z->done = need > 0 ? 0 : 1, z->second = 0;
      z->bound = digit >= top_bins ? no_key : std::uint64_t(digit) << first_shift;  // need 0: digits below
    }
    // The second digit holding the rank wanted, from the unit's histogram of them.
    for (int b = c.thread; b < bins; b += c.threads) hist[b] = need > 0 ? std::uint32_t(w.hist2[u * top_bins2 + b]) : 0;
    c.sync();
    const auto in_first =
        std::int64_t(block_exclusive_scan(c, hist, top_bins2, reinterpret_cast<std::uint32_t*>(part)));
    std::int64_t in_second = 0;  // this thread's view of the candidates in the second digit found
    at_wanted_bin(c, hist, top_bins2, in_first, need, [&](std::int64_t b, std::int64_t before, std::int64_t next) {
      const std::uint64_t found = (std::uint64_t(digit) << 8) | std::uint64_t(b), after = found + 1;
      z->second = b;
      if (need == next) {
        z->bound = after >> (72 - first_shift) != 0 ? no_key : after << (first_shift - 8);
        z->done = 1;
      } else {
        z->prefix = found, z->want = need - before;
      }
    });
    c.sync();
    const std::int64_t second = z->second;
    const bool selecting = z->done == 0;
    if (selecting) {
      for (std::int64_t p = c.thread; p < parts; p += c.threads)
        in_second += group(u, p, second + 1) - group(u, p, second);
    }
    const std::int64_t total = block_scan(c, in_second, part).total;
    const bool buffered = selecting && total <= buffer;
    if (buffered) {
      each_candidate(c, u, second, held, false, 0, [&](std::uint64_t k) {
#if defined(__CUDA_ARCH__)
        held[atomicAdd(&z->fill, 1u)] = k;
#else
        held[z->fill++] = k;
#endif
      });
      c.sync();
    }
    for (int shift = first_shift - 16, width = 8; z->done == 0; width = shift == 4 ? 4 : 8, shift -= width) {
      for (int b = c.thread; b < bins; b += c.threads) hist[b] = 0;
      const std::uint64_t pre = z->prefix;
      const std::int64_t want = z->want;
      const int above = shift + width;
      c.sync();
      each_candidate(c, u, second, held, buffered, z->fill, [&](std::uint64_t k) {
        if (k >> above == pre) shared_add(hist + (std::uint32_t(k >> shift) & ((1u << width) - 1)), 1);
      });
      c.sync();
      const auto in_all =
          std::int64_t(block_exclusive_scan(c, hist, std::int64_t(1) << width, reinterpret_cast<std::uint32_t*>(part)));
      at_wanted_bin(c, hist, std::int64_t(1) << width, in_all, want,
                    [&](std::int64_t b, std::int64_t before, std::int64_t next) {
                      const std::uint64_t found = (pre << width) | std::uint64_t(b), after = found + 1;
                      if (want == next || shift == 0) {  // exactly the ones wanted (or the last digit)
                        z->bound = shift == 0 ? after : after >> (64 - shift) != 0 ? no_key : after << shift;
                        z->done = 1;
                      } else {
                        z->prefix = found, z->want = want - before;
                      }
                    });
      c.sync();
    }
    const std::uint64_t bound = z->bound;
    // Offsets: per part, what it keeps for sure, its groups below the second digit and its keys
    // of that group under the bound, scanned in pieces of `threads` parts from the slots the
    // units before u keep.
    std::int64_t run = 0;
    for (std::int64_t v = 0; v < u; ++v) run += kept_count(v);
    if (c.thread == 0) {
      offsets[u] = run;
      if (u == units - 1) offsets[units] = run + kept_count(u);
      w.bound[u] = bound;
    }
    for (std::int64_t p0 = 0; p0 < parts; p0 += c.threads) {
      const std::int64_t p = p0 + c.thread;
      std::int64_t kept = 0;
      if (p < parts) {
        kept = w.sure[u * parts + p];
        if (need > 0) {
          kept += group(u, p, second);
          for (std::int64_t x = group(u, p, second); x < group(u, p, second + 1); ++x)
            kept += w.cand[u * n + begin(p) + x] < bound ? 1 : 0;
        }
      }
      const block_scanned<std::int64_t> r = block_scan(c, kept, part);
      if (p < parts) w.offset[u * parts + p] = run + r.before;
      run += r.total;
    }
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void emit(const Ctx& c) const {
    const std::int64_t u = c.block / parts, p = c.block % parts;
    auto* part = reinterpret_cast<std::int64_t*>(c.shared);
    const std::uint64_t bound = w.bound[u];
    const std::int64_t len = end(p) - begin(p), per = (len + c.threads - 1) / c.threads;
    const std::int64_t lo0 = begin(p) + std::int64_t(c.thread) * per, lo = lo0 < end(p) ? lo0 : end(p),
                       hi = lo + per < end(p) ? lo + per : end(p);
    const auto kept = [&](std::int64_t j) { return rank[j] == guarded_rank || key(u, j) < bound; };
    std::int64_t mine = 0;
    for (std::int64_t j = lo; j < hi; ++j) mine += kept(j) ? 1 : 0;
    std::int64_t at = w.offset[u * parts + p] + block_scan(c, mine, part).before;
    for (std::int64_t j = lo; j < hi; ++j)
      if (kept(j)) {
        if (at < room) slots[at] = j;
        ++at;
      }
  }
};

}  // namespace infkv::cuda::detail
