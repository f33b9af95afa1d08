// infkv CUDA backend: the selection steps of basic_backend (steps.hpp declares them, with the
// scoring steps): the radix select that finds AdaKV's threshold over all rows (MSB-first 8-bit
// digit histograms over many blocks), AdaKV's allocation, the per-unit selection (top_split: a
// first-digit histogram over many blocks, the boundary digit's candidates selected by a block per
// unit, the kept slots emitted by many blocks) and a union's mark. Included at
// the end of steps.hpp.
#pragma once

#include <limits>

#include "block_steps.hpp"
#include "steps.hpp"

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
    for (std::int64_t b = c.thread; b < top_bins; b += c.threads) {
      const std::int64_t before = h[b], next = b + 1 < top_bins ? std::int64_t(h[b + 1]) : total;
      if (want > 0 && before < want && want <= next) {
        if (want == next)  // all of this digit: the next one bounds
          z->digit = b + 1, z->need = 0;
        else
          z->digit = b, z->need = want - before;
      }
    }
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
    for (int b = c.thread; b < bins && need > 0; b += c.threads) {
      const std::int64_t before = hist[b], next = b + 1 < bins ? std::int64_t(hist[b + 1]) : in_first;
      if (before < need && need <= next) {
        const std::uint64_t found = (std::uint64_t(digit) << 8) | std::uint64_t(b), after = found + 1;
        z->second = b;
        if (need == next) {
          z->bound = after >> (72 - first_shift) != 0 ? no_key : after << (first_shift - 8);
          z->done = 1;
        } else {
          z->prefix = found, z->want = need - before;
        }
      }
    }
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
      for (int b = c.thread; b < (1 << width); b += c.threads) {
        const std::int64_t before = hist[b], next = b + 1 < (1 << width) ? std::int64_t(hist[b + 1]) : in_all;
        if (before < want && want <= next) {
          const std::uint64_t found = (pre << width) | std::uint64_t(b), after = found + 1;
          if (want == next || shift == 0) {  // exactly the ones wanted (or the last digit)
            z->bound = shift == 0 ? after : after >> (64 - shift) != 0 ? no_key : after << shift;
            z->done = 1;
          } else {
            z->prefix = found, z->want = want - before;
          }
        }
      }
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

namespace infkv::cuda {

template <class L>
void basic_backend<L>::radix_select(const std::uint64_t* keys, std::int64_t segments, std::int64_t len, int bits,
                                    const detail::radix_scratch& w) const {
  using detail::counter, detail::select_bins, detail::select_digit, detail::select_tile;
  const std::int64_t tiles = detail::select_tiles(len);
  std::int64_t* need = w.need;
  std::uint64_t *prefix = w.prefix, *bound = w.bound;
  counter* hist = w.hist;
  launch.for_each(segments * select_bins, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    hist[x] = 0;
    if (x % select_bins == 0)
      prefix[x / select_bins] = 0, bound[x / select_bins] = 0;  // 0 stays when nothing is wanted
  });
  const int passes = bits <= select_digit ? 1 : (bits + select_digit - 1) / select_digit;
  for (int p = passes - 1; p >= 0; --p) {
    const int shift = p * select_digit, above = shift + select_digit;
    launch.for_each(segments * tiles, [=] INFKV_HOST_DEVICE(std::int64_t x) {
      const std::int64_t g = x / tiles, lo = (x % tiles) * select_tile,
                         hi = lo + select_tile < len ? lo + select_tile : len;
      if (need[g] <= 0) return;
      const std::uint64_t* k = keys + g * len;
      const std::uint64_t pre = prefix[g];
      counter* h = hist + g * select_bins;
      std::uint32_t digit = 0, run = 0;  // a run of equal digits, added at once
      for (std::int64_t j = lo; j < hi; ++j) {
        const std::uint64_t key = k[j];
        if (key == detail::no_key || (above < 64 && key >> above != pre)) continue;
        const auto d = std::uint32_t(key >> shift) & std::uint32_t(select_bins - 1);
        if (run > 0 && d != digit) detail::add_count(h + digit, run), run = 0;
        digit = d, ++run;
      }
      if (run > 0) detail::add_count(h + digit, run);
    });
    launch.for_each(segments, [=] INFKV_HOST_DEVICE(std::int64_t g) {
      if (need[g] <= 0) return;
      counter* h = hist + g * select_bins;
      const auto want = counter(need[g]);
      counter before = 0;  // candidates of smaller digits
      std::int64_t digit = select_bins;
      for (std::int64_t d = 0; d < select_bins; ++d) {
        const counter c = h[d];
        h[d] = 0;
        if (digit < select_bins) continue;
        if (before + c >= want)
          digit = d;
        else
          before += c;
      }
      if (digit == select_bins) {  // fewer candidates than wanted (first pass only): all of them
        bound[g] = detail::no_key, need[g] = 0;
        return;
      }
      const std::uint64_t found = (prefix[g] << select_digit) | std::uint64_t(digit);
      if (shift == 0)
        bound[g] = found + 1, need[g] = 0;
      else
        prefix[g] = found, need[g] = std::int64_t(want - before);
    });
  }
}

