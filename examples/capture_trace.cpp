// infkv-capture: runs a llama.cpp model over the first tokens of a text with flash attention on,
// records the post-RoPE queries and keys and the values of some layers through `cb_eval`
// (infkv::llama_cpp::graph_observer), and writes them as a safetensors trace (docs/traces.md)
// that infkv-compare --trace evaluates. --survey prints where each layer's attention goes, to
// choose layers whose attention is not trivial; --check compares the attention recomputed from the
// recorded rows with llama.cpp's own attention output (`kqv_out-<layer>`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <infkv/adapters/llama_cpp.hpp>

#include "cli_util.hpp"
#include "errors.hpp"
#include "stream_text/llama_util.hpp"
#include "trace_io.hpp"

namespace {

/// Where the attention of a layer goes, for queries in the second half of the stream: mass on the
/// first 4 tokens (sinks), on the last 64 (local), on the rest (far), and the mean number of keys
/// that hold 90% of each query's attention. Means over the sampled queries and query heads.
struct layer_survey {
  double sink = 0, local = 0, far = 0, keys90 = 0;
};

layer_survey survey(const infkv::llama_cpp::layer_rows& r, double scale) {
  layer_survey s;
  const std::int64_t n = r.n_q, d = r.head_dim, group = r.n_head / r.n_head_kv, samples = 32;
  std::vector<double> p;
  std::int64_t count = 0;
  for (std::int64_t i = 0; i < samples; ++i) {
    const std::int64_t t = n / 2 + i * (n - n / 2) / samples;
    for (std::int64_t h = 0; h < r.n_head; ++h) {
      const float* q = r.q.data() + (t * r.n_head + h) * d;
      p.assign(std::size_t(t + 1), 0.0);
      double mx = -1e300, sum = 0;
      for (std::int64_t j = 0; j <= t; ++j) {
        const float* k = r.k.data() + (j * r.n_head_kv + h / group) * d;
        double dot = 0;
        for (std::int64_t e = 0; e < d; ++e) dot += double(q[e]) * k[e];
        p[std::size_t(j)] = dot * scale, mx = std::max(mx, p[std::size_t(j)]);
      }
      for (auto& x : p) x = std::exp(x - mx), sum += x;
      for (std::int64_t j = 0; j <= t; ++j) {
        const double a = p[std::size_t(j)] / sum;
        (j < 4 ? s.sink : t - j < 64 ? s.local : s.far) += a;
      }
      std::sort(p.begin(), p.end(), std::greater<>());
      double acc = 0;
      std::int64_t m = 0;
      while (acc < 0.9 * sum) acc += p[std::size_t(m++)];
      s.keys90 += double(m), ++count;
    }
  }
  s.sink /= double(count), s.local /= double(count), s.far /= double(count), s.keys90 /= double(count);
  return s;
}

/// Records llama.cpp's attention output (`kqv_out-<layer>`, [head_dim * n_head, tokens]) of some layers.
struct output_capture {
  std::vector<std::int32_t> layers;
  std::vector<std::vector<float>> rows;  // per entry of `layers`, token-major
  std::vector<char> scratch;

  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto& self = *static_cast<output_capture*>(user);
    const std::int32_t l = infkv::llama_cpp::layer_of(ggml_get_name(t), "kqv_out");
    const auto it = std::find(self.layers.begin(), self.layers.end(), l);
    if (l < 0 || it == self.layers.end()) return ask ? false : true;
    if (!ask) infkv::llama_cpp::append_rows(t, self.rows[std::size_t(it - self.layers.begin())], self.scratch);
    return true;
  }
};

