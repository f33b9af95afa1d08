// Test support for the CPU backend: random layer inputs, caches stored in every layout the
// library reads (NHD, HND, padded strides, paged), and naive double-precision references of
// every policy's scores, written as plain loops straight from the formulas in docs/design.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

namespace infkv_test {

using infkv::dtype;
using infkv::token;

/// Row-major double matrix: one row per decision unit, one column per slot.
using ref_matrix = std::vector<std::vector<double>>;

/// What an element of type `t` holds after storing `x`.
inline float round_to(dtype t, float x) {
  if (t == dtype::f16) return infkv::f16_to_f32(infkv::f32_to_f16(x));
  if (t == dtype::bf16) return infkv::bf16_to_f32(infkv::f32_to_bf16(x));
  return x;
}

/// One layer's inputs: keys [n][hkv][d], queries [nq][hq][d] (values as stored, i.e. rounded to
/// `type`; `*_exact` before rounding), shuffled slots, positions with holes, segments of 10.
struct problem {
  std::int64_t n = 0, nq = 0;
  std::int32_t hkv = 0, hq = 0, d = 0;
  dtype type = dtype::f32;
  std::vector<float> k, q, k_exact, q_exact;
  std::vector<token> tokens;
  std::vector<std::int64_t> qpos;
  double scale = 0;  ///< 1 / sqrt(d), what scale = 0 means
};

inline problem make_problem(std::uint64_t seed, std::int64_t n, std::int32_t hkv, std::int32_t group, std::int32_t d,
                            std::int64_t nq, dtype type = dtype::f32, bool shuffle = true) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  problem p;
  p.n = n, p.nq = nq, p.hkv = hkv, p.hq = hkv * group, p.d = d, p.type = type;
  p.scale = 1.0 / std::sqrt(double(d));
  p.k_exact.resize(std::size_t(n * hkv * d));
  p.q_exact.resize(std::size_t(nq * p.hq * d));
  for (auto& x : p.k_exact) x = normal(gen);
  for (auto& x : p.q_exact) x = 1.5f * normal(gen);
  for (float x : p.k_exact) p.k.push_back(round_to(type, x));
  for (float x : p.q_exact) p.q.push_back(round_to(type, x));
  std::vector<std::int64_t> slot_of(static_cast<std::size_t>(n));  // time rank -> slot
  std::iota(slot_of.begin(), slot_of.end(), std::int64_t{0});
  if (shuffle) std::shuffle(slot_of.begin(), slot_of.end(), gen);
  p.tokens.resize(std::size_t(n));
  for (std::int64_t i = 0; i < n; ++i)
    p.tokens[std::size_t(slot_of[std::size_t(i)])] = {i + i / 7, std::int32_t(i / 10), infkv::modality::text};
  const std::int64_t last = n - 1 + (n - 1) / 7, step = std::max<std::int64_t>(1, n / (2 * nq));
  for (std::int64_t i = 0; i < nq; ++i) p.qpos.push_back(last - (nq - 1 - i) * step);
  return p;
}

/// How a tensor is laid out in memory.
enum class layout { nhd, hnd, strided, paged };

inline const char* to_string(layout l) {
  switch (l) {
    case layout::nhd: return "nhd";
    case layout::hnd: return "hnd";
    case layout::strided: return "strided";
    case layout::paged: return "paged";
  }
  return "?";
}

/// A tensor [n][heads][d] stored in one layout. Padding and unused pages hold NaN, so a view
/// that reads outside its rows poisons the result. Move-only: the views point into the buffers.
struct stored {
  layout kind = layout::nhd;
  std::vector<std::uint8_t> bytes;
  infkv::tensor_view tensor{};
  std::vector<std::int32_t> indptr, indices, last;
  infkv::paged_view paged{};

  stored() = default;
  stored(const stored&) = delete;
  stored(stored&&) = default;
  stored& operator=(stored&&) = default;

  /// Calls f with the row source (`tensor_view`, or sequence 1's `paged_rows`).
  template <class F>
  auto visit(F&& f) const {
    return kind == layout::paged ? f(infkv::key_rows(paged, 1)) : f(tensor);
  }
};

inline void put(dtype t, float x, void* dst) { infkv::from_f32(t, &x, dst, 1); }

inline void fill_nan(stored& s, dtype t) {
  const std::size_t es = infkv::size_of(t);
  for (std::size_t i = 0; i + es <= s.bytes.size(); i += es)
    put(t, std::numeric_limits<float>::quiet_NaN(), &s.bytes[i]);
}

