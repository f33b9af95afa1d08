// infkv CUDA backend: the selection steps of basic_backend (steps.hpp declares them, with the
// scoring steps): the radix select that finds AdaKV's threshold over all rows (MSB-first 8-bit
// digit histograms over many blocks), AdaKV's allocation, the per-unit selection (a block per unit
// that finds its threshold and emits its kept slots: top_blocks) and a union's mark. Included at
// the end of steps.hpp.
#pragma once

#include <limits>

#include "block_steps.hpp"
#include "steps.hpp"

namespace infkv::cuda::detail {

/// keep_top's selection, a block per unit u: the unit keeps its protected slots and the `need`
/// candidates of smallest key, key(j) = descending score bits << 32 | tie rank << (32 - rank
/// bits) (unique per slot: the rank is), and writes them in slot order at its offset. Radix select
/// MSB-first with 8-bit digits over the keys formed on the fly from the score row and the rank
/// (no key array): per pass a histogram in shared memory of the digit of the candidates that share
/// the digits found so far, then thread 0 finds the digit holding the wanted rank; it stops as
/// soon as that digit's candidates are exactly the ones still wanted (distinct scores: within the
/// four score digits). Once the candidates that share the found digits fit in shared memory
/// (`buffer` keys), the pass that reads them from global memory also copies them there and the
/// later passes read only those. The emission reads the row again in tiles of threads x per
/// slots: each thread counts its `per` slots, thread 0 scans the counts, each thread writes its
/// kept slots.
struct top_blocks {
  static constexpr int per = 16, bins = 256;
  static constexpr std::uint32_t guarded_rank = ~std::uint32_t{0};  ///< a protected slot's rank
  score_view s;
  const std::uint32_t* rank;  ///< per slot, guarded_rank when protected
  const std::int64_t* caps;   ///< per unit, or null: `cap` each
  std::int64_t cap, n, guarded, room, units;
  int rb;
  std::int64_t *offsets, *slots;
  status_word* st;
  std::int64_t buffer;  ///< candidate keys the block can hold in shared memory
  int threads;          ///< the block's threads

  /// Shared memory: the histogram, the tile's counts, the state, the candidate buffer.
  std::size_t shared_bytes() const {
    return shared_round(bins * 4) + shared_round(std::size_t(threads) * 8) + shared_round(sizeof(state)) +
           shared_round(std::size_t(buffer) * 8);
  }

  struct state {
    std::uint64_t prefix, bound;  ///< the digits found so far; the exclusive bound once done
    std::int64_t want, candidates, fill;
    int done, buffered;
  };

  INFKV_HOST_DEVICE std::uint64_t key(std::int64_t u, std::int64_t j) const {
    const std::uint32_t r = rank[j];
    if (r == guarded_rank) return no_key;
    return (std::uint64_t(descending_bits(s(u, j))) << 32) | (std::uint64_t(r) << (32 - rb));
  }

  /// Slots unit u keeps: the protected ones and min(need, candidates) others.
  INFKV_HOST_DEVICE std::int64_t kept_count(std::int64_t u) const {
    const std::int64_t want = caps ? caps[u] : cap, m = want < n ? want : n;
    return m > guarded ? m : guarded;
  }

