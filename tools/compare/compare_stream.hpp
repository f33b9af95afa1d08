// infkv-compare: streams a synthetic workload through a bounded cache per (policy, budget), with
// budgeted block-wise prefill (append a block, evict back to the budget, compact), and measures
// how faithfully the kept cache serves the queries that come after each eviction.
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <infkv/cpu.hpp>
#include "synthetic.hpp"

#include "policy_catalog.hpp"

namespace compare {

using kind = infkv_tools::policy_kind;
using policy_info = infkv_tools::policy_entry;

/// The policies the program compares: every one of the catalog but the runs that need an engine
/// (the recompute oracle, llama.cpp's context shift).
inline bool compared(kind k) { return !infkv_tools::engine_only(k); }

/// Shared settings of all runs.
struct settings : infkv_tools::policy_knobs {
  std::int64_t probes = 32;  ///< queries of the next block used to measure fidelity
  settings() { beta = 0.5; }
};

/// The budget (with its protected tokens) a policy evicts to, or nullopt for `full`.
inline std::optional<infkv::budget> policy_budget(kind k, std::int64_t capacity, const settings& s) {
  return infkv_tools::policy_budget(k, capacity, s);
}

/// The full-cache reference for one measurement point: the probe queries (taken evenly from the
/// next block) attending to every token before it.
struct reference {
  std::int64_t context = 0;       ///< tokens [0, context) are the full cache
  std::vector<float> queries;     ///< [probes][Hq][d]
  std::vector<std::int64_t> pos;  ///< probe positions
  infkv::score_matrix mass;       ///< [Hkv][context]: per-slot probability summed over probes
  std::vector<float> out;         ///< [probes][Hq][d]
};

inline reference make_reference(synthetic::workload& w, std::int64_t context, infkv::block_range next,
                                std::int64_t probes, const infkv::cpu::executor& ex) {
  reference r;
  r.context = context;
  const std::int64_t len = next.end - next.begin, p = std::min(probes, len), row = w.query_heads() * w.cfg.head_dim;
  for (std::int64_t i = 0; i < p; ++i) {
    const std::int64_t t = next.begin + i * len / p;
    r.pos.push_back(t);
    r.queries.insert(r.queries.end(), w.queries.begin() + t * row, w.queries.begin() + (t + 1) * row);
  }
  const auto kv = w.kv(context);
  const infkv::layer_inputs<> in{kv.k, kv.v,
                                 infkv::nhd(r.queries.data(), infkv::dtype::f32, p, w.query_heads(), w.cfg.head_dim),
                                 r.pos, std::span(w.tokens).first(std::size_t(context))};
  r.mass = infkv::cpu::window_attention(in, ex);
  r.out = infkv::cpu::attention_output(in, ex);
  return r;
}

/// One measurement: the context it was taken at, mass kept and output error (means over the
/// probes and heads).
struct sample {
  std::int64_t context = 0;
  double mass = 0.0;
  double error = 0.0;
};

/// One policy at one budget (or `full`), with its own cache: per KV head K and V [cap][d]
/// (HND storage, so a head is a view of its own and a uniform cache is one layer view).
class policy_run {
 public:
  policy_run(kind k, std::int64_t capacity, std::int64_t cap, const settings& s, const synthetic::config& c)
      : kind_(k),
        capacity_(capacity),
        cap_(cap),
        s_(s),
        hkv_(c.kv_heads),
        group_(c.group),
        d_(c.head_dim),
        k_(std::size_t(cap * c.kv_heads * c.head_dim)),
        v_(k_.size()),
        tokens_(std::size_t(c.kv_heads)),
        budget_(policy_budget(k, capacity, s)) {
    if (budget_) budget_->validate();
    if (k == kind::h2o)
      for (std::int32_t h = 0; h < hkv_; ++h) h2o_.emplace_back(infkv::h2o{}, 1);
  }

  kind policy() const { return kind_; }
  std::int64_t capacity() const { return capacity_; }
  std::int64_t evictions() const { return evictions_; }
  double seconds() const { return seconds_; }
  const std::vector<sample>& samples() const { return samples_; }

