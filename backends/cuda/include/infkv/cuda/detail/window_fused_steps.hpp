// infkv CUDA backend: the fused window attention, two block-level steps for f16 / bf16 keys whose
// queries have their type (strided or paged; head_dim a multiple of 16 up to 256, at most 128
// query rows per KV head): tensor cores, nothing of size queries x keys in global memory.
// window_steps.hpp's dispatcher calls window_attention_fused when window_fused_fits.
#pragma once

#include "block_steps.hpp"
#include "window_rows.hpp"

namespace infkv::cuda::detail {

/// The fused window attention's geometry: blocks of `threads` threads, each over `span` keys of
/// one KV head in tiles of `key_tile`; per block in shared memory the KV head's window queries
/// (rows padded to 16 with zeros) and one tile of keys, rows `ldq` elements apart, the tile's
/// logits (rows x key_tile f32, `lds` apart), the mass epilogue's partial sums, and per row its
/// maximum, normaliser's inverse and query position. Rows of 16-bit elements are 8 elements
/// longer than head_dim (16 bytes: WMMA's alignment, and rows land on other banks). Tiles of 16
/// keys: 51 KiB of shared memory at head_dim 128 with 128 rows, four blocks per SM on sm_90 and
/// three on sm_80 (tiles of 32 took 63 KiB: three and two; of 64, 88 KiB: two and one), so
/// blocks' loads overlap other blocks' math; each thread's share of a tile is two 16-byte loads.
struct fused_window {
  static constexpr int threads = 128, key_tile = 16, parts = threads / key_tile;
  static constexpr std::int64_t span = 1024;
  std::int64_t d, per_head, rows;  ///< head_dim, query rows per KV head, those padded to 16
  int ldq, lds;
  static fused_window of(const window_rows& g) {
    const std::int64_t per_head = g.rows / std::max<std::int64_t>(g.hkv, 1);
    return {g.d, per_head, (per_head + 15) / 16 * 16, int(g.d + 8), key_tile + 4};
  }
  // Offsets of the pieces in shared memory, each 128-byte aligned.
  INFKV_HOST_DEVICE std::size_t q_bytes() const { return shared_round(std::size_t(rows * ldq) * 2); }
  INFKV_HOST_DEVICE std::size_t k_bytes() const { return shared_round(std::size_t(key_tile) * ldq * 2); }
  INFKV_HOST_DEVICE std::size_t s_bytes() const { return shared_round(std::size_t(rows * lds) * 4); }
  INFKV_HOST_DEVICE std::size_t p_bytes() const { return shared_round(std::size_t(parts * key_tile) * 4); }
  INFKV_HOST_DEVICE std::size_t r_bytes() const { return shared_round(std::size_t(rows) * 16); }
  INFKV_HOST_DEVICE std::size_t shared_bytes() const {
    return q_bytes() + k_bytes() + s_bytes() + p_bytes() + r_bytes();
  }
  /// Blocks per KV head.
  static std::int64_t chunks(std::int64_t n) { return (n + span - 1) / span; }
};

/// Whether the window attention of `in` takes the fused steps: keys and queries of one 16-bit
/// type, head_dim a multiple of 16 up to 256, at most 128 query rows per KV head, the block's
/// shared memory within block_shared_limit.
template <row_source R>
bool window_fused_fits(const layer_inputs<R>& in, const window_rows& g) {
  const dtype t = in.keys.type;
  if ((t != dtype::f16 && t != dtype::bf16) || in.queries.type != t || g.d % 16 != 0 || g.d > 256 || g.w < 1)
    return false;
  const fused_window f = fused_window::of(g);
  return f.per_head <= fused_window::threads && f.shared_bytes() <= block_shared_limit;
}

/// One block of the fused window attention (T: the keys' and queries' type): KV head h = block /
/// chunks, keys [c span, (c + 1) span) for c = block % chunks.
template <dtype T, row_source R>
struct fused_window_block {
  R keys;
  const_tensor_view q;
  const token* tok;
  const std::int64_t* qpos;
  window_rows g;
  fused_window f;
  std::int64_t chunks;

