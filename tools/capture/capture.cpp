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
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <infkv/llama_cpp.hpp>

#include "cli_util.hpp"
#include "errors.hpp"
#include "llama_util.hpp"
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
    if (!ask)
      infkv::llama_cpp::append_rows(infkv::llama_cpp::rows_of(t, l, infkv::llama_cpp::node_kind::value, self.scratch),
                                    self.rows[std::size_t(it - self.layers.begin())]);
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
        for (std::int64_t e = 0; e < d; ++e)
          dot += double(q[e]) * r.k[std::size_t((j * r.n_head_kv + h / group) * d + e)];
        p[std::size_t(j)] = dot * scale, mx = std::max(mx, p[std::size_t(j)]);
      }
      std::fill(o.begin(), o.end(), 0.0);
      for (std::int64_t j = 0; j <= t; ++j) {
        const double a = std::exp(p[std::size_t(j)] - mx);
        sum += a;
        for (std::int64_t e = 0; e < d; ++e)
          o[std::size_t(e)] += a * r.v[std::size_t((j * r.n_head_kv + h / group) * d + e)];
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
  fmt::print(stderr, "infkv-capture: error: {}\n", msg);
  std::exit(2);
}

/// The command line.
struct options {
  std::string model_path, text_path, out_path, source;
  std::vector<std::int32_t> layers;
  std::int64_t tokens = 2048, segment_tokens = 128;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool survey = false, check = false;
};

void add_options(CLI::App& app, options& o) {
  app.name("infkv-capture");
  app.option_defaults()->always_capture_default();
  app.add_option("--model", o.model_path, "GGUF model file (e.g. the path scripts/model.sh prints)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--text", o.text_path, "text file (e.g. the path scripts/kjv.sh prints)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--tokens", o.tokens, "tokens from the start of the text")->check(CLI::Range(16, 1 << 20));
  app.add_option("--layers", o.layers, "layers to record (comma list)")
      ->delimiter(',')
      ->check(infkv_tools::at_least(0));
  app.add_option("--segment-tokens", o.segment_tokens,
                 "segments: a new one starts at the first line break after this many tokens")
      ->check(infkv_tools::at_least(1));
  app.add_option("--source", o.source, "description of the text for the metadata (default: the file name)");
  app.add_option("--out", o.out_path, "trace file to write (.safetensors)")->check(infkv_tools::writable_file());
  app.add_option("--threads", o.threads, "llama.cpp threads")->check(infkv_tools::at_least(1, true, 1024));
  app.add_flag("--survey", o.survey, "print where each layer's attention goes");
  app.add_flag("--check", o.check, "compare the attention of the recorded layers with llama.cpp's output");
}

/// Checks the options that need no model; exits naming the flag.
void validate(const options& o) {
  if (o.out_path.empty() && !o.survey && !o.check) usage_error("--out: give a file to write (or --survey, --check)");
  if (o.check && o.layers.empty()) usage_error("--layers: give the layers to --check");
  if (!o.out_path.empty() && o.layers.empty()) usage_error("--layers: give the layers to record with --out");
}

/// Checks the options against the model and the text: the layers (sorted, each once) and the tokens.
std::vector<llama_token> validate(options& o, const llama_model* m) {
  const std::int32_t n_layer = llama_model_n_layer(m);
  for (auto l : o.layers)
    if (l >= n_layer)
      usage_error("--layers = " + std::to_string(l) + ": the model has " + std::to_string(n_layer) + " layers");
  std::sort(o.layers.begin(), o.layers.end());
  o.layers.erase(std::unique(o.layers.begin(), o.layers.end()), o.layers.end());
  auto ids = stream::tokenize_file(m, o.text_path, o.tokens);
  if (std::int64_t(ids.size()) < o.tokens)
    usage_error("--tokens = " + std::to_string(o.tokens) + ": the text has only " + std::to_string(ids.size()));
  return ids;
}

