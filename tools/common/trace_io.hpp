// Recorded attention traces: post-RoPE queries, keys and values of some layers of a real model
// over a stream of tokens, stored as safetensors (docs/traces.md). A safetensors file is an
// 8-byte little-endian header length N, N bytes of JSON (per tensor: dtype, shape,
// data_offsets into the data that follows; "__metadata__": strings only), then the data.
// Every read is validated: a bad file raises infkv::error naming the field and its value.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <infkv/dtype.hpp>
#include <infkv/error.hpp>

#include "errors.hpp"

namespace trace_io {

/// One tensor entry of a safetensors header.
struct tensor_info {
  std::string dtype;                 ///< safetensors dtype name ("F16", "F32", "BF16", "I32", ...)
  std::vector<std::int64_t> shape;   ///< dimensions, outermost first
  std::uint64_t begin = 0, end = 0;  ///< byte range within the data section
};

/// A parsed safetensors file: header and data section.
struct safetensors {
  std::string what;  ///< the file's name, for messages
  std::map<std::string, std::string> metadata;
  std::map<std::string, tensor_info> tensors;
  std::string data;

  /// The entry of tensor `name`; throws infkv::error when it is missing.
  const tensor_info& at(const std::string& name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end()) infkv_tools::fail("infkv: {}: tensor {} is missing", what, name);
    return it->second;
  }
  /// Tensor `name` (F32, F16 or BF16) converted to f32.
  std::vector<float> floats(const std::string& name) const {
    const auto& t = at(name);
    const infkv::dtype type = t.dtype == "F32"   ? infkv::dtype::f32
                              : t.dtype == "F16" ? infkv::dtype::f16
                                                 : infkv::dtype::bf16;
    INFKV_REQUIRE(t.dtype == "F32" || t.dtype == "F16" || t.dtype == "BF16", what + ": " + name + ".dtype", t.dtype,
                  "must be F16, F32 or BF16");
    std::vector<float> out((t.end - t.begin) / infkv::size_of(type));
    infkv::to_f32(type, data.data() + t.begin, out.data(), std::int64_t(out.size()));
    return out;
  }
  /// Tensor `name` (I32) as integers.
  std::vector<std::int32_t> ints(const std::string& name) const {
    const auto& t = at(name);
    INFKV_REQUIRE(t.dtype == "I32", what + ": " + name + ".dtype", t.dtype, "must be I32");
    std::vector<std::int32_t> out((t.end - t.begin) / 4);
    std::memcpy(out.data(), data.data() + t.begin, out.size() * 4);  // little-endian hosts only
    return out;
  }
};