  template <class Ctx>
  INFKV_HOST_DEVICE std::uint16_t* queries(const Ctx& c) const {
    return reinterpret_cast<std::uint16_t*>(c.shared);
  }
  template <class Ctx>
  INFKV_HOST_DEVICE std::uint16_t* key_rows(const Ctx& c) const {
    return reinterpret_cast<std::uint16_t*>(c.shared + f.q_bytes());
  }
  template <class Ctx>
  INFKV_HOST_DEVICE float* logits(const Ctx& c) const {
    return reinterpret_cast<float*>(c.shared + f.q_bytes() + f.k_bytes());
  }
  template <class Ctx>
  INFKV_HOST_DEVICE float* partial(const Ctx& c) const {
    return reinterpret_cast<float*>(c.shared + f.q_bytes() + f.k_bytes() + f.s_bytes());
  }
  /// Per padded row: its maximum, its normaliser's inverse (floats), its query position (int64).
  template <class Ctx>
  INFKV_HOST_DEVICE float* row_stats(const Ctx& c) const {
    return reinterpret_cast<float*>(c.shared + f.q_bytes() + f.k_bytes() + f.s_bytes() + f.p_bytes());
  }

  /// Copies 8 elements (16 bytes) from `src` to shared `dst`: one vector load when `src` is
  /// aligned, element by element otherwise.
  INFKV_HOST_DEVICE static void copy8(std::uint16_t* dst, const std::uint16_t* src) {
    if (reinterpret_cast<std::uintptr_t>(src) % 16 == 0) {
      copy16(dst, src);
    } else {
      for (int e = 0; e < 8; ++e) dst[e] = src[e];
    }
  }

  /// The KV head's window queries into shared memory (padding rows zero). Row rr = gg w + i is
  /// query head h group + gg at window query i; the next barrier publishes them.
  template <class Ctx>
  INFKV_HOST_DEVICE void load_queries(const Ctx& c, std::int64_t h) const {
    std::uint16_t* qs = queries(c);
    const std::int64_t vecs = f.d / 8;
    for (std::int64_t x = c.thread; x < f.rows * vecs; x += c.threads) {
      const std::int64_t rr = x / vecs, v = x % vecs;
      std::uint16_t* dst = qs + rr * f.ldq + v * 8;
      if (rr < f.per_head) {
        const auto qh = std::int32_t(h * g.group + rr / g.w);
        copy8(dst, static_cast<const std::uint16_t*>(q.row(g.q0 + rr % g.w, qh)) + v * 8);
      } else {
        for (int e = 0; e < 8; ++e) dst[e] = 0;
      }
    }
  }

  /// Keys [j0, j0 + key_tile) of KV head h into shared memory (keys at or past `end` zero),
  /// checked when `check` (a non-finite element recorded as the GEMM path's check records it).
  template <class Ctx>
  INFKV_HOST_DEVICE void load_keys(const Ctx& c, std::int64_t h, std::int64_t j0, std::int64_t end, bool check,
                                   status_word* st) const {
    std::uint16_t* ks = key_rows(c);
    const std::int64_t vecs = f.d / 8;
    for (std::int64_t x = c.thread; x < fused_window::key_tile * vecs; x += c.threads) {
      const std::int64_t jl = x / vecs, v = x % vecs, j = j0 + jl;
      std::uint16_t* dst = ks + jl * f.ldq + v * 8;
      if (j < end) {
        copy8(dst, static_cast<const std::uint16_t*>(keys.row(j, std::int32_t(h))) + v * 8);
        if (check)
          for (int e = 0; e < 8; ++e)
            if (!finite_bits<T>(dst[e])) record(st, encode(fault::key_not_finite, h, v * 8 + e, j));
      } else {
        for (int e = 0; e < 8; ++e) dst[e] = 0;
      }
    }
  }