template <class L>
void basic_backend<L>::allocate(const adakv& a, score_view s, const std::int64_t* order, const budget& b,
                                std::int64_t cap, std::int64_t* caps, std::span<std::byte> scratch) const {
  a.validate();
  const std::int64_t n = s.cols, rows = s.rows, prot = b.sinks + b.recent, free_each = cap - prot;
  const std::int64_t items = rows * n, total = rows * free_each, sinks = b.sinks, recent = b.recent;
  check_sort_bits(rows, n);
  const int ub = detail::bits_for(rows), rb = detail::bits_for(n);
  status_word* st = checked_status();
  detail::carver c{scratch.data(), 0};
  const auto w = detail::allocate_scratch::carve(c, items, rows);
  std::uint64_t* keys = w.keys;
  std::int64_t *need = w.radix.need, *fl = w.floor;
  detail::counter* wins = w.wins;
  double* share = w.share;
  launch.for_each(items, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t r = x / n, i = x % n;
    const float v = s(r, order[i]);
    if (v != v) detail::record(st, encode(fault::nan_score, r, 0, order[i]));
    const bool candidate = i >= sinks && i < n - recent;
    keys[x] = candidate ? (std::uint64_t(detail::descending_bits(v)) << (ub + rb)) | (std::uint64_t(r) << rb) |
                              std::uint64_t(n - 1 - i)
                        : detail::no_key;
  });
  launch.for_each(rows, [=] INFKV_HOST_DEVICE(std::int64_t r) {
    wins[r] = 0;
    if (r == 0) need[0] = total;
  });
  radix_select(keys, 1, items, 32 + ub + rb, w.radix);
  const std::uint64_t* bound = w.radix.bound;
  const std::int64_t tiles = detail::select_tiles(n);
  launch.for_each(rows * tiles, [=] INFKV_HOST_DEVICE(std::int64_t x) {
    const std::int64_t r = x / tiles, lo = (x % tiles) * detail::select_tile;
    const std::int64_t hi = lo + detail::select_tile < n ? lo + detail::select_tile : n;
    std::uint32_t k = 0;
    for (std::int64_t i = lo; i < hi; ++i) k += keys[r * n + i] < bound[0] ? 1u : 0u;
    if (k > 0) detail::add_count(wins + r, k);
  });
  const double alpha = a.alpha;
  launch.for_each(rows, [=] INFKV_HOST_DEVICE(std::int64_t r) {
    const double won = double(wins[r]), even = double(free_each);
#if defined(__CUDA_ARCH__)  // rounded as the CPU rounds it: no fused multiply-add
    share[r] = __dadd_rn(__dmul_rn(won, 1.0 - alpha), __dmul_rn(alpha, even));
#else
    share[r] = won * (1.0 - alpha) + alpha * even;
#endif
    fl[r] = std::int64_t(floor(share[r] + 1e-9));
  });
  launch.for_each(rows, [=] INFKV_HOST_DEVICE(std::int64_t r) {
    std::int64_t sum = 0, ahead = 0;  // the floors' sum; rows whose remainder goes first
    const double mine = share[r] - double(fl[r]);
    for (std::int64_t q = 0; q < rows; ++q) {
      const double rem = share[q] - double(fl[q]);
      sum += fl[q];
      ahead += rem > mine || (rem == mine && q < r) ? 1 : 0;
    }
    caps[r] = fl[r] + (ahead < total - sum ? 1 : 0) + prot;
  });
}