/// Bytes per element of a safetensors dtype, or 0 for a name the format does not define.
inline std::uint64_t dtype_size(const std::string& d) {
  static const std::map<std::string, std::uint64_t> sizes{
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  const auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

/// Parses safetensors bytes; `what` names the source in messages.
inline safetensors parse_safetensors(const std::string& bytes, const std::string& what) {
  safetensors f;
  f.what = what;
  INFKV_REQUIRE(bytes.size() >= 8, what + ": file size", bytes.size(), "too short for the 8-byte header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint8_t(bytes[std::size_t(i)]);
  INFKV_REQUIRE(n >= 2 && n <= bytes.size() - 8, what + ": header length", n, "must be in [2, ", bytes.size() - 8,
                "] (the bytes after the length field): truncated file?");
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(n));
  } catch (const nlohmann::json::exception& e) {
    infkv_tools::fail("infkv: {}: header is not valid JSON: {}", what, e.what());
  }
  INFKV_REQUIRE(h.is_object(), what + ": header", h.type_name(), "must be a JSON object");
  f.data = bytes.substr(8 + n);
  const std::uint64_t size = f.data.size();
  for (const auto& [name, e] : h.items()) {
    if (name == "__metadata__") {
      INFKV_REQUIRE(e.is_object(), what + ": __metadata__", e.type_name(), "must be an object of strings");
      for (const auto& [k, v] : e.items()) {
        INFKV_REQUIRE(v.is_string(), what + ": __metadata__." + k, v.dump(), "must be a string");
        f.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string at = what + ": " + name;
    INFKV_REQUIRE(e.is_object(), at, e.dump(), "must be an object with dtype, shape and data_offsets");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      INFKV_REQUIRE(e.contains(key), at + "." + key, "missing", "every tensor needs dtype, shape and data_offsets");
    tensor_info t;
    INFKV_REQUIRE(e["dtype"].is_string() && dtype_size(e["dtype"].get<std::string>()) > 0, at + ".dtype",
                  e["dtype"].dump(), "is not a safetensors dtype");
    t.dtype = e["dtype"].get<std::string>();
    INFKV_REQUIRE(e["shape"].is_array(), at + ".shape", e["shape"].dump(), "must be an array of integers");
    std::uint64_t count = 1;
    for (const auto& d : e["shape"]) {
      INFKV_REQUIRE(d.is_number_unsigned() && d.get<std::uint64_t>() < (1ull << 40), at + ".shape", e["shape"].dump(),
                    "must be non-negative integers");
      t.shape.push_back(d.get<std::int64_t>());
      count *= d.get<std::uint64_t>();
      INFKV_REQUIRE(count < (1ull << 48), at + ".shape", e["shape"].dump(), "is too large");
    }
    const auto& o = e["data_offsets"];
    INFKV_REQUIRE(o.is_array() && o.size() == 2 && o[0].is_number_unsigned() && o[1].is_number_unsigned(),
                  at + ".data_offsets", o.dump(), "must be [begin, end], non-negative integers");
    t.begin = o[0].get<std::uint64_t>(), t.end = o[1].get<std::uint64_t>();
    INFKV_REQUIRE(t.begin <= t.end && t.end <= size, at + ".data_offsets", o.dump(),
                  "must satisfy begin <= end <= ", size, " (the data section's size): truncated file?");
    INFKV_REQUIRE(t.end - t.begin == count * dtype_size(t.dtype), at + ".data_offsets", o.dump(), "span ",
                  t.end - t.begin, " bytes but shape ", e["shape"].dump(), " of ", t.dtype, " needs ",
                  count * dtype_size(t.dtype));
    f.tensors[name] = t;
  }
  return f;
}

/// Reads and parses a safetensors file.
inline safetensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) infkv_tools::fail("infkv: trace = {}: cannot open the file", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_safetensors(bytes, path);
}

/// A tensor to write: name, safetensors dtype, shape and raw little-endian bytes.
struct tensor_out {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};

/// F16 tensor from f32 values (round to nearest even).
inline tensor_out f16_tensor(std::string name, std::vector<std::int64_t> shape, const std::vector<float>& x) {
  tensor_out t{std::move(name), "F16", std::move(shape), std::string(x.size() * 2, '\0')};
  infkv::from_f32(infkv::dtype::f16, x.data(), t.bytes.data(), std::int64_t(x.size()));
  return t;
}
/// I32 tensor.
inline tensor_out i32_tensor(std::string name, const std::vector<std::int32_t>& x) {
  tensor_out t{std::move(name), "I32", {std::int64_t(x.size())}, std::string(x.size() * 4, '\0')};
  std::memcpy(t.bytes.data(), x.data(), t.bytes.size());
  return t;
}

/// Safetensors bytes of `tensors` (data in the given order) with `metadata`; the header is padded
/// with spaces to a multiple of 8 bytes.
inline std::string to_safetensors(const std::map<std::string, std::string>& metadata,
                                  const std::vector<tensor_out>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::uint64_t at = 0;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
  }
  std::string header = h.dump();
  header.resize((header.size() + 7) / 8 * 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((std::uint64_t(header.size()) >> (8 * i)) & 0xff);
  out += header;
  for (const auto& t : tensors) out += t.bytes;
  return out;
}

/// Q, K and V of one layer: [n_tokens][heads][head_dim], f32.
struct layer_trace {
  std::int32_t layer = 0;
  std::int32_t n_head = 0, n_head_kv = 0, head_dim = 0;
  std::vector<float> q, k, v;
};

/// A recorded trace: token i has position i; `segments` per token (empty: none recorded).
struct trace {
  std::map<std::string, std::string> metadata;
  std::int64_t n_tokens = 0;
  std::vector<std::int32_t> segments;
  std::vector<std::int32_t> token_ids;  ///< optional: the model's token ids
  std::vector<layer_trace> layers;

  /// The layer recorded as model layer `l`; throws infkv::error naming the layers present.
  const layer_trace& layer(std::int32_t l) const {
    std::string have;
    for (const auto& x : layers) {
      if (x.layer == l) return x;
      if (!have.empty()) have += ',';
      have += std::to_string(x.layer);
    }
    infkv_tools::fail("infkv: layer = {}: not in the trace (layers {})", l, have);
  }
};

/// Comma list of the recorded layers, e.g. "3,17".
inline std::string layer_list(const trace& t) {
  std::string s;
  for (const auto& l : t.layers) {
    if (!s.empty()) s += ',';
    s += std::to_string(l.layer);
  }
  return s;
}

/// Safetensors bytes of a trace: F16 `layer.<l>.q|k|v`, I32 `segments` and `tokens` when present,
/// metadata of the trace plus n_tokens, layers and positions.
inline std::string to_safetensors(const trace& t) {
  std::vector<tensor_out> out;
  for (const auto& l : t.layers) {
    const std::string p = "layer." + std::to_string(l.layer) + ".";
    out.push_back(f16_tensor(p + "q", {t.n_tokens, l.n_head, l.head_dim}, l.q));
    out.push_back(f16_tensor(p + "k", {t.n_tokens, l.n_head_kv, l.head_dim}, l.k));
    out.push_back(f16_tensor(p + "v", {t.n_tokens, l.n_head_kv, l.head_dim}, l.v));
  }
  if (!t.segments.empty()) out.push_back(i32_tensor("segments", t.segments));
  if (!t.token_ids.empty()) out.push_back(i32_tensor("tokens", t.token_ids));
  auto meta = t.metadata;
  meta["n_tokens"] = std::to_string(t.n_tokens);
  meta["layers"] = layer_list(t);
  meta["positions"] = "0.." + std::to_string(t.n_tokens - 1);
  return to_safetensors(meta, out);
}

/// Reads a trace from parsed safetensors, checking every shape against the others and the metadata.
inline trace to_trace(const safetensors& f) {
  const std::string& w = f.what;
  const auto meta = [&](const std::string& k) -> const std::string& {
    const auto it = f.metadata.find(k);
    if (it == f.metadata.end()) infkv_tools::fail("infkv: {}: __metadata__.{} is missing", w, k);
    return it->second;
  };
  trace t;
  t.metadata = f.metadata;
  const std::string& n = meta("n_tokens");
  INFKV_REQUIRE(!n.empty() && n.size() < 12 &&
                    std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }) && std::stoll(n) > 0,
                w + ": __metadata__.n_tokens", n, "must be a positive integer");
  t.n_tokens = std::stoll(n);
  const std::string positions = "0.." + std::to_string(t.n_tokens - 1);
  if (f.metadata.count("positions"))
    INFKV_REQUIRE(meta("positions") == positions, w + ": __metadata__.positions", meta("positions"), "must be ",
                  positions, " (token i at position i)");
  std::vector<std::int32_t> listed;
  const std::string& layers = meta("layers");
  for (std::size_t at = 0; at <= layers.size();) {
    const std::size_t comma = std::min(layers.find(',', at), layers.size());
    const std::string item = layers.substr(at, comma - at);
    INFKV_REQUIRE(!item.empty() && item.size() < 8 &&
                      std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; }),
                  w + ": __metadata__.layers", layers, "must be a comma list of layer numbers");
    INFKV_REQUIRE(std::find(listed.begin(), listed.end(), std::stoi(item)) == listed.end(), w + ": __metadata__.layers",
                  layers, "lists layer ", item, " twice");
    listed.push_back(std::stoi(item));
    at = comma + 1;
  }
  for (const auto l : listed) {
    const std::string p = "layer." + std::to_string(l) + ".";
    const auto& q = f.at(p + "q");
    const auto& k = f.at(p + "k");
    const auto& v = f.at(p + "v");
    for (const auto* x : {&q, &k, &v}) {
      const std::string name = p + (x == &q ? "q" : x == &k ? "k" : "v");
      INFKV_REQUIRE(x->shape.size() == 3 && x->shape[0] == t.n_tokens && x->shape[1] > 0 && x->shape[2] > 0,
                    w + ": " + name + ".shape", nlohmann::json(x->shape).dump(), "must be [n_tokens = ", t.n_tokens,
                    ", heads > 0, head_dim > 0]");
    }
    INFKV_REQUIRE(k.shape == v.shape, w + ": " + p + "v.shape", nlohmann::json(v.shape).dump(), "must equal ", p,
                  "k.shape ", nlohmann::json(k.shape).dump());
    INFKV_REQUIRE(q.shape[2] == k.shape[2], w + ": " + p + "q.shape", nlohmann::json(q.shape).dump(),
                  "head_dim must equal that of ", p, "k (", k.shape[2], ")");
    INFKV_REQUIRE(q.shape[1] % k.shape[1] == 0, w + ": " + p + "q.shape", nlohmann::json(q.shape).dump(),
                  "query heads must be a multiple of the KV heads (", k.shape[1], ")");
    layer_trace lt{l,
                   std::int32_t(q.shape[1]),
                   std::int32_t(k.shape[1]),
                   std::int32_t(k.shape[2]),
                   f.floats(p + "q"),
                   f.floats(p + "k"),
                   f.floats(p + "v")};
    t.layers.push_back(std::move(lt));
  }
  for (const auto& [name, info] : f.tensors)
    if (name.rfind("layer.", 0) == 0) {
      const auto dot = name.find('.', 6);
      const std::string l = name.substr(6, dot == std::string::npos ? std::string::npos : dot - 6);
      INFKV_REQUIRE(std::any_of(listed.begin(), listed.end(), [&](auto x) { return std::to_string(x) == l; }),
                    w + ": tensor " + name, nlohmann::json(info.shape).dump(),
                    "its layer is not in __metadata__.layers (", meta("layers"), ")");
    }
  for (const char* name : {"segments", "tokens"})
    if (f.tensors.count(name)) {
      const auto& s = f.at(name);
      INFKV_REQUIRE(s.shape.size() == 1 && s.shape[0] == t.n_tokens, w + ": " + name + ".shape",
                    nlohmann::json(s.shape).dump(), "must be [n_tokens = ", t.n_tokens, "]");
      (std::string(name) == "segments" ? t.segments : t.token_ids) = f.ints(name);
    }
  for (std::size_t i = 1; i < t.segments.size(); ++i)
    INFKV_REQUIRE(t.segments[i] >= t.segments[i - 1], w + ": segments[" + std::to_string(i) + "]", t.segments[i],
                  "segments must not decrease (previous ", t.segments[i - 1], ")");
  return t;
}

/// Reads a trace file.
inline trace read_trace(const std::string& path) { return to_trace(read_safetensors(path)); }

}  // namespace trace_io