  /// The tile's logits (unscaled): rows x key_tile, each warp a share of the 16 x 16 tiles.
  template <class Ctx>
  INFKV_HOST_DEVICE void tile_logits(const Ctx& c) const {
    constexpr int col_tiles = fused_window::key_tile / 16;
    const int warps = c.threads / 32, warp = c.thread / 32;
    const std::uint16_t *qs = queries(c), *ks = key_rows(c);
    float* s = logits(c);
    for (std::int64_t t = warp; t < (f.rows / 16) * col_tiles; t += warps) {
      const std::int64_t rt = t / col_tiles, ct = t % col_tiles;
      warp_tile_product<T>(c, qs + rt * 16 * f.ldq, f.ldq, ks + ct * 16 * f.ldq, f.ldq, int(f.d),
                           s + rt * 16 * f.lds + ct * 16, f.lds);
    }
  }

  /// Pass 1: per (query row, block) the running max and normaliser over the block's visible keys,
  /// at tmax / tsum[row chunks + c] (the row's global index h per_head + rr).
  template <class Ctx>
  INFKV_HOST_DEVICE void statistics(const Ctx& c, status_word* st, float* tmax, float* tsum) const {
    const std::int64_t h = c.block / chunks, ch = c.block % chunks;
    const std::int64_t begin = ch * fused_window::span, end = std::min(g.n, begin + fused_window::span);
    load_queries(c, h);
    const std::int64_t rr = c.thread;
    const bool mine = rr < f.per_head;
    const std::int64_t qp = mine ? qpos[g.q0 + rr % g.w] : 0;
    float m = -INFINITY, sum = 0.f;
    for (std::int64_t j0 = begin; j0 < end; j0 += fused_window::key_tile) {
      load_keys(c, h, j0, end, true, st);
      c.sync();
      tile_logits(c);
      c.sync();
      if (mine) {  // the tile's max, then its sum (independent exponentials), merged into the row's
        const float* lr = logits(c) + rr * f.lds;
        const std::int64_t m_tile = std::min<std::int64_t>(fused_window::key_tile, end - j0);
        float tm = -INFINITY, ts = 0.f;
        for (std::int64_t jl = 0; jl < m_tile; ++jl)
          if (tok[j0 + jl].pos <= qp) tm = fmaxf(tm, g.scale * lr[jl]);
        if (tm > -INFINITY) {
          for (std::int64_t jl = 0; jl < m_tile; ++jl)
            if (tok[j0 + jl].pos <= qp) ts += block_expf(c, g.scale * lr[jl] - tm);
          if (tm > m) {
            sum = sum * block_expf(c, m - tm) + ts;
            m = tm;
          } else {
            sum += ts * block_expf(c, tm - m);
          }
        }
      }
      // No barrier needed here: the next tile's keys overwrite none of the logits read above, and
      // its logits wait for the barrier after those keys, which every thread reaches after this.
    }
    if (mine) {
      const std::int64_t r = h * f.per_head + rr;
      tmax[r * chunks + ch] = m, tsum[r * chunks + ch] = sum;
    }
  }

