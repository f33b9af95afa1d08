// Random ragged batches for the batched plan's tests (CPU backend and the CUDA backend's steps on
// the host): sequences of different lengths, query counts and budgets, keys contiguous per
// sequence or in one shared page pool, one or two layers per decision. `check_batch_equals_runs`
// runs every registered policy over a batch with one batch plan and compares each sequence's keep
// set with that sequence run alone through make_plan / run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <doctest/doctest.h>
#include <infkv/cpu.hpp>

#include "cpu/reference_helpers.hpp"
#include "policy_registry.hpp"

namespace infkv_test {

/// A paged pool holding every sequence's rows of one tensor: page ids shuffled, a few spare pages.
struct page_pool {
  std::vector<std::uint8_t> bytes;
  std::vector<std::int32_t> indptr, indices, last;
  infkv::paged_view view{};

  page_pool() = default;
  page_pool(const page_pool&) = delete;
  page_pool(page_pool&&) = default;
  page_pool& operator=(page_pool&&) = default;

  /// x[s] holds sequence s's rows (n[s] x heads x d floats).
  page_pool(std::mt19937_64& gen, const std::vector<std::vector<float>>& x, const std::vector<std::int64_t>& n,
            std::int32_t heads, std::int32_t d, infkv::dtype t, std::int32_t page) {
    const auto es = std::int64_t(infkv::size_of(t));
    indptr.assign(1, 0);
    for (std::size_t s = 0; s < n.size(); ++s) {
      const auto pages = std::int32_t((n[s] + page - 1) / page);
      indptr.push_back(indptr.back() + pages);
      last.push_back(n[s] == 0 ? 0 : std::int32_t(n[s] - std::int64_t(pages - 1) * page));
    }
    const std::int32_t total = indptr.back() + 3;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(total));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), gen);
    indices.assign(ids.begin(), ids.begin() + indptr.back());
    const std::int64_t page_stride = std::int64_t(page) * heads * d + 5;  // padded pages
    bytes.assign(std::size_t(total * page_stride * es), 0xff);
    view = {.k = {bytes.data(), page_stride, std::int64_t(heads) * d, d},
            .v = {},
            .type = t,
            .n_heads = heads,
            .head_dim = d,
            .page_size = page,
            .n_seqs = std::int32_t(n.size()),
            .n_pages = total,
            .indptr = indptr.data(),
            .indices = indices.data(),
            .last_page_len = last.data()};
    for (std::int32_t s = 0; s < view.n_seqs; ++s) {
      const infkv::paged_rows r = infkv::key_rows(view, s);
      for (std::int64_t j = 0; j < n[std::size_t(s)]; ++j)
        for (std::int32_t h = 0; h < heads; ++h)
          infkv::from_f32(t, x[std::size_t(s)].data() + (j * heads + h) * d, r.row(j, h), d);
    }
  }
};

/// A random batch: per-sequence problems (tokens, keys, queries), the batch's concatenated
/// tokens and queries, budgets, granularity and layer count.
struct batch_case {
  std::vector<problem> seqs, second;  ///< second: the second layer's keys (same shapes)
  std::vector<std::int64_t> slot_indptr{0}, query_indptr{0}, qpos;
  std::vector<infkv::token> tokens;
  std::vector<float> q;
  stored queries;
  std::vector<infkv::budget> budgets;
  infkv::plan_options opt;
  std::int32_t hkv = 1, hq = 1, d = 1, page = 1;
  infkv::dtype type = infkv::dtype::f32;

  infkv::batch_shape shape() const { return {slot_indptr, query_indptr, hkv, hq, d}; }
};

