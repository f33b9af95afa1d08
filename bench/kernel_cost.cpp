// infkv_kernel_cost: the cost model of the CUDA kernels as written (kernel_cost.hpp) for one
// eviction of one layer: SnapKV (window 32, average pooling of 5) keeping `kept` slots per KV
// head of n (f16 keys and values, 8 KV heads, 32 query heads, head_dim 128), then the compaction
// of K and V, with keys strided (NHD) and paged (pages of 16 slots, in reverse order). Runs the
// steps on the host (minutes at the reference size) and writes JSON for scripts/perf_report.py:
//
//   infkv_kernel_cost COMMIT [--n N] [--kept K] [--position-bits B] > bench/results/gpu/kernel_cost.json
//   infkv_kernel_cost COMMIT --policy keydiff > bench/results/gpu/kernel_cost_keydiff.json
//
// --policy tova | keydiff | expected_attention: that policy's scoring and selection instead
// (strided keys, no compaction: the compaction is SnapKV's).
// --position-bits: the backend's promise on positions (basic_backend::position_bits, 31 by
// default); the time order's sort runs a pass per 8 of them.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "cost_model.hpp"
#include "kernel_cost.hpp"

namespace {

using namespace infkv_bench;
void print_layout(const char* name, const std::vector<launch_record>& ls, const gpu_model& g, bool last) {
  std::printf("  \"%s\": {\n   \"launches\": [\n", name);
  for (std::size_t i = 0; i < ls.size(); ++i) {
    const launch_record& l = ls[i];
    const auto t = g.time(l);
    std::printf(
        "    {\"step\": \"%s\", \"group\": \"%s\", \"kind\": \"%s\", \"kernels\": %d, \"blocks\": %lld, \"threads\": "
        "%lld, \"shared_bytes\": %lld, \"items\": %lld, \"read_bytes\": %.6g, \"written_bytes\": %.6g, "
        "\"tensor_flops\": %.6g, \"f32\": %s, \"exps\": %.6g, \"sm_share\": %.4g, \"memory_share\": %.4g, "
        "\"memory_us\": %.4g, "
        "\"tensor_us\": %.4g, \"exp_us\": %.4g, \"est_us\": %.4g}%s\n",
        l.step.c_str(), group_of(l.step).c_str(), l.kind.c_str(), l.count, (long long)l.blocks, (long long)l.threads,
        (long long)l.shared, (long long)l.items, l.read, l.written, l.tc_flops, l.f32 ? "true" : "false", l.exps,
        t.sm_share, t.memory_share, t.memory * 1e6, t.tensor * 1e6, t.exp * 1e6, t.total * 1e6,
        i + 1 < ls.size() ? "," : "");
  }
  std::printf("   ]\n  }%s\n", last ? "" : ",");
}

}  // namespace