  /// Pass 2: each key's mass, per query head or the group's mean per KV head (key_mass's sum:
  /// exp(logit - rmax) rcoef over the visible rows). The `parts` threads of a key split each query
  /// head's window queries (part p takes queries p, p + parts, ...); a query head's mass adds the
  /// parts in order, after a barrier per query head when those are written (per_query_head), once
  /// per tile for the KV head's mean.
  template <class Ctx>
  INFKV_HOST_DEVICE void mass(const Ctx& c, const float* rmax, const float* rcoef, bool per_query_head,
                              score_view out) const {
    const std::int64_t h = c.block / chunks, ch = c.block % chunks;
    const std::int64_t begin = ch * fused_window::span, end = std::min(g.n, begin + fused_window::span);
    load_queries(c, h);
    float* rs = row_stats(c);
    auto* rp = reinterpret_cast<std::int64_t*>(rs + 2 * f.rows);
    for (std::int64_t rr = c.thread; rr < f.per_head; rr += c.threads) {
      const std::int64_t r = h * f.per_head + rr;
      rs[rr] = rmax[r], rs[f.rows + rr] = rcoef[r], rp[rr] = qpos[g.q0 + rr % g.w];
    }
    const std::int64_t jl = c.thread % fused_window::key_tile, part = c.thread / fused_window::key_tile;
    float* pp = partial(c);
    const auto parts_sum = [&] {
      float total = 0.f;
      for (int p = 0; p < fused_window::parts; ++p) total += pp[p * fused_window::key_tile + jl];
      return total;
    };
    for (std::int64_t j0 = begin; j0 < end; j0 += fused_window::key_tile) {
      load_keys(c, h, j0, end, false, nullptr);
      c.sync();
      tile_logits(c);
      c.sync();
      const std::int64_t j = j0 + jl;
      const bool live = j < end;
      const std::int64_t pos = live ? tok[j].pos : 0;
      const float* s = logits(c);
      float total = 0.f;
      for (std::int64_t gg = 0; gg < g.group; ++gg) {
        float m = 0.f;
        for (std::int64_t i = part; live && i < g.w; i += fused_window::parts) {
          const std::int64_t rr = gg * g.w + i;
          if (pos > rp[rr] || rs[f.rows + rr] == 0.f) continue;
          m += block_expf(c, g.scale * s[rr * f.lds + jl] - rs[rr]) * rs[f.rows + rr];
        }
        total += m;
        if (per_query_head) {
          pp[part * fused_window::key_tile + jl] = m;
          c.sync();
          if (part == 0 && live) out(h * g.group + gg, j) = parts_sum();
          c.sync();
        }
      }
      if (!per_query_head) {
        pp[part * fused_window::key_tile + jl] = total;
        c.sync();
        if (part == 0 && live) out(h, j) = parts_sum() / float(g.group);
      }
      // As in statistics: the next tile writes the logits and partial sums only after a barrier.
    }
  }
};

/// The window attention as two fused block-level steps (window_fused_fits): per KV head and span
/// of keys, the keys read once per pass in tiles through shared memory (16-byte loads where rows
/// are aligned; paged keys through their page table), the logits of the group's query rows by
/// tensor cores into shared memory, never to global memory. Pass 1 keeps each row's running max
/// and normaliser per block (and checks the keys), window_row_statistics combines them, pass 2
/// recomputes the logits and writes each key's mass (the GQA reduction in its epilogue).
template <dtype T, class L, row_source R>
void window_attention_fused(const L& launch, status_word* st, const layer_inputs<R>& in, const window_rows& g,
                            bool per_query_head, score_view out, const softmax_scratch& stats) {
  const fused_window f = fused_window::of(g);
  const std::int64_t chunks = fused_window::chunks(g.n), blocks = g.hkv * chunks;
  float *tmax = stats.tmax, *tsum = stats.tsum;
  const float *rmax = stats.rmax, *rcoef = stats.rcoef;
  const fused_window_block<T, R> b{in.keys, in.queries, in.tokens.data(), in.query_pos.data(), g, f, chunks};
  launch.for_blocks(blocks, fused_window::threads, f.shared_bytes(),
                    [=] INFKV_HOST_DEVICE(const typename L::block_context& c) { b.statistics(c, st, tmax, tsum); });
  window_row_statistics(launch, st, in.queries, g, stats, chunks);
  launch.for_blocks(
      blocks, fused_window::threads, f.shared_bytes(),
      [=] INFKV_HOST_DEVICE(const typename L::block_context& c) { b.mass(c, rmax, rcoef, per_query_head, out); });
}

}  // namespace infkv::cuda::detail