/// What one pass over the text recorded: Q, K and V rows of every kept layer (every layer for
/// --survey), llama.cpp's attention outputs of the chosen layers (--check), the attention scale.
struct recording {
  std::vector<infkv::llama_cpp::layer_rows> rows;
  output_capture outputs;
  std::int32_t head_dim = 0;
  double scale = 0;
  std::string arch;
};

/// Runs the model over `ids` with flash attention on, one sequence, batches of 512 tokens.
recording record(const options& o, const llama_model* m, const std::vector<llama_token>& ids) {
  const std::int32_t n_layer = llama_model_n_layer(m);
  recording rec;
  const std::uint32_t batch = 512;
  auto cp = stream::context_params(std::uint32_t((o.tokens + 255) / 256 * 256), batch, o.threads);
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  if (o.check) {
    rec.outputs.layers = o.layers, rec.outputs.rows.resize(o.layers.size());
    cp.cb_eval = &output_capture::callback, cp.cb_eval_user_data = &rec.outputs;
  }
  infkv::llama_cpp::graph_observer obs(n_layer, true);
  obs.install(cp);  // keeps calling the output capture
  stream::context_ptr ctx(llama_init_from_model(const_cast<llama_model*>(m), cp));
  if (!ctx) infkv_tools::engine_fail("infkv-capture: llama_init_from_model failed (n_ctx {})", cp.n_ctx);
  rec.rows.resize(std::size_t(n_layer));
  const auto keep = [&](std::int32_t l) {
    return o.survey || std::find(o.layers.begin(), o.layers.end(), l) != o.layers.end();
  };
  for (std::int64_t at = 0; at < o.tokens; at += batch) {
    const std::int64_t len = std::min<std::int64_t>(batch, o.tokens - at);
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
    if (!obs.error().empty()) infkv_tools::fail("{}", obs.error());
    if (rc != 0) infkv_tools::engine_fail("infkv-capture: llama_decode = {} at token {}", rc, at);
    for (std::int32_t l = 0; l < n_layer; ++l) {
      const auto& r = obs.layers()[std::size_t(l)];
      if (r.n_q != len || r.n_k != len || r.n_v != len || std::int64_t(r.v.size()) != r.n_k * r.n_head_kv * r.head_dim)
        infkv_tools::fail(
            "infkv-capture: layer {}: cb_eval saw {} query, {} key and {} value rows ({} values) "
            "for {} tokens; does this model name its nodes Qcur/Kcur/Vcur-<layer>?",
            l, r.n_q, r.n_k, r.n_v, r.v.size(), len);
      if (!keep(l)) continue;
      auto& out = rec.rows[std::size_t(l)];
      out.n_head = r.n_head, out.n_head_kv = r.n_head_kv, out.head_dim = r.head_dim;
      out.q.insert(out.q.end(), r.q.begin(), r.q.end()), out.k.insert(out.k.end(), r.k.begin(), r.k.end());
      out.v.insert(out.v.end(), r.v.begin(), r.v.end());
      out.n_q += len, out.n_k += len, out.n_v += len;
    }
  }
  rec.head_dim = obs.layers()[0].head_dim;
  rec.arch = infkv::llama_cpp::meta_string(m, "general.architecture").value_or("llama");
  const double meta_scale = infkv::llama_cpp::meta_number(m, rec.arch + ".attention.scale", 0.0);
  rec.scale = meta_scale > 0 ? meta_scale : 1.0 / std::sqrt(double(rec.head_dim));
  return rec;
}