/// Stores x ([n][heads][d], row-major) as type t in layout l. HND gets 3 spare slots per head;
/// `strided` pads 3 elements after every head and 5 after every slot; `paged` uses pages of 6
/// slots (not dividing n in the tests), page ids out of order, behind a 2-page decoy sequence.
inline stored store(const std::vector<float>& x, std::int64_t n, std::int32_t heads, std::int32_t d, dtype t,
                    layout l) {
  stored s;
  s.kind = l;
  const auto es = std::int64_t(infkv::size_of(t));
  auto at = [&](std::int64_t slot, std::int32_t h) { return x.data() + (slot * heads + h) * d; };
  if (l != layout::paged) {
    infkv::tensor_view v{};
    if (l == layout::nhd) v = infkv::nhd(static_cast<void*>(nullptr), t, n, heads, d);
    if (l == layout::hnd) v = infkv::hnd(static_cast<void*>(nullptr), t, n, heads, d, n + 3);
    if (l == layout::strided) v = {nullptr, t, n, heads, d, std::int64_t(heads) * (d + 3) + 5, d + 3};
    const std::int64_t elems =
        l == layout::hnd ? std::int64_t(heads) * (n + 3) * d : std::max<std::int64_t>(1, n) * v.slot_stride;
    s.bytes.resize(std::size_t(elems * es));
    fill_nan(s, t);
    v.data = s.bytes.data();
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int32_t h = 0; h < heads; ++h) infkv::from_f32(t, at(j, h), v.row(j, h), d);
    s.tensor = v;
    return s;
  }
  const std::int32_t page = 6;
  const auto pages = std::int32_t((n + page - 1) / page), total = pages + 2 + 3;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(total));
  std::iota(ids.begin(), ids.end(), 0);
  std::reverse(ids.begin(), ids.end());                  // descending page ids ...
  std::rotate(ids.begin(), ids.begin() + 3, ids.end());  // ... with a wrap: not sequential
  s.indptr = {0, 2, 2 + pages};
  s.indices.assign(ids.begin(), ids.begin() + 2 + pages);
  s.last = {page, n == 0 ? 0 : std::int32_t(n - std::int64_t(pages - 1) * page)};
  const std::int64_t slot_stride = std::int64_t(heads) * d + 2, page_stride = page * slot_stride + 7;
  s.bytes.resize(std::size_t(total * page_stride * es));
  fill_nan(s, t);
  infkv::paged_view& p = s.paged;
  p.k = {s.bytes.data(), page_stride, slot_stride, d};
  p.type = t, p.n_heads = heads, p.head_dim = d, p.page_size = page, p.n_seqs = 2, p.n_pages = total;
  p.indptr = s.indptr.data(), p.indices = s.indices.data(), p.last_page_len = s.last.data();
  const auto decoy = infkv::key_rows(p, 0);  // the decoy sequence holds large finite values
  std::vector<float> big(static_cast<std::size_t>(d), 1e3f);
  for (std::int64_t j = 0; j < decoy.n_slots; ++j)
    for (std::int32_t h = 0; h < heads; ++h) infkv::from_f32(t, big.data(), decoy.row(j, h), d);
  const auto rows = infkv::key_rows(p, 1);
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int32_t h = 0; h < heads; ++h) infkv::from_f32(t, at(j, h), rows.row(j, h), d);
  return s;
}

/// Queries of a problem stored NHD in its type.
inline stored store_queries(const problem& p) { return store(p.q, p.nq, p.hq, p.d, p.type, layout::nhd); }

/// One problem's layer: keys stored NHD, queries NHD, both in the problem's type.
struct layer {
  problem p;
  stored keys, queries;
  explicit layer(problem q)
      : p(std::move(q)), keys(store(p.k, p.n, p.hkv, p.d, p.type, layout::nhd)), queries(store_queries(p)) {}
  infkv::layer_inputs<> in() const { return {keys.tensor, {}, queries.tensor, p.qpos, p.tokens, 0.f}; }
};

/// Slots in time order: by position, then slot.
inline std::vector<std::int64_t> ref_time_order(std::span<const token> tokens) {
  std::vector<std::int64_t> o(tokens.size());
  std::iota(o.begin(), o.end(), std::int64_t{0});
  std::sort(o.begin(), o.end(), [&](std::int64_t a, std::int64_t b) {
    const auto pa = tokens[std::size_t(a)].pos, pb = tokens[std::size_t(b)].pos;
    return pa != pb ? pa < pb : a < b;
  });
  return o;
}

