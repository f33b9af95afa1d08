// infkv CUDA backend: the selection steps of basic_backend (steps.hpp declares them, with the
// scoring steps): the radix select that finds AdaKV's threshold over all rows (MSB-first 8-bit
// digit histograms over many blocks), AdaKV's allocation, the per-unit selection (keep_top, its
// blocks in top_split.hpp) and a union's mark. Included at
// the end of steps.hpp.
#pragma once

#include <limits>

#include "block_steps.hpp"
#include "steps.hpp"
#include "top_split.hpp"

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