inline batch_case draw_batch(std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  const auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return lo + std::int64_t(gen() % std::uint64_t(hi - lo + 1));
  };
  batch_case c;
  const auto n_seqs = std::int32_t(pick(1, 6));
  c.hkv = std::int32_t(std::vector<int>{1, 2, 4}[std::size_t(pick(0, 2))]);
  const auto group = std::int32_t(pick(1, 3));
  c.hq = c.hkv * group;
  c.d = std::int32_t(std::vector<int>{4, 8, 17}[std::size_t(pick(0, 2))]);
  c.type = std::vector<infkv::dtype>{infkv::dtype::f32, infkv::dtype::f16, infkv::dtype::bf16}[std::size_t(pick(0, 2))];
  c.page = std::int32_t(pick(1, 7));
  const auto g = infkv::granularity(pick(0, 2));
  c.opt.g = g;
  if (g == infkv::granularity::per_token && pick(0, 2) == 0) c.opt.n_layers = 2;
  if (g == infkv::granularity::per_head && c.hkv > 1 && pick(0, 2) == 0) c.opt.adakv = infkv::adakv{.alpha = 0.3};
  for (std::int32_t s = 0; s < n_seqs; ++s) {
    const std::int64_t n = pick(1, 120), nq = pick(1, 6);
    c.seqs.push_back(make_problem(seed * 16 + std::uint64_t(s), n, c.hkv, group, c.d, nq, c.type));
    c.second.push_back(make_problem(seed * 16 + 8 + std::uint64_t(s), n, c.hkv, group, c.d, nq, c.type));
    const problem& p = c.seqs.back();
    c.slot_indptr.push_back(c.slot_indptr.back() + n);
    c.query_indptr.push_back(c.query_indptr.back() + nq);
    c.tokens.insert(c.tokens.end(), p.tokens.begin(), p.tokens.end());
    c.qpos.insert(c.qpos.end(), p.qpos.begin(), p.qpos.end());
    c.q.insert(c.q.end(), p.q.begin(), p.q.end());
    infkv::budget b{.sinks = pick(0, 5), .recent = pick(0, 8)};
    const std::int64_t prot = b.sinks + std::max<std::int64_t>(b.recent, 4);  // windows up to 4
    if (pick(0, 2) == 0)
      b.ratio = std::min(1.0, double(prot + pick(0, 40)) / double(n));
    else
      b.capacity = prot + pick(0, n);
    c.budgets.push_back(b);
  }
  c.queries = store(c.q, c.query_indptr.back(), c.hq, c.d, c.type, layout::nhd);
  return c;
}

/// Keys of every sequence of a batch, per layer: contiguous NHD tensors, and the same rows in one
/// page pool per layer.
struct batch_keys {
  std::vector<std::vector<stored>> tensors;                        ///< [layer][seq]
  std::vector<page_pool> pools;                                    ///< [layer]
  std::vector<std::vector<infkv::const_tensor_view>> tensor_rows;  ///< [layer][seq]
  std::vector<std::vector<infkv::const_paged_rows>> paged_rows;    ///< [layer][seq]

  batch_keys(std::mt19937_64& gen, const batch_case& c) {
    for (std::int32_t l = 0; l < c.opt.n_layers; ++l) {
      const auto& ps = l == 0 ? c.seqs : c.second;
      std::vector<std::vector<float>> x;
      std::vector<std::int64_t> n;
      tensors.emplace_back();
      tensor_rows.emplace_back();
      for (const problem& p : ps) {
        tensors.back().push_back(store(p.k, p.n, c.hkv, c.d, c.type, layout::nhd));
        tensor_rows.back().push_back(tensors.back().back().tensor);
        x.push_back(p.k);
        n.push_back(p.n);
      }
      pools.emplace_back(gen, x, n, c.hkv, c.d, c.type, c.page);
      paged_rows.emplace_back();
      for (std::int32_t s = 0; s < std::int32_t(ps.size()); ++s)
        paged_rows.back().push_back(infkv::key_rows(pools.back().view, s));
    }
  }
};