/// Relative L2 error of the attention output recomputed from recorded rows (f32) against
/// llama.cpp's output `out`, over 16 tokens spread over the stream.
double check_layer(const infkv::llama_cpp::layer_rows& r, const std::vector<float>& out, double scale) {
  const std::int64_t n = r.n_q, d = r.head_dim, group = r.n_head / r.n_head_kv;
  double diff = 0, norm = 0;
  std::vector<double> p, o(static_cast<std::size_t>(d));
  for (std::int64_t s = 0; s < 16; ++s) {
    const std::int64_t t = s * (n - 1) / 15;
    for (std::int64_t h = 0; h < r.n_head; ++h) {
      const float* q = r.q.data() + (t * r.n_head + h) * d;
      p.assign(std::size_t(t + 1), 0.0);
      double mx = -1e300, sum = 0;
      for (std::int64_t j = 0; j <= t; ++j) {
        double dot = 0;
        for (std::int64_t e = 0; e < d; ++e) dot += double(q[e]) * r.k[std::size_t((j * r.n_head_kv + h / group) * d + e)];
        p[std::size_t(j)] = dot * scale, mx = std::max(mx, p[std::size_t(j)]);
      }
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t j = 0; j <= t; ++j) {
        const double a = std::exp(p[std::size_t(j)] - mx);
        sum += a;
        for (std::int64_t e = 0; e < d; ++e) o[std::size_t(e)] += a * r.v[std::size_t((j * r.n_head_kv + h / group) * d + e)];
      }
      for (std::int64_t e = 0; e < d; ++e) {
        const double ref = out[std::size_t((t * r.n_head + h) * d + e)], x = o[std::size_t(e)] / sum;
        diff += (x - ref) * (x - ref), norm += ref * ref;
      }
    }
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "infkv-capture: error: " << msg << '\n';
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"infkv-capture: record post-RoPE Q, K and V of some layers of a llama.cpp model over a text, as a "
               "safetensors trace for infkv-compare --trace"};
  app.name("infkv-capture");
  app.option_defaults()->always_capture_default();
  std::string model_path, text_path, out_path, source;
  std::vector<std::int32_t> layers;
  std::int64_t tokens = 2048, segment_tokens = 128;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool do_survey = false, do_check = false;
  app.add_option("--model", model_path, "GGUF model file (e.g. the path scripts/model.sh prints)")
      ->required()->check(CLI::ExistingFile);
  app.add_option("--text", text_path, "text file (e.g. the path scripts/kjv.sh prints)")
      ->required()->check(CLI::ExistingFile);
  app.add_option("--tokens", tokens, "tokens from the start of the text")->check(CLI::Range(16, 1 << 20));
  app.add_option("--layers", layers, "layers to record (comma list)")->delimiter(',')->check(infkv_examples::at_least(0));
  app.add_option("--segment-tokens", segment_tokens,
                 "segments: a new one starts at the first line break after this many tokens")
      ->check(infkv_examples::at_least(1));
  app.add_option("--source", source, "description of the text for the metadata (default: the file name)");
  app.add_option("--out", out_path, "trace file to write (.safetensors)")->check(infkv_examples::writable_file());
  app.add_option("--threads", threads, "llama.cpp threads")->check(infkv_examples::at_least(1, true, 1024));
  app.add_flag("--survey", do_survey, "print where each layer's attention goes");
  app.add_flag("--check", do_check, "compare the attention of the recorded layers with llama.cpp's output");
  CLI11_PARSE(app, argc, argv);
  if (out_path.empty() && !do_survey && !do_check) usage_error("--out: give a file to write (or --survey, --check)");
  if (do_check && layers.empty()) usage_error("--layers: give the layers to --check");
  if (!out_path.empty() && layers.empty()) usage_error("--layers: give the layers to record with --out");

  try {
    const auto model = stream::load_model(model_path);
    const llama_model* m = model.get();
    const std::int32_t n_layer = llama_model_n_layer(m);
    for (auto l : layers)
      if (l >= n_layer) usage_error("--layers = " + std::to_string(l) + ": the model has " + std::to_string(n_layer) + " layers");
    std::sort(layers.begin(), layers.end());
    layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
    const auto ids = stream::tokenize_file(m, text_path, tokens);
    if (std::int64_t(ids.size()) < tokens)
      usage_error("--tokens = " + std::to_string(tokens) + ": the text has only " + std::to_string(ids.size()));

    // Flash attention on; one sequence; batches of 512 tokens.
    const std::uint32_t batch = 512;
    auto cp = stream::context_params(std::uint32_t((tokens + 255) / 256 * 256), batch, threads);
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    output_capture outputs;
    if (do_check) {
      outputs.layers = layers, outputs.rows.resize(layers.size());
      cp.cb_eval = &output_capture::callback, cp.cb_eval_user_data = &outputs;
    }
    infkv::llama_cpp::graph_observer obs(n_layer, true);
    obs.install(cp);  // keeps calling the output capture
    stream::context_ptr ctx(llama_init_from_model(model.get(), cp));
    if (!ctx) infkv_examples::engine_fail("infkv-capture: llama_init_from_model failed (n_ctx {})", cp.n_ctx);

    // Every layer is kept for --survey, only the chosen ones otherwise.
    std::vector<infkv::llama_cpp::layer_rows> rows(static_cast<std::size_t>(n_layer));
    const auto keep = [&](std::int32_t l) {
      return do_survey || std::find(layers.begin(), layers.end(), l) != layers.end();
    };
    for (std::int64_t at = 0; at < tokens; at += batch) {
      const std::int64_t len = std::min<std::int64_t>(batch, tokens - at);
      llama_batch b = llama_batch_init(std::int32_t(len), 0, 1);
      for (std::int64_t i = 0; i < len; ++i) {
        b.token[i] = ids[std::size_t(at + i)], b.pos[i] = llama_pos(at + i);
        b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = i + 1 == len;
      }
      b.n_tokens = std::int32_t(len);
      obs.begin();
      const std::int32_t rc = llama_decode(ctx.get(), b);
      obs.end();
      llama_batch_free(b);
      if (!obs.error().empty()) infkv_examples::fail("{}", obs.error());
      if (rc != 0) infkv_examples::engine_fail("infkv-capture: llama_decode = {} at token {}", rc, at);
      for (std::int32_t l = 0; l < n_layer; ++l) {
        const auto& r = obs.layers()[std::size_t(l)];
        if (r.n_q != len || r.n_k != len || r.n_v != len || std::int64_t(r.v.size()) != r.n_k * r.n_head_kv * r.head_dim)
          infkv_examples::fail("infkv-capture: layer {}: cb_eval saw {} query, {} key and {} value rows ({} values) "
                               "for {} tokens; does this model name its nodes Qcur/Kcur/Vcur-<layer>?",
                               l, r.n_q, r.n_k, r.n_v, r.v.size(), len);
        if (!keep(l)) continue;
        auto& o = rows[std::size_t(l)];
        o.n_head = r.n_head, o.n_head_kv = r.n_head_kv, o.head_dim = r.head_dim;
        o.q.insert(o.q.end(), r.q.begin(), r.q.end()), o.k.insert(o.k.end(), r.k.begin(), r.k.end());
        o.v.insert(o.v.end(), r.v.begin(), r.v.end());
        o.n_q += len, o.n_k += len, o.n_v += len;
      }
    }
    const std::int32_t head_dim = obs.layers()[0].head_dim;
    const std::string arch = infkv::llama_cpp::meta_string(m, "general.architecture").value_or("llama");
    const double scale = infkv::llama_cpp::meta_number(m, arch + ".attention.scale", 0.0) > 0
                             ? infkv::llama_cpp::meta_number(m, arch + ".attention.scale", 0.0)
                             : 1.0 / std::sqrt(double(head_dim));

    if (do_survey) {
      fmt::print("layer   sink   local     far  keys for 90%   (queries in the second half; sink: first 4 "
                 "tokens, local: last 64)\n");
      for (std::int32_t l = 0; l < n_layer; ++l) {
        const auto s = survey(rows[std::size_t(l)], scale);
        fmt::print("{:5}  {:>5.3f}   {:>5.3f}   {:>5.3f}  {:>8.1f}\n", l, s.sink, s.local, s.far, s.keys90);
      }
    }
    if (do_check)
      for (std::size_t i = 0; i < layers.size(); ++i) {
        const auto& r = rows[std::size_t(layers[i])];
        if (std::int64_t(outputs.rows[i].size()) != tokens * r.n_head * r.head_dim)
          infkv_examples::fail("infkv-capture: --check: layer {}: kqv_out gave {} values, expected {}", layers[i],
                               outputs.rows[i].size(), tokens * r.n_head * r.head_dim);
        fmt::print("layer {}: attention output from the recorded Q, K, V vs llama.cpp's kqv_out: relative L2 "
                   "error {:.2e}\n", layers[i], check_layer(r, outputs.rows[i], scale));
      }
    if (out_path.empty()) return 0;

    trace_io::trace t;
    t.n_tokens = tokens;
    t.token_ids.assign(ids.begin(), ids.begin() + tokens);
    std::int32_t seg = 0;
    std::int64_t seg_len = 0;
    for (std::int64_t i = 0; i < tokens; ++i) {
      t.segments.push_back(seg);
      if (++seg_len >= segment_tokens && stream::piece(m, ids[std::size_t(i)]).find('\n') != std::string::npos)
        ++seg, seg_len = 0;
    }
    for (auto l : layers) {
      auto& r = rows[std::size_t(l)];
      t.layers.push_back({l, r.n_head, r.n_head_kv, r.head_dim, std::move(r.q), std::move(r.k), std::move(r.v)});
    }
    const auto rope = infkv::llama_cpp::model_rope(m);
    std::ostringstream num;
    num.precision(9);
    const auto str = [&](double v) { return num.str(""), num << v, num.str(); };
    t.metadata = {
        {"format", "infkv-trace 1"},
        {"model", infkv::llama_cpp::meta_string(m, "general.name").value_or(arch)},
        {"model_file", std::filesystem::path(model_path).filename().string()},
        {"architecture", arch},
        {"source", source.empty() ? std::filesystem::path(text_path).filename().string() : source},
        {"n_layer", std::to_string(n_layer)},
        {"n_head", std::to_string(t.layers.front().n_head)},
        {"n_head_kv", std::to_string(t.layers.front().n_head_kv)},
        {"head_dim", std::to_string(head_dim)},
        {"attention_scale", str(scale)},
        {"rope_type", rope.kind},
        {"rope_theta", str(rope.params.theta)},
        {"rope_dims", std::to_string(rope.params.dims)},
        {"rope_freq_scale", str(rope.params.freq_scale)},
        {"flash_attn", "on"},
        {"segments", "a new segment at the first line break after " + std::to_string(segment_tokens) + " tokens"},
        {"generator", "infkv-capture"},
    };
    const auto bytes = trace_io::to_safetensors(t);
    trace_io::write_file(out_path, bytes);
    fmt::print("infkv-capture: wrote {}: {} tokens, layers {}, {} bytes\n", out_path, tokens, trace_io::layer_list(t),
               bytes.size());
  } catch (const std::exception& e) {
    std::cerr << "infkv-capture: error: " << e.what() << '\n';
    return 2;
  }
  return 0;
}