  /// Appends block `b` of the workload, then evicts back to the budget when over it.
  void step(synthetic::workload& w, infkv::block_range b, const infkv::cpu::executor& ex) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::int64_t n = size(), len = b.end - b.begin;
    INFKV_REQUIRE(n + len <= cap_, "cache", n + len, "exceeds the allocated slots (", cap_, ")");
    for (std::int32_t h = 0; h < hkv_; ++h) {
      for (std::int64_t t = b.begin; t < b.end; ++t) {
        std::copy_n(w.keys.data() + (t * hkv_ + h) * d_, d_, row(k_, h, n + t - b.begin));
        std::copy_n(w.values.data() + (t * hkv_ + h) * d_, d_, row(v_, h, n + t - b.begin));
        tokens_[std::size_t(h)].push_back(w.tokens[std::size_t(t)]);
      }
    }
    if (kind_ == kind::h2o) {
      const auto pos = synthetic::workload::positions(b.begin, b.end);
      for (std::int32_t h = 0; h < hkv_; ++h) {
        h2o_[std::size_t(h)].append(len);
        infkv::cpu::observe(h2o_[std::size_t(h)], head_inputs(h, group_rows(w.query_rows(b.begin, b.end), h), pos), ex);
      }
    }
    if (budget_ && size() > budget_->capacity) evict(w, b, ex), ++evictions_;
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  /// Measures the kept cache against the reference and records a sample.
  void measure(reference& r, const infkv::cpu::executor& ex) {
    const auto n_p = std::int64_t(r.pos.size());
    const std::int32_t hq = hkv_ * group_;
    double mass = 0.0, err = 0.0;
    for (std::int32_t h = 0; h < hkv_; ++h) {
      double m = 0.0;
      for (const auto& t : tokens_[std::size_t(h)]) m += r.mass(h, t.pos);
      mass += m / double(n_p);
      const auto q = infkv::nhd(r.queries.data(), infkv::dtype::f32, n_p, hq, d_);
      const auto out = infkv::cpu::attention_output(head_inputs(h, group_rows(q, h), r.pos), ex);
      for (std::int64_t i = 0; i < n_p; ++i)
        for (std::int32_t g = 0; g < group_; ++g) {
          const float* o = out.data() + (i * group_ + g) * d_;
          const float* ref = r.out.data() + (i * hq + h * group_ + g) * d_;
          double diff = 0.0, norm = 0.0;
          for (std::int32_t e = 0; e < d_; ++e) {
            const double delta = double(o[e]) - ref[e];
            diff += delta * delta, norm += double(ref[e]) * ref[e];
          }
          err += std::sqrt(diff / std::max(norm, 1e-30));
        }
    }
    samples_.push_back({r.context, mass / hkv_, err / double(n_p * hq)});
  }

 private:
  std::int64_t size() const { return std::int64_t(tokens_[0].size()); }
  float* row(std::vector<float>& x, std::int32_t h, std::int64_t slot) { return x.data() + (h * cap_ + slot) * d_; }

  /// K or V of head h as a one-head view.
  infkv::tensor_view head_view(std::vector<float>& x, std::int32_t h) {
    return {row(x, h, 0), infkv::dtype::f32, std::int64_t(tokens_[std::size_t(h)].size()), 1, d_, d_, cap_ * d_};
  }
  /// The G query heads of KV head h within an NHD query view.
  infkv::tensor_view group_rows(infkv::tensor_view q, std::int32_t h) const {
    q.data = q.row(0, h * group_);
    q.n_heads = group_;
    return q;
  }
  infkv::layer_inputs<> head_inputs(std::int32_t h, infkv::tensor_view q, std::span<const std::int64_t> pos) {
    return {head_view(k_, h), head_view(v_, h), q, pos, tokens_[std::size_t(h)]};
  }

  /// Selects per KV head (or once for the layer) and compacts every head.
  void evict(synthetic::workload& w, infkv::block_range b, const infkv::cpu::executor& ex) {
    const std::int64_t n = size(), win = std::min<std::int64_t>(s_.window, b.end);
    const auto pos = synthetic::workload::positions(b.end - win, b.end);
    const auto window_q = w.query_rows(b.end - win, b.end);
    const auto& bud = *budget_;
    std::vector<infkv::keep_set> keep;
    if (kind_ == kind::window || kind_ == kind::streaming_llm || kind_ == kind::tova) {
      // Uniform policies: one decision for the whole layer, from a layer view of the cache.
      const infkv::layer_inputs<> layer{infkv::hnd(k_.data(), infkv::dtype::f32, n, hkv_, d_, cap_),
                                        infkv::hnd(v_.data(), infkv::dtype::f32, n, hkv_, d_, cap_),
                                        w.query_rows(b.end - 1, b.end), std::span(pos).last(1), tokens_[0]};
      keep.assign(std::size_t(hkv_), kind_ == kind::tova
                                         ? infkv::cpu::select(infkv::tova{}, bud, layer, infkv::granularity::per_layer,
                                                              infkv::reduction::mean, ex)
                                         : infkv::cpu::select(infkv::streaming_llm{}, bud, layer));
    } else {
      for (std::int32_t h = 0; h < hkv_; ++h) {
        const auto in = head_inputs(h, group_rows(window_q, h), pos);
        keep.push_back(infkv_tools::with_policy(kind_, s_, [&](const auto& p) {
          // H2O reads the head's accumulated state
          return infkv::cpu::select(p, bud, kind_ == kind::h2o ? h2o_[std::size_t(h)].attach(in) : in);
        }));
      }
    }
    for (std::int32_t h = 0; h < hkv_; ++h) {
      infkv::kv_view kv{head_view(k_, h), head_view(v_, h)};
      auto& toks = tokens_[std::size_t(h)];
      const std::int64_t kept = infkv::cpu::compact(kv, toks, keep[std::size_t(h)]);
      toks.resize(std::size_t(kept));
      if (kind_ == kind::h2o) h2o_[std::size_t(h)].evict(keep[std::size_t(h)]), h2o_[std::size_t(h)].shift(toks);
    }
  }

  kind kind_;
  std::int64_t capacity_, cap_;
  settings s_;
  std::int32_t hkv_, group_, d_;
  std::vector<float> k_, v_;
  std::vector<std::vector<infkv::token>> tokens_;  // per KV head, slot order
  std::optional<infkv::budget> budget_;
  std::vector<infkv::cpu::h2o_state> h2o_;
  std::vector<sample> samples_;
  std::int64_t evictions_ = 0;
  double seconds_ = 0.0;
};

}  // namespace compare