/// For every registered policy: the batch plan's keep sets over `rows` (keys per layer and
/// sequence) equal each sequence's own make_plan / run, on backend `be`. H2O's accumulated
/// scores come from a state per sequence fed that sequence's attention, concatenated for the batch.
template <class B, class R>
void check_batch_equals_runs(const B& be, const batch_case& c, const std::vector<std::vector<R>>& rows) {
  using namespace infkv;
  const auto n_seqs = std::int32_t(c.seqs.size());
  const auto layers = std::size_t(c.opt.n_layers);
  const auto one_seq = [&](std::size_t l, std::int32_t s) {
    const problem& p = c.seqs[std::size_t(s)];
    return layer_inputs<R>{rows[l][std::size_t(s)], {}, {}, p.qpos, p.tokens, 0.f};
  };
  // Each sequence's own queries, stored apart from the batch's concatenation.
  std::vector<stored> own_queries;
  for (const problem& p : c.seqs) own_queries.push_back(store_queries(p));
  layer_inputs<R> observed = one_seq(0, 0);  // for_each_policy's own H2O states (unused here)
  observed.queries = own_queries[0].tensor;
  for_each_policy(observed, [&](const std::string& label, const auto& pol, const state_of&) {
    CAPTURE(label);
    using P = std::decay_t<decltype(pol)>;
    const bool per_head_score = pol.spec().score.one_row() == false;
    if (c.opt.adakv && !per_head_score) return;  // AdaKV needs a per-head score
    // H2O: one state per sequence, fed its first layer's attention; the batch reads them concatenated.
    std::vector<cpu::h2o_state> states;
    score_matrix acc(c.hkv, c.slot_indptr.back());
    if constexpr (std::is_same_v<P, h2o>) {
      for (std::int32_t s = 0; s < n_seqs; ++s) {
        states.emplace_back(pol, c.hkv);
        states.back().append(c.seqs[std::size_t(s)].n);
        layer_inputs<R> in = one_seq(0, s);
        in.queries = own_queries[std::size_t(s)].tensor;
        cpu::observe(states.back(), in);
        const const_score_view a = states.back().attach(in).accumulated;
        for (std::int64_t h = 0; h < c.hkv; ++h)
          std::copy(a.row(h), a.row(h) + a.cols, acc.row(h).begin() + c.slot_indptr[std::size_t(s)]);
      }
    }
    // The batch, in one plan and one run.
    std::vector<batch_inputs<R>> batch(layers);
    for (std::size_t l = 0; l < layers; ++l)
      batch[l] = {.keys = rows[l],
                  .queries = c.queries.tensor,
                  .query_pos = c.qpos,
                  .tokens = c.tokens,
                  .accumulated = std::is_same_v<P, h2o> ? const_score_view(acc.view()) : const_score_view{}};
    const batch_plan bp = make_batch_plan(be, pol, c.budgets, c.shape(), c.opt);
    cpu::workspace ws(bp.workspace_bytes);
    std::vector<std::int64_t> slots(std::size_t(bp.kept_total()), -7), offsets(std::size_t(bp.offsets_size()), -7);
    run(bp, be, std::span<const batch_inputs<R>>(batch), ws.span(), bp.keep(slots.data(), offsets.data()));
    // Each sequence alone.
    for (std::int32_t s = 0; s < n_seqs; ++s) {
      CAPTURE(s);
      std::vector<layer_inputs<R>> in;
      for (std::size_t l = 0; l < layers; ++l) {
        in.push_back(one_seq(l, s));
        in.back().queries = own_queries[std::size_t(s)].tensor;
        if constexpr (std::is_same_v<P, h2o>) in.back() = states[std::size_t(s)].attach(in.back());
      }
      const plan p = make_plan(be, pol, c.budgets[std::size_t(s)], shape_of(in[0]), c.opt);
      plan_buffers buf(p);
      run(p, be, std::span<const layer_inputs<R>>(in), buf.ws.span(), buf.out);
      CHECK(keep_set::from_view(bp.keep(slots.data(), offsets.data()).seq(s)) == keep_set::from_view(buf.out));
    }
  });
}

}  // namespace infkv_test