/// Softmax probabilities of query i (head hq) over the keys it sees (zero elsewhere).
inline std::vector<double> ref_probs(const problem& p, std::int64_t i, std::int32_t hq) {
  const std::int32_t h = hq / (p.hq / p.hkv);
  std::vector<double> logit(static_cast<std::size_t>(p.n), -std::numeric_limits<double>::infinity());
  double mx = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < p.n; ++j) {
    if (p.tokens[std::size_t(j)].pos > p.qpos[std::size_t(i)]) continue;
    double dot = 0;
    for (std::int32_t e = 0; e < p.d; ++e)
      dot += double(p.q[std::size_t((i * p.hq + hq) * p.d + e)]) * double(p.k[std::size_t((j * p.hkv + h) * p.d + e)]);
    logit[std::size_t(j)] = dot * p.scale;
    mx = std::max(mx, logit[std::size_t(j)]);
  }
  std::vector<double> prob(static_cast<std::size_t>(p.n), 0.0);
  if (mx == -std::numeric_limits<double>::infinity()) return prob;
  double sum = 0;
  for (std::int64_t j = 0; j < p.n; ++j) sum += prob[std::size_t(j)] = std::exp(logit[std::size_t(j)] - mx);
  for (auto& v : prob) v /= sum;
  return prob;
}