  template <class Ctx>
  INFKV_HOST_DEVICE void operator()(const Ctx& c) const {
    const std::int64_t u = c.block;
    auto* hist = reinterpret_cast<std::uint32_t*>(c.shared);
    auto* counts = reinterpret_cast<std::int64_t*>(c.shared + shared_round(bins * 4));
    auto* z = reinterpret_cast<state*>(c.shared + shared_round(bins * 4) + shared_round(std::size_t(threads) * 8));
    auto* held = reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::byte*>(z) + shared_round(sizeof(state)));
    std::int64_t base = 0;  // thread 0's: the slots the units before u keep, then its running offset
    if (c.thread == 0) {
      const std::int64_t want = caps ? caps[u] : cap;
      z->want = (want < n ? want : n) - guarded, z->candidates = n - guarded;
      z->prefix = 0, z->bound = 0, z->fill = 0, z->buffered = 0, z->done = z->want <= 0 ? 1 : 0;
      for (std::int64_t v = 0; v < u; ++v) base += kept_count(v);
      offsets[u] = base;
      if (u == units - 1) offsets[units] = base + kept_count(u);
    }
    const auto check = [&](std::int64_t j) {  // every score is checked, kept or not
      if (const float v = s(u, j); v != v) record(st, encode(fault::nan_score, u, 0, j));
    };
    c.sync();
    if (z->done)  // no pass reads the row: check it here
      for (std::int64_t j = c.thread; j < n; j += c.threads) check(j);
    for (int shift = 56; !z->done; shift -= 8) {
      for (int b = c.thread; b < bins; b += c.threads) hist[b] = 0;
      c.sync();
      const int above = shift + 8;
      const std::uint64_t pre = z->prefix;
      const bool from_buffer = z->buffered != 0, gather = !from_buffer && z->candidates <= buffer;
      const auto count = [&](std::uint64_t k) {
        if (k == no_key || (above < 64 && k >> above != pre)) return false;
        shared_add(hist + (std::uint32_t(k >> shift) & std::uint32_t(bins - 1)), 1);
        return true;
      };
      if (from_buffer) {
        for (std::int64_t x = c.thread; x < z->fill; x += c.threads) count(held[x]);
      } else {
        for (std::int64_t j = c.thread; j < n; j += c.threads) {
          if (shift == 56) check(j);
          const std::uint64_t k = key(u, j);
          if (count(k) && gather) {
#if defined(__CUDA_ARCH__)
            held[atomicAdd(reinterpret_cast<unsigned long long*>(&z->fill), 1ull)] = k;
#else
            held[z->fill++] = k;
#endif
          }
        }
      }
      c.sync();
      if (c.thread == 0) {
        std::int64_t before = 0, digit = bins;  // candidates of smaller digits; the digit found
        for (std::int64_t d = 0; d < bins && digit == bins; ++d)
          if (before + std::int64_t(hist[d]) >= z->want)
            digit = d;
          else
            before += hist[d];
        if (digit == bins) {  // fewer candidates than wanted (first pass only): all of them
          z->bound = no_key, z->done = 1;
        } else {
          const std::uint64_t found = (above < 64 ? pre << 8 : 0) | std::uint64_t(digit);
          const std::int64_t in_digit = hist[digit];
          if (const std::uint64_t next = found + 1; before + in_digit == z->want || shift == 0) {
            // exactly the ones wanted (or the last digit); a first digit of 255 bounds nothing
            z->bound = shift == 0 ? next : next >> (64 - shift) != 0 ? no_key : next << shift;
            z->done = 1;
          } else {
            z->prefix = found, z->want -= before, z->candidates = in_digit;
          }
          z->buffered = z->buffered || gather ? 1 : 0;
        }
      }
      c.sync();
    }
    // Emission in slot order: per tile, each thread counts its slots, thread 0 turns the counts
    // into offsets (its running base carried across tiles), each thread writes its kept slots.
    const std::uint64_t bound = z->bound;
    const auto kept = [&](std::int64_t j) { return rank[j] == guarded_rank || key(u, j) < bound; };
    const std::int64_t tile = std::int64_t(c.threads) * per;
    for (std::int64_t t0 = 0; t0 < n; t0 += tile) {
      const std::int64_t lo = t0 + std::int64_t(c.thread) * per, hi = lo + per < n ? lo + per : n;
      std::int64_t mine = 0;
      for (std::int64_t j = lo; j < hi; ++j) mine += kept(j) ? 1 : 0;
      counts[c.thread] = mine;
      c.sync();
      if (c.thread == 0)
        for (int t = 0; t < c.threads; ++t) {
          const std::int64_t k = counts[t];
          counts[t] = base, base += k;
        }
      c.sync();
      std::int64_t at = counts[c.thread];
      for (std::int64_t j = lo; j < hi; ++j)
        if (kept(j)) {
          if (at < room) slots[at] = j;
          ++at;
        }
      c.sync();  // the next tile's counts overwrite these
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
  const auto w = detail::select_scratch::carve(c, n);
  std::uint32_t* rank = w.rank;
  // Tie rank, newer position first, then the lower slot: the slot at time index i, whose
  // positions' run spans [b, e) of the time order (found by binary search: positions do not
  // decrease along it), ranks (n - e) + (i - b); protected slots are marked instead.
  launch.for_each(n, [=] INFKV_HOST_DEVICE(std::int64_t i) {
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
    rank[order[i]] = i < sinks || i >= n - recent ? detail::top_blocks::guarded_rank : std::uint32_t((n - e) + (i - b));
  });
  // out.slots holds units x cap entries: AdaKV's capacities add up to it (allocate guarantees it).
  const detail::top_blocks top{
      s,     rank, caps,          cap,           n, std::min(n, sinks + recent), units * cap, units, rb, offsets,
      slots, st,   select_buffer, select_threads};
  launch.for_blocks(units, top.threads, top.shared_bytes(),
                    [=] INFKV_HOST_DEVICE(const typename L::block_context& ctx) { top(ctx); });
}

template <class L>
void basic_backend<L>::mark(score_view s, const std::int64_t* slots, std::int64_t count) const {
  launch.for_each(count,
                  [=] INFKV_HOST_DEVICE(std::int64_t i) { s(0, slots[i]) = std::numeric_limits<float>::infinity(); });
}

}  // namespace infkv::cuda