/// --survey and --check tables on standard output.
void report(const options& o, const recording& rec) {
  if (o.survey) {
    fmt::print(
        "layer   sink   local     far  keys for 90%   (queries in the second half; sink: first 4 "
        "tokens, local: last 64)\n");
    for (std::size_t l = 0; l < rec.rows.size(); ++l) {
      const auto s = survey(rec.rows[l], rec.scale);
      fmt::print("{:5}  {:>5.3f}   {:>5.3f}   {:>5.3f}  {:>8.1f}\n", l, s.sink, s.local, s.far, s.keys90);
    }
  }
  if (o.check)
    for (std::size_t i = 0; i < o.layers.size(); ++i) {
      const auto& r = rec.rows[std::size_t(o.layers[i])];
      const auto& out = rec.outputs.rows[i];
      if (std::int64_t(out.size()) != o.tokens * r.n_head * r.head_dim)
        infkv_tools::fail("infkv-capture: --check: layer {}: kqv_out gave {} values, expected {}", o.layers[i],
                          out.size(), o.tokens * r.n_head * r.head_dim);
      fmt::print(
          "layer {}: attention output from the recorded Q, K, V vs llama.cpp's kqv_out: relative L2 "
          "error {:.2e}\n",
          o.layers[i], check_layer(r, out, rec.scale));
    }
}

/// Writes the chosen layers as a trace (--out): token ids, segments, Q/K/V, metadata.
void write_trace(const options& o, const llama_model* m, const std::vector<llama_token>& ids, recording& rec) {
  trace_io::trace t;
  t.n_tokens = o.tokens;
  t.token_ids.assign(ids.begin(), ids.begin() + o.tokens);
  std::int32_t seg = 0;
  std::int64_t seg_len = 0;
  for (std::int64_t i = 0; i < o.tokens; ++i) {
    t.segments.push_back(seg);
    if (++seg_len >= o.segment_tokens && stream::piece(m, ids[std::size_t(i)]).find('\n') != std::string::npos)
      ++seg, seg_len = 0;
  }
  for (auto l : o.layers) {
    auto& r = rec.rows[std::size_t(l)];
    t.layers.push_back({l, r.n_head, r.n_head_kv, r.head_dim, std::move(r.q), std::move(r.k), std::move(r.v)});
  }
  const auto rope = infkv::llama_cpp::model_rope(m);
  const auto str = [](double v) { return fmt::format("{:.9g}", v); };
  t.metadata = {
      {"format", "infkv-trace 1"},
      {"model", infkv::llama_cpp::meta_string(m, "general.name").value_or(rec.arch)},
      {"model_file", std::filesystem::path(o.model_path).filename().string()},
      {"architecture", rec.arch},
      {"source", o.source.empty() ? std::filesystem::path(o.text_path).filename().string() : o.source},
      {"n_layer", std::to_string(llama_model_n_layer(m))},
      {"n_head", std::to_string(t.layers.front().n_head)},
      {"n_head_kv", std::to_string(t.layers.front().n_head_kv)},
      {"head_dim", std::to_string(rec.head_dim)},
      {"attention_scale", str(rec.scale)},
      {"rope_type", rope.kind},
      {"rope_theta", str(rope.params.theta)},
      {"rope_dims", std::to_string(rope.params.dims)},
      {"rope_freq_scale", str(rope.params.freq_scale)},
      {"flash_attn", "on"},
      {"segments", "a new segment at the first line break after " + std::to_string(o.segment_tokens) + " tokens"},
      {"generator", "infkv-capture"},
  };
  const auto bytes = trace_io::to_safetensors(t);
  infkv_tools::write_file("--out", o.out_path, bytes);
  fmt::print("infkv-capture: wrote {}: {} tokens, layers {}, {} bytes\n", o.out_path, o.tokens, trace_io::layer_list(t),
             bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "infkv-capture: record post-RoPE Q, K and V of some layers of a llama.cpp model over a text, as a "
      "safetensors trace for infkv-compare --trace"};
  options o;
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  validate(o);
  try {
    const auto model = stream::load_model(o.model_path);
    const auto ids = validate(o, model.get());
    recording rec = record(o, model.get(), ids);
    report(o, rec);
    if (!o.out_path.empty()) write_trace(o, model.get(), ids, rec);
  } catch (const std::exception& e) {
    fmt::print(stderr, "infkv-capture: error: {}\n", e.what());
    return 2;
  }
  return 0;
}