int main(int argc, char** argv) {
  const char* commit = argc > 1 ? argv[1] : "unknown";
  layer_data c{.n = 131072};
  std::int64_t kept = 8192;
  std::string policy = "snapkv";
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--n"))
      c.n = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--kept"))
      kept = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--position-bits"))
      c.position_bits = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--policy"))
      policy = argv[i + 1];
    else {
      std::cerr << "infkv_kernel_cost: unknown argument " << argv[i]
                << " (--n N, --kept K, --position-bits B, --policy snapkv|tova|keydiff|expected_attention)\n";
      return 2;
    }
  }
  const std::map<std::string, infkv::policy_spec> specs{
      {"snapkv", infkv::snapkv{}.spec()},
      {"tova", infkv::tova{}.spec()},
      {"keydiff", infkv::keydiff{}.spec()},
      {"expected_attention", infkv::expected_attention{.window = 32}.spec()}};
  if (!specs.contains(policy)) {
    std::cerr << "infkv_kernel_cost: --policy " << policy << ": one of snapkv, tova, keydiff, expected_attention\n";
    return 2;
  }
  const infkv::policy_spec& spec = specs.at(policy);
  const bool full = policy == "snapkv";  // the others: their scoring and selection, keys strided
  if (c.n < 64 || kept < 64 || kept > c.n) {
    std::cerr << "infkv_kernel_cost: --n " << c.n << " --kept " << kept << ": need 64 <= kept <= n\n";
    return 2;
  }
  const gpu_model g;
  const layer_case lc{.n = c.n, .hkv = c.hkv, .hq = c.hq, .d = c.d, .m = c.w, .elem = 2, .kept = kept};
  const double bw = g.bandwidth, pk = g.tc_peak;
  std::printf("{\n \"commit\": \"%s\",\n", commit);
  std::printf(
      " \"protocol\": \"bench/kernel_cost.hpp: one eviction (SnapKV: window 32, average pooling of 5, per KV head, "
      "then the compaction of K and V; another policy: its scoring and selection) run on the host through the CUDA "
      "backend's steps; per launch its grid and block "
      "as the device launcher makes them, the distinct bytes it reads and writes (4 KiB pages of an arena holding "
      "every buffer; K, V and the token lists during the compaction, which gathers scattered rows, per 32-byte "
      "sector), the tensor-core FLOPs and exponentials its blocks count; CUB and cuBLAS calls from their "
      "arguments. Time per launch = launch gap x kernels + max(bytes / (bandwidth x efficiency x memory share), "
      "tensor FLOPs / (peak x efficiency x SM share), exponentials / (rate x SM share)); memory share = resident "
      "threads x bytes in flight / latency against the bandwidth, SM share = the SMs the grid occupies. No GPU "
      "measurement.\",\n");
  std::printf(
      " \"case\": {\"n\": %lld, \"kv_heads\": %lld, \"q_heads\": %lld, \"head_dim\": %lld, \"window\": %lld, "
      "\"element_bytes\": 2, \"kept\": %lld, \"page_size\": 16, \"position_bits\": %d, \"policy\": \"%s\"},\n",
      (long long)c.n, (long long)c.hkv, (long long)c.hq, (long long)c.d, (long long)c.w, (long long)kept,
      c.position_bits, policy.c_str());
  std::printf(
      " \"gpu\": {\"name\": \"%s\", \"sms\": %d, \"bandwidth\": %.4g, \"bandwidth_eff\": %.3g, \"tc_peak\": %.4g, "
      "\"tc_eff\": %.3g, \"exp_rate\": %.4g, \"latency_s\": %.3g, \"in_flight_bytes\": %.3g, \"launch_gap_s\": "
      "%.3g},\n",
      g.name.c_str(), g.sms, g.bandwidth, g.bandwidth_eff, g.tc_peak, g.tc_eff, g.exp_rate, g.latency, g.in_flight,
      g.launch_gap);
  const cost scoring = policy == "snapkv"    ? window_scoring(lc, lc.m)
                       : policy == "tova"    ? window_scoring(lc, 1)
                       : policy == "keydiff" ? keydiff(lc)
                                             : expected_attention(lc);
  std::printf(" \"roofline_us\": {\"window scoring\": %.4g, \"selection\": %.4g%s",
              scoring.roofline(bw, pk, g.f32_peak) * 1e6, selection(lc).roofline(bw, pk, pk) * 1e6, full ? "" : "},\n");
  if (full) std::printf(", \"compaction\": %.4g},\n", compaction(lc).roofline(bw, pk, pk) * 1e6);
  std::printf(" \"layouts\": {\n");
  const auto strided = record_eviction(c, kept, false, spec, full);
  print_layout("strided", strided, g, !full);
  const auto paged = full ? record_eviction(c, kept, true) : std::vector<launch_record>{};
  if (full) print_layout("paged", paged, g, true);
  std::printf(" }\n}\n");
  // A summary for the terminal.
  for (const auto* ls : {&strided, &paged}) {
    if (ls->empty()) continue;
    std::map<std::string, std::pair<int, double>> groups;
    double total = 0;
    int kernels = 0;
    for (const auto& l : *ls) {
      const double t = g.time(l).total;
      auto& e = groups[group_of(l.step)];
      e.first += l.count, e.second += t, total += t, kernels += l.count;
    }
    std::cerr << (ls == &strided ? "strided" : "paged") << ": " << kernels << " kernels, " << total * 1e6 << " us\n";
    for (const auto& [name, e] : groups)
      std::cerr << "  " << name << ": " << e.first << " kernels, " << e.second * 1e6 << " us\n";
  }
  return 0;
}