/// Window attention mass: per KV head, sum over queries [first, nq) of the probabilities, mean
/// over the head's G query heads.
inline ref_matrix ref_window_mass(const problem& p, std::int64_t first = 0) {
  const std::int32_t g = p.hq / p.hkv;
  ref_matrix out(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
  for (std::int32_t hq = 0; hq < p.hq; ++hq)
    for (std::int64_t i = first; i < p.nq; ++i) {
      const auto pr = ref_probs(p, i, hq);
      for (std::int64_t j = 0; j < p.n; ++j) out[std::size_t(hq / g)][std::size_t(j)] += pr[std::size_t(j)] / g;
    }
  return out;
}

/// `v` (values in time order) with its first `prefix` values pooled along time over `kernel`
/// neighbours: avg_pool1d (padding kernel / 2 zeros, counted), max_pool1d, or a plain local sum.
inline std::vector<double> ref_pool(const std::vector<double>& v, std::int64_t prefix, std::int32_t kernel,
                                    infkv::pooling kind) {
  std::vector<double> out = v;
  for (std::int64_t t = 0; t < prefix; ++t) {
    double acc = kind == infkv::pooling::max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (std::int64_t u = t - kernel / 2; u <= t + kernel / 2; ++u) {
      if (u < 0 || u >= prefix) continue;  // padding: a zero (avg, sum) or nothing (max)
      acc = kind == infkv::pooling::max ? std::max(acc, v[std::size_t(u)]) : acc + v[std::size_t(u)];
    }
    out[std::size_t(t)] = kind == infkv::pooling::avg ? acc / kernel : acc;
  }
  return out;
}

/// SnapKV's scores as its reference code and kvpress's SnapKVPress compute them, for slots in
/// any order: per query head, the attention mass the last `window` queries give each key; the keys
/// of the observation window (the last `window` in time order) are cut off (`attn[..., :-window]`);
/// the rest is pooled along time per query head (avg_pool1d: padding kernel / 2 zeros, counted;
/// max_pool1d; or a plain local sum), then the G query heads of each KV head are averaged; the
/// window's slots, protected anyway, get the mean score of the rest of their row (kvpress pads
/// them with the maximum, to protect them; infkv protects them by position and keeps the row's
/// mean, which the attention bias divides by, that of the pooled slots).
/// `vnorm` (one row per KV head): the mass of each key times its value norm before pooling.
inline ref_matrix ref_window_pooled(const problem& p, std::int64_t window, std::int32_t kernel, infkv::pooling kind,
                                    const ref_matrix* vnorm = nullptr) {
  const std::int32_t g = p.hq / p.hkv;
  const std::int64_t first = std::max<std::int64_t>(0, p.nq - window);
  const auto o = ref_time_order(p.tokens);
  const auto n = std::int64_t(o.size()), prefix = n - std::min(window, n);
  const bool pooled = kind != infkv::pooling::none && kernel > 1 && prefix > 0;
  ref_matrix out(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
  for (std::int32_t hq = 0; hq < p.hq; ++hq) {
    std::vector<double> mass(std::size_t(p.n), 0.0);  // in time order
    for (std::int64_t i = first; i < p.nq; ++i) {
      const auto pr = ref_probs(p, i, hq);
      for (std::int64_t t = 0; t < n; ++t) mass[std::size_t(t)] += pr[std::size_t(o[std::size_t(t)])];
    }
    if (vnorm)
      for (std::int64_t t = 0; t < n; ++t)
        mass[std::size_t(t)] *= (*vnorm)[std::size_t(hq / g)][std::size_t(o[std::size_t(t)])];
    const std::vector<double> head = pooled ? ref_pool(mass, prefix, kernel, kind) : mass;
    for (std::int64_t t = 0; t < n; ++t)
      out[std::size_t(hq / g)][std::size_t(o[std::size_t(t)])] += head[std::size_t(t)] / g;
  }
  if (pooled)
    for (auto& row : out) {
      double sum = 0;
      for (std::int64_t t = 0; t < prefix; ++t) sum += row[std::size_t(o[std::size_t(t)])];
      for (std::int64_t t = prefix; t < n; ++t) row[std::size_t(o[std::size_t(t)])] = sum / double(prefix);
    }
  return out;
}

/// Attention bias: each row divided by its mean, plus beta * f(age), age over positions,
/// segments or ranks (distinct positions) scaled to [0, 1] (0 = newest), f linear (1 - a) or
/// normalised exponential.
inline void ref_bias(ref_matrix& s, std::span<const token> tokens, const infkv::attention_bias& b) {
  if (b.beta == 0.0) return;
  std::set<std::int64_t> distinct;  // ranks: how many distinct cached positions are older
  for (const auto& t : tokens) distinct.insert(t.pos);
  auto age_of = [&](const token& t) {
    if (b.unit == infkv::age_unit::ranks) return double(std::distance(distinct.begin(), distinct.find(t.pos)));
    return b.unit == infkv::age_unit::positions ? double(t.pos) : double(t.segment);
  };
  double newest = -1e300, oldest = 1e300;
  for (const auto& t : tokens) newest = std::max(newest, age_of(t)), oldest = std::min(oldest, age_of(t));
  for (auto& row : s) {
    double mean = 0;
    for (double v : row) mean += v / double(row.size());
    for (std::size_t j = 0; j < row.size(); ++j) {
      const double a = newest > oldest ? (newest - age_of(tokens[j])) / (newest - oldest) : 0.0;
      const double f = b.shape == infkv::decay::linear
                           ? 1.0 - a
                           : (std::exp(-b.rate * a) - std::exp(-b.rate)) / (1.0 - std::exp(-b.rate));
      row[j] = (mean > 0 ? row[j] / mean : row[j]) + b.beta * f;
    }
  }
}

inline ref_matrix ref_snapkv(const problem& p, const infkv::snapkv& c) {
  return ref_window_pooled(p, c.window, c.kernel, c.pool);
}

inline ref_matrix ref_inf_mllm(const problem& p, const infkv::inf_mllm& c, const ref_matrix* vnorm = nullptr) {
  auto s = ref_window_pooled(p, c.window, c.kernel, c.pool, vnorm);
  ref_bias(s, p.tokens, c.bias);
  return s;
}

/// TOVA: probabilities of the last query, mean over every query head of the layer.
inline ref_matrix ref_tova(const problem& p) {
  ref_matrix out(1, std::vector<double>(std::size_t(p.n), 0.0));
  for (std::int32_t hq = 0; hq < p.hq; ++hq) {
    const auto pr = ref_probs(p, p.nq - 1, hq);
    for (std::int64_t j = 0; j < p.n; ++j) out[0][std::size_t(j)] += pr[std::size_t(j)] / p.hq;
  }
  return out;
}

/// KeyDiff: -cos(k_j, mean of the unit keys) per KV head.
inline ref_matrix ref_keydiff(const problem& p) {
  ref_matrix out(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
  auto key = [&](std::int64_t j, std::int32_t h, std::int32_t e) {
    return double(p.k[std::size_t((j * p.hkv + h) * p.d + e)]);
  };
  auto norm = [&](std::int64_t j, std::int32_t h) {
    double s = 0;
    for (std::int32_t e = 0; e < p.d; ++e) s += key(j, h, e) * key(j, h, e);
    return std::sqrt(s);
  };
  for (std::int32_t h = 0; h < p.hkv; ++h) {
    std::vector<double> anchor(std::size_t(p.d), 0.0);
    for (std::int64_t j = 0; j < p.n; ++j)
      for (std::int32_t e = 0; e < p.d; ++e) anchor[std::size_t(e)] += key(j, h, e) / norm(j, h) / double(p.n);
    double an = 0;
    for (double a : anchor) an += a * a;
    for (std::int64_t j = 0; j < p.n; ++j) {
      double dot = 0;
      for (std::int32_t e = 0; e < p.d; ++e) dot += key(j, h, e) * anchor[std::size_t(e)];
      out[std::size_t(h)][std::size_t(j)] = -dot / (norm(j, h) * std::sqrt(an));
    }
  }
  return out;
}

/// H2O after the steps (each a problem over the same keys and tokens with its own queries):
/// acc = forgetting * acc + step mass; with lifetime, divided by max(1, queries that saw the slot).
inline ref_matrix ref_h2o(std::span<const problem> steps, const infkv::h2o& c) {
  const problem& p0 = steps[0];
  ref_matrix acc(std::size_t(p0.hkv), std::vector<double>(std::size_t(p0.n), 0.0));
  std::vector<double> life(std::size_t(p0.n), 0.0);
  for (const auto& st : steps) {
    const auto m = ref_window_mass(st);
    for (std::size_t h = 0; h < acc.size(); ++h)
      for (std::size_t j = 0; j < acc[h].size(); ++j) acc[h][j] = acc[h][j] * c.forgetting + m[h][j];
    for (std::size_t j = 0; j < life.size(); ++j)
      for (auto qp : st.qpos) life[j] += st.tokens[j].pos <= qp ? 1.0 : 0.0;
  }
  if (c.normalize_lifetime)
    for (auto& row : acc)
      for (std::size_t j = 0; j < row.size(); ++j) row[j] /= std::max(1.0, life[j]);
  return acc;
}

/// StreamingLLM: the time rank of each slot, one row.
inline ref_matrix ref_streaming_llm(const problem& p) {
  ref_matrix out(1, std::vector<double>(std::size_t(p.n), 0.0));
  const auto o = ref_time_order(p.tokens);
  for (std::size_t i = 0; i < o.size(); ++i) out[0][std::size_t(o[i])] = double(i);
  return out;
}

/// A d x d double matrix, row-major.
using ref_square = std::vector<double>;

/// The RoPE rotation by angle pos * frequency as a d x d matrix (pairs of `r`; other dimensions
/// pass through), built element by element from the definition.
inline ref_square ref_rotation(const infkv::rope& r, std::int32_t d, double pos) {
  const std::int32_t dims = r.dims == 0 ? d : r.dims, half = dims / 2;
  ref_square m(std::size_t(d * d), 0.0);
  for (std::int32_t e = 0; e < d; ++e) m[std::size_t(e * d + e)] = 1.0;
  for (std::int32_t i = 0; i < half; ++i) {
    const std::int32_t a = r.style == infkv::rope_style::normal ? 2 * i : i;
    const std::int32_t b = r.style == infkv::rope_style::normal ? 2 * i + 1 : i + half;
    const double ang = pos * r.freq_scale * std::pow(r.theta, -2.0 * i / dims);
    m[std::size_t(a * d + a)] = std::cos(ang), m[std::size_t(a * d + b)] = -std::sin(ang);
    m[std::size_t(b * d + a)] = std::sin(ang), m[std::size_t(b * d + b)] = std::cos(ang);
  }
  return m;
}

/// Expected Attention as kvpress's ExpectedAttentionPress computes it, in matrices: queries
/// turned back to before RoPE (R(-p) q), their mean mu and covariance Sigma (divided by the
/// count), R = the mean of the rotation matrices over the next `future` positions, mu' = R mu,
/// Sigma' = R Sigma R', z_j = s mu'.k_j + s^2 / 2 k_j' Sigma' k_j, a softmax over the keys
/// without the first `sinks` in time order (they get 1), the mean over the query group, then
/// times |v_j| when `vnorm` (one row per KV head, n entries each) is given.
inline ref_matrix ref_expected(const problem& p, const infkv::expected_attention& c,
                               const ref_matrix* vnorm = nullptr) {
  const std::int32_t d = p.d, g = p.hq / p.hkv;
  const std::int64_t first = std::max<std::int64_t>(0, p.nq - c.window), m = p.nq - first;
  const infkv::rope r = c.rotary.value_or(infkv::rope{});
  const bool rotated = c.rotary.has_value();
  std::int64_t t0 = 0;
  for (std::int64_t i = first; i < p.nq; ++i) t0 = std::max(t0, p.qpos[std::size_t(i)] + 1);
  ref_square avg(std::size_t(d * d), 0.0);
  for (std::int64_t t = t0; t < t0 + c.future; ++t) {
    const auto rt = rotated ? ref_rotation(r, d, double(t)) : ref_rotation(r, d, 0.0);
    for (std::size_t x = 0; x < avg.size(); ++x) avg[x] += rt[x] / double(c.future);
  }
  const auto o = ref_time_order(p.tokens);
  const std::int64_t sinks = std::min<std::int64_t>(c.sinks, p.n);
  std::vector<bool> sink(std::size_t(p.n), false);
  for (std::int64_t i = 0; i < sinks; ++i) sink[std::size_t(o[std::size_t(i)])] = true;
  ref_matrix out(std::size_t(p.hkv), std::vector<double>(std::size_t(p.n), 0.0));
  for (std::int32_t hq = 0; hq < p.hq; ++hq) {
    std::vector<std::vector<double>> x;
    for (std::int64_t i = first; i < p.nq; ++i) {
      const auto back = ref_rotation(r, d, rotated ? -double(p.qpos[std::size_t(i)]) : 0.0);
      std::vector<double> v(std::size_t(d), 0.0);
      for (std::int32_t a = 0; a < d; ++a)
        for (std::int32_t b = 0; b < d; ++b)
          v[std::size_t(a)] += back[std::size_t(a * d + b)] * double(p.q[std::size_t((i * p.hq + hq) * d + b)]);
      x.push_back(v);
    }
    std::vector<double> mu(std::size_t(d), 0.0);
    for (const auto& v : x)
      for (std::int32_t a = 0; a < d; ++a) mu[std::size_t(a)] += v[std::size_t(a)] / double(m);
    ref_square sigma(std::size_t(d * d), 0.0);
    for (const auto& v : x)
      for (std::int32_t a = 0; a < d; ++a)
        for (std::int32_t b = 0; b < d; ++b)
          sigma[std::size_t(a * d + b)] +=
              (v[std::size_t(a)] - mu[std::size_t(a)]) * (v[std::size_t(b)] - mu[std::size_t(b)]) / double(m);
    std::vector<double> mu2(std::size_t(d), 0.0);
    ref_square tmp(std::size_t(d * d), 0.0), sigma2(std::size_t(d * d), 0.0);
    for (std::int32_t a = 0; a < d; ++a)
      for (std::int32_t b = 0; b < d; ++b) {
        mu2[std::size_t(a)] += avg[std::size_t(a * d + b)] * mu[std::size_t(b)];
        for (std::int32_t k = 0; k < d; ++k)
          tmp[std::size_t(a * d + b)] += avg[std::size_t(a * d + k)] * sigma[std::size_t(k * d + b)];
      }
    for (std::int32_t a = 0; a < d; ++a)
      for (std::int32_t b = 0; b < d; ++b)
        for (std::int32_t k = 0; k < d; ++k)
          sigma2[std::size_t(a * d + b)] += tmp[std::size_t(a * d + k)] * avg[std::size_t(b * d + k)];
    std::vector<double> z(std::size_t(p.n), 0.0);
    double mx = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < p.n; ++j) {
      const float* k = p.k.data() + (j * p.hkv + hq / g) * d;
      double lin = 0, quad = 0;
      for (std::int32_t a = 0; a < d; ++a) {
        lin += mu2[std::size_t(a)] * double(k[a]);
        for (std::int32_t b = 0; b < d; ++b) quad += double(k[a]) * sigma2[std::size_t(a * d + b)] * double(k[b]);
      }
      z[std::size_t(j)] = p.scale * lin + (c.covariance ? p.scale * p.scale * quad / 2 : 0.0);
      if (!sink[std::size_t(j)]) mx = std::max(mx, z[std::size_t(j)]);
    }
    double sum = 0;
    for (std::int64_t j = 0; j < p.n; ++j)
      if (!sink[std::size_t(j)]) sum += std::exp(z[std::size_t(j)] - mx);
    for (std::int64_t j = 0; j < p.n; ++j)
      out[std::size_t(hq / g)][std::size_t(j)] +=
          sink[std::size_t(j)] ? 1.0 / g : std::exp(z[std::size_t(j)] - mx) / sum / g;
  }
  if (vnorm)
    for (std::size_t h = 0; h < out.size(); ++h)
      for (std::size_t j = 0; j < out[h].size(); ++j) out[h][j] *= (*vnorm)[h][j];
  return out;
}

/// The reference scores of any registered policy on problem p (H2O: the one step that the
/// registry's state observed, p's own queries).
inline ref_matrix ref_scores(const problem& p, const infkv::streaming_llm&) { return ref_streaming_llm(p); }
inline ref_matrix ref_scores(const problem& p, const infkv::tova&) { return ref_tova(p); }
/// Every row of `s` pooled along time order except its last `tail` slots, which get the pooled
/// mean of the rest (nothing when no prefix remains).
inline void ref_pool_rows(ref_matrix& s, std::span<const token> tokens, std::int32_t kernel, infkv::pooling kind,
                          std::int64_t tail) {
  const auto o = ref_time_order(tokens);
  const auto n = std::int64_t(o.size()), prefix = n - std::min(tail, n);
  if (kind == infkv::pooling::none || kernel == 1 || prefix == 0) return;
  for (auto& row : s) {
    std::vector<double> t(o.size());
    for (std::size_t i = 0; i < o.size(); ++i) t[i] = row[std::size_t(o[i])];
    t = ref_pool(t, prefix, kernel, kind);
    double mean = 0;
    for (std::int64_t i = 0; i < prefix; ++i) mean += t[std::size_t(i)] / double(prefix);
    for (std::int64_t i = prefix; i < n; ++i) t[std::size_t(i)] = mean;
    for (std::size_t i = 0; i < o.size(); ++i) row[std::size_t(o[i])] = t[i];
  }
}

/// KeyDiff's scores pooled along time over every slot (no observation window).
inline ref_matrix ref_scores(const problem& p, const infkv::keydiff& c) {
  ref_matrix s = ref_keydiff(p);
  ref_pool_rows(s, p.tokens, c.kernel, c.pool, 0);
  return s;
}
inline ref_matrix ref_scores(const problem& p, const infkv::snapkv& c) { return ref_snapkv(p, c); }
inline ref_matrix ref_scores(const problem& p, const infkv::inf_mllm& c) { return ref_inf_mllm(p, c); }
inline ref_matrix ref_scores(const problem& p, const infkv::expected_attention& c) { return ref_expected(p, c); }
inline ref_matrix ref_scores(const problem& p, const infkv::h2o& c) {
  return ref_h2o(std::span<const problem>(&p, 1), c);
}

/// The float64 reference of the score a spec composes from the sources and finishes above, for a
/// policy that has no reference of its own (one added by a file and a registry line): the source's
/// scores (recency, last query, key diversity, window attention), pooling along time with the
/// last pool_tail slots left out and given the pooled mean (window attention: per query head, as
/// SnapKV), then the bias. What it does not compose (value norms, accumulated and expected
/// attention, a window source whose pool_tail is not its window) fails the test, naming it.
template <class P>
ref_matrix ref_scores(const problem& p, const P& policy) {
  const infkv::score_spec s = policy.spec().score;
  ref_matrix out;
  const bool pooled = s.pool != infkv::pooling::none && s.kernel > 1;
  if (s.value_norm || (s.source == infkv::score_source::window_attention && s.pool_tail != s.queries) ||
      s.source == infkv::score_source::accumulated || s.source == infkv::score_source::expected_attention ||
      (s.source == infkv::score_source::last_query && s.queries != 1)) {
    FAIL("ref_scores: the spec of ", policy.spec().name, " is not composed by the generic reference");
    return out;
  }
  if (s.source == infkv::score_source::window_attention) {
    out = ref_window_pooled(p, s.queries, pooled ? s.kernel : 1, s.pool);
  } else {
    out = s.source == infkv::score_source::recency      ? ref_streaming_llm(p)
          : s.source == infkv::score_source::last_query ? ref_tova(p)
                                                        : ref_keydiff(p);
    ref_pool_rows(out, p.tokens, s.kernel, s.pool, s.pool_tail);
  }
  ref_bias(out, p.tokens, s.bias);
  return out;
}

/// The union by sets: the protected slots, the first round(share * room) of score a's ranking,
/// and the first m of score b's ranking for the smallest m that fills `cap` (each ranking: higher
/// score, then newer position, then lower slot, over the unprotected slots).
inline std::vector<std::int64_t> ref_union(std::span<const float> a, std::span<const float> b, std::span<const token> t,
                                           std::int64_t cap, std::int64_t sinks, std::int64_t recent, double share) {
  const auto n = std::int64_t(t.size());
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  if (cap >= n) return all;
  std::vector<std::int64_t> by_time = all;
  std::stable_sort(by_time.begin(), by_time.end(),
                   [&](std::int64_t x, std::int64_t y) { return t[std::size_t(x)].pos < t[std::size_t(y)].pos; });
  std::set<std::int64_t> kept, rest;
  for (std::int64_t i = 0; i < n; ++i) (i < sinks || i >= n - recent ? kept : rest).insert(by_time[std::size_t(i)]);
  const auto ranking = [&](std::span<const float> s) {
    std::vector<std::int64_t> r(rest.begin(), rest.end());
    std::sort(r.begin(), r.end(), [&](std::int64_t x, std::int64_t y) {
      if (s[std::size_t(x)] != s[std::size_t(y)]) return s[std::size_t(x)] > s[std::size_t(y)];
      if (t[std::size_t(x)].pos != t[std::size_t(y)].pos) return t[std::size_t(x)].pos > t[std::size_t(y)].pos;
      return x < y;
    });
    return r;
  };
  const std::int64_t room = cap - std::int64_t(kept.size());
  const auto ra = ranking(a), rb = ranking(b);
  const auto take = std::int64_t(std::llround(share * double(room)));
  kept.insert(ra.begin(), ra.begin() + take);
  for (std::int64_t m = 0; std::int64_t(kept.size()) < cap; ++m) kept.insert(rb[std::size_t(m)]);
  return {kept.begin(), kept.end()};
}

/// A union of two finishes of the same accumulated scores (a backend's union path on given
/// scores, infinities included): `share` of the room by `spec`'s score, the rest by max pooling
/// over 5.
inline infkv::policy_spec union_of_finishes(infkv::policy_spec spec, double share) {
  spec.second = infkv::score_spec{.source = infkv::score_source::accumulated, .pool = infkv::pooling::max, .kernel = 5};
  spec.share = share;
  return spec;
}

/// One row combining every row of every matrix of `m` (the same columns) by `r`: a per-layer or
/// per-token decision's scores, from finished per-head scores.
inline infkv::score_matrix reduce_rows(std::span<const infkv::score_matrix> m, infkv::reduction r) {
  const std::int64_t n = m[0].cols;
  const bool max = r == infkv::reduction::max;
  std::vector<double> acc(std::size_t(n), max ? -std::numeric_limits<double>::infinity() : 0.0);
  std::int64_t rows = 0;
  for (const auto& s : m)
    for (std::int64_t row = 0; row < s.rows; ++row, ++rows)
      for (std::int64_t c = 0; c < n; ++c)
        acc[std::size_t(c)] = max ? std::max(acc[std::size_t(c)], double(s(row, c))) : acc[std::size_t(c)] + s(row, c);
  infkv::score_matrix out(1, n);
  for (std::int64_t c = 0; c < n; ++c)
    out(0, c) = float(r == infkv::reduction::mean ? acc[std::size_t(c)] / double(rows) : acc[std::size_t(c)]);
  return out;
}
inline infkv::score_matrix reduce_rows(const infkv::score_matrix& s, infkv::reduction r) {
  return reduce_rows(std::span<const infkv::score_matrix>(&s, 1), r);
}

/// A plan's workspace and keep-set buffers (poisoned: -7 everywhere before a run).
struct plan_buffers {
  infkv::cpu::workspace ws;
  std::vector<std::int64_t> offsets, slots;
  infkv::keep_view out;
  explicit plan_buffers(const infkv::plan& p)
      : ws(p.workspace_bytes),
        offsets(std::size_t(p.offsets_size()), -7),
        slots(std::size_t(p.kept_total), -7),
        out{slots.data(), offsets.data(), p.units, p.shape.n_slots} {}
};

/// n tokens at random positions in [0, n + 3) (repeats and holes), in slot order.
inline std::vector<token> random_tokens(std::mt19937_64& gen, std::int64_t n) {
  std::vector<token> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = {std::int64_t(gen() % std::uint64_t(n + 3)), 0, infkv::modality::text};
  return t;
}

/// rows x n scores drawn mostly from a few levels (-0 and +0, Inf included): massive ties.
inline infkv::score_matrix tied_scores(std::mt19937_64& gen, std::int64_t rows, std::int64_t n) {
  const float levels[] = {-1.f, -0.f, 0.f, 0.5f, 2.f, std::numeric_limits<float>::infinity(), -3.f};
  infkv::score_matrix s(rows, n);
  for (auto& x : s.data) x = gen() % 3 == 0 ? std::ldexp(float(gen() % 1000), -7) : levels[gen() % 7];
  return s;
}

/// m distinct slots of n, increasing.
inline std::vector<std::int64_t> random_slots(std::mt19937_64& gen, std::int64_t n, std::int64_t m) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), std::int64_t{0});
  std::shuffle(all.begin(), all.end(), gen);
  all.resize(std::size_t(m));
  std::ranges::sort(all);
  return all;
}

/// Checks |got - want| <= rtol * |want| + atol * max|want row| element by element; names the
/// first mismatch.
inline void check_close(const infkv::score_matrix& got, const ref_matrix& want, double rtol, double atol,
                        const std::string& what) {
  INFO(what);
  REQUIRE(got.rows == std::int64_t(want.size()));
  std::int64_t bad = 0;
  std::string first;
  for (std::int64_t r = 0; r < got.rows; ++r) {
    REQUIRE(got.cols == std::int64_t(want[std::size_t(r)].size()));
    double row_max = 0;
    for (double v : want[std::size_t(r)]) row_max = std::max(row_max, std::abs(v));
    for (std::int64_t c = 0; c < got.cols; ++c) {
      const double w = want[std::size_t(r)][std::size_t(c)], g = got(r, c);
      if (!(std::abs(g - w) <= rtol * std::abs(w) + atol * row_max)) {
        if (bad++ == 0) {
          std::ostringstream os;
          os << "[" << r << ", " << c << "]: got " << g << ", want " << w;
          first = os.str();
        }
      }
    }
  }
  CHECK_MESSAGE(bad == 0, bad, " mismatches, first ", first);
}

}  // namespace infkv_test