template <class L>
void basic_backend<L>::keep_top(score_view s, std::span<const token> tokens, const std::int64_t* order,
                                const std::int64_t* caps, std::int64_t cap, const budget& keep, keep_view out,
                                std::span<std::byte> scratch) const {
  const std::int64_t n = out.n_slots, units = out.n_units, sinks = keep.sinks, recent = keep.recent;
  check_sort_bits(units, n);
  const int rb = detail::bits_for(n);
  const std::int64_t parts = select_parts(n);
  std::int64_t* offsets = out.offsets;
  std::int64_t* slots = out.slots;
  if (s.data == nullptr || n == 0) {
    launch.for_each(units + 1, [=] INFKV_HOST_DEVICE(std::int64_t u) { offsets[u] = u * n; });
    launch.for_each(units * n, [=] INFKV_HOST_DEVICE(std::int64_t x) { slots[x] = x % n; });
    return;
  }
  status_word* st = checked_status();
  const token* t = tokens.data();
  detail::carver c{scratch.data(), 0};
  const auto w = detail::select_scratch::carve(c, n, units, parts);
  std::uint32_t* rank = w.rank;
  detail::counter *hist = w.hist, *hist2 = w.hist2;
  const std::int64_t bins = units * detail::top_bins, bins2 = units * detail::top_bins2;
  // Tie rank, newer position first, then the lower slot: the slot at time index i, whose
  // positions' run spans [b, e) of the time order (found by binary search: positions do not
  // decrease along it), ranks (n - e) + (i - b); protected slots are marked instead. The same
  // launch clears the first digit's histograms.
  launch.for_each(std::max(n, bins), [=] INFKV_HOST_DEVICE(std::int64_t i) {
    if (i < bins) hist[i] = 0;
    if (i < bins2) hist2[i] = 0;
    if (i >= n) return;
    const std::int64_t p = t[order[i]].pos;
    std::int64_t b = 0, e = i + 1, hi = i;
    while (b < hi)
      if (const std::int64_t m = (b + hi) / 2; t[order[m]].pos < p)
        b = m + 1;
      else
        hi = m;
    for (hi = n; e < hi;)
      if (const std::int64_t m = (e + hi) / 2; t[order[m]].pos <= p)
        e = m + 1;
      else
        hi = m;
    rank[order[i]] = i < sinks || i >= n - recent ? detail::top_split::guarded_rank : std::uint32_t((n - e) + (i - b));
  });
  // out.slots holds units x cap entries: AdaKV's capacities add up to it (allocate guarantees it).
  const detail::top_split top{s,
                              rank,
                              caps,
                              cap,
                              n,
                              std::min(n, sinks + recent),
                              units * cap,
                              units,
                              select_slice,
                              parts,
                              rb,
                              offsets,
                              slots,
                              st,
                              w,
                              select_buffer,
                              select_threads};
  using ctx = typename L::block_context;
  launch.for_blocks(units * parts, top.threads, top.histogram_shared(),
                    [=] INFKV_HOST_DEVICE(const ctx& x) { top.histogram(x); });
  launch.for_blocks(units * parts, top.threads, top.gather_shared(),
                    [=] INFKV_HOST_DEVICE(const ctx& x) { top.gather(x); });
  launch.for_blocks(units, top.threads, top.finish_shared(), [=] INFKV_HOST_DEVICE(const ctx& x) { top.finish(x); });
  launch.for_blocks(units * parts, top.threads, top.emit_shared(),
                    [=] INFKV_HOST_DEVICE(const ctx& x) { top.emit(x); });
}

template <class L>
void basic_backend<L>::mark(score_view s, const std::int64_t* slots, std::int64_t count) const {
  launch.for_each(count,
                  [=] INFKV_HOST_DEVICE(std::int64_t i) { s(0, slots[i]) = std::numeric_limits<float>::infinity(); });
}

}  // namespace infkv::cuda
