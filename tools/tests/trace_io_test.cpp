// Tests of the trace format (trace_io.hpp) and of a trace as infkv-compare's workload
// (compare_trace.hpp): round trips, and damaged files rejected with messages naming the field.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "compare_trace.hpp"
#include "trace_io.hpp"

namespace {

/// Values that f16 holds exactly: multiples of 1/64 in [-4, 4].
std::vector<float> exact_f16(std::size_t n, std::mt19937& g) {
  std::uniform_int_distribution<int> u(-256, 256);
  std::vector<float> x(n);
  for (auto& v : x) v = float(u(g)) / 64.0f;
  return x;
}

trace_io::trace make_trace(std::int64_t n, std::vector<std::int32_t> layers, std::int32_t hq, std::int32_t hkv,
                           std::int32_t d, unsigned seed = 7) {
  std::mt19937 g(seed);
  trace_io::trace t;
  t.n_tokens = n;
  t.metadata = {{"model", "test-model"}, {"source", "random"}};
  for (auto l : layers)
    t.layers.push_back({l, hq, hkv, d, exact_f16(std::size_t(n * hq * d), g), exact_f16(std::size_t(n * hkv * d), g),
                        exact_f16(std::size_t(n * hkv * d), g)});
  for (std::int64_t i = 0; i < n; ++i)
    t.segments.push_back(std::int32_t(i / 5)), t.token_ids.push_back(std::int32_t(1000 + i));
  return t;
}

/// The message of the infkv::error `f` throws; fails the test when it throws nothing or another type.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const infkv::error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("not an infkv::error: ", e.what());
  } catch (...) {
    FAIL("not an infkv::error");
  }
  FAIL("no exception");
  return {};
}

bool has(const std::string& msg, const std::string& part) { return msg.find(part) != std::string::npos; }

/// Valid layer tensors of layer `l` for hand-built files.
std::vector<trace_io::tensor_out> layer_tensors(std::int64_t n, std::int32_t l = 0, std::int64_t hq = 4,
                                                std::int64_t hkv = 2, std::int64_t d = 8) {
  const std::string p = "layer." + std::to_string(l) + ".";
  return {trace_io::f16_tensor(p + "q", {n, hq, d}, std::vector<float>(std::size_t(n * hq * d), 0.5f)),
          trace_io::f16_tensor(p + "k", {n, hkv, d}, std::vector<float>(std::size_t(n * hkv * d), 0.25f)),
          trace_io::f16_tensor(p + "v", {n, hkv, d}, std::vector<float>(std::size_t(n * hkv * d), 1.0f))};
}
const std::map<std::string, std::string> meta6{{"n_tokens", "6"}, {"layers", "0"}};

trace_io::trace parse(const std::string& bytes) {
  return trace_io::to_trace(trace_io::parse_safetensors(bytes, "t.st"));
}

}  // namespace

TEST_CASE("trace round trip keeps tensors, segments, tokens and metadata") {
  const auto t = make_trace(37, {3, 17}, 6, 2, 16);
  const auto bytes = trace_io::to_safetensors(t);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::uint8_t(bytes[std::size_t(i)]);
  CHECK(n % 8 == 0);
  CHECK(bytes[8] == '{');
  const auto r = parse(bytes);
  REQUIRE(r.layers.size() == 2);
  CHECK(r.n_tokens == 37);
  CHECK(r.segments == t.segments);
  CHECK(r.token_ids == t.token_ids);
  CHECK(r.metadata.at("model") == "test-model");
  CHECK(r.metadata.at("layers") == "3,17");
  CHECK(r.metadata.at("positions") == "0..36");
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(r.layers[i].layer == t.layers[i].layer);
    CHECK(r.layers[i].n_head == 6);
    CHECK(r.layers[i].n_head_kv == 2);
    CHECK(r.layers[i].head_dim == 16);
    CHECK(r.layers[i].q == t.layers[i].q);
    CHECK(r.layers[i].k == t.layers[i].k);
    CHECK(r.layers[i].v == t.layers[i].v);
  }
  CHECK(r.layer(17).k == t.layers[1].k);
  CHECK(has(error_of([&] { (void)r.layer(5); }), "layer = 5"));
}

TEST_CASE("safetensors reader converts F32 and BF16 and reads the layout of a hand-made file") {
  // 2 F32 values then 2 BF16 values (1.0 = 0x3f80, -2.0 = 0xc000), header written by hand.
  std::string header =
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}})";
  std::string bytes(8, '\0');
  bytes[0] = char(header.size());
  bytes += header;
  const float a[2] = {1.5f, -3.25f};
  bytes.append(reinterpret_cast<const char*>(a), 8);
  bytes += std::string("\x80\x3f\x00\xc0", 4);
  const auto f = trace_io::parse_safetensors(bytes, "hand.st");
  CHECK(f.floats("a") == std::vector<float>{1.5f, -3.25f});
  CHECK(f.floats("b") == std::vector<float>{1.0f, -2.0f});
  CHECK(f.tensors.at("b").shape == std::vector<std::int64_t>{1, 2});
  CHECK(has(error_of([&] { (void)f.ints("a"); }), "a.dtype = F32"));
}

TEST_CASE("16-bit tensors at odd offsets read correctly (the format does not align data)") {
  // fuzz_trace: the F16 reader loaded uint16 values from an odd address (UBSan: misaligned load).
  std::string header =
      R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[1,7]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[7,11]}})";
  if (header.size() % 2 == 1) header += ' ';  // data starts at an even offset, so "h" at an odd one
  std::string bytes(8, '\0');
  bytes[0] = char(header.size());
  bytes += header;
  bytes += std::string("\x00\x00\x3c\x00\xc0\x00\x38\x80\x3f\x00\xc0", 11);  // pad, 1 -2 0.5 (F16), 1 -2 (BF16)
  const auto f = trace_io::parse_safetensors(bytes, "odd.st");
  CHECK(f.floats("h") == std::vector<float>{1.0f, -2.0f, 0.5f});
  CHECK(f.floats("b") == std::vector<float>{1.0f, -2.0f});
}

TEST_CASE("truncated or corrupt files are rejected naming the field") {
  const auto good = trace_io::to_safetensors(make_trace(10, {0}, 4, 2, 8));
  CHECK(has(error_of([&] { parse(good.substr(0, 5)); }), "file size = 5"));
  CHECK(has(error_of([&] { parse(good.substr(0, 40)); }), "header length"));
  const auto cut = error_of([&] { parse(good.substr(0, good.size() - 1)); });
  CHECK(has(cut, "data_offsets"));
  CHECK(has(cut, "truncated"));
  std::string broken = good;
  broken[9] = '#';  // inside the JSON header
  CHECK(has(error_of([&] { parse(broken); }), "not valid JSON"));
  const auto empty = trace_io::to_safetensors({}, {});  // "{}" header: valid safetensors, not a trace
  CHECK(has(error_of([&] { parse(empty); }), "__metadata__.n_tokens is missing"));
}

TEST_CASE("wrong dtypes, shapes, sizes and missing pieces are rejected naming the field") {
  SUBCASE("wrong dtype of a layer tensor") {
    auto ts = layer_tensors(6);
    ts[0].dtype = "I16";  // same byte size as F16, so only the dtype is wrong
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.q.dtype = I16"));
  }
  SUBCASE("a dtype safetensors does not define") {
    auto ts = layer_tensors(6);
    ts[1].dtype = "F17";
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.k.dtype = \"F17\""));
  }
  SUBCASE("byte size disagrees with the shape") {
    auto ts = layer_tensors(6);
    ts[2].shape = {6, 2, 9};
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.v.data_offsets"));
  }
  SUBCASE("token count disagrees with n_tokens") {
    auto ts = layer_tensors(5);
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.q.shape = [5,4,8]"));
  }
  SUBCASE("query heads not a multiple of the KV heads") {
    auto ts = layer_tensors(6, 0, 3, 2);
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.q.shape = [6,3,8]"));
  }
  SUBCASE("k and v shapes differ") {
    auto ts = layer_tensors(6);
    ts[2] = trace_io::f16_tensor("layer.0.v", {6, 1, 8}, std::vector<float>(48, 1.0f));
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "layer.0.v.shape = [6,1,8]"));
  }
  SUBCASE("missing tensor") {
    auto ts = layer_tensors(6);
    ts.pop_back();
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "tensor layer.0.v is missing"));
  }
  SUBCASE("a layer tensor whose layer is not listed") {
    auto ts = layer_tensors(6);
    for (auto& t : layer_tensors(6, 4)) ts.push_back(t);
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "tensor layer.4."));
  }
  SUBCASE("bad metadata") {
    auto m = meta6;
    m["n_tokens"] = "six";
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(m, layer_tensors(6))); }), "__metadata__.n_tokens = six"));
    m = meta6, m["layers"] = "0,,1";
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(m, layer_tensors(6))); }), "__metadata__.layers = 0,,1"));
    m = meta6, m["positions"] = "10..15";
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(m, layer_tensors(6))); }),
              "__metadata__.positions = 10..15"));
  }
  SUBCASE("segments of the wrong length or decreasing") {
    auto ts = layer_tensors(6);
    ts.push_back(trace_io::i32_tensor("segments", {0, 0, 1}));
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "segments.shape = [3]"));
    ts.back() = trace_io::i32_tensor("segments", {0, 0, 1, 1, 0, 2});
    CHECK(has(error_of([&] { parse(trace_io::to_safetensors(meta6, ts)); }), "segments[4] = 0"));
  }
}

TEST_CASE("a trace layer becomes a workload with the same rows, GQA grouping and segments") {
  auto t = make_trace(40, {2, 9}, 6, 2, 8, 11);
  t.metadata["attention_scale"] = "0.125";  // folded in: queries * 0.125 * sqrt(8), the loop scales by 1/sqrt(8)
  const auto w = compare::to_workload(t, 9, 30, 256);
  CHECK(w.size() == 30);
  CHECK(w.cfg.kv_heads == 2);
  CHECK(w.cfg.group == 3);
  CHECK(w.cfg.head_dim == 8);
  const auto& l = t.layer(9);
  CHECK(std::equal(w.keys.begin(), w.keys.end(), l.k.begin()));
  CHECK(std::equal(w.values.begin(), w.values.end(), l.v.begin()));
  const float gain = float(0.125 * std::sqrt(8.0));
  for (std::size_t i = 0; i < w.queries.size(); i += 37) CHECK(w.queries[i] == doctest::Approx(l.q[i] * gain));
  CHECK(w.tokens[12].pos == 12);
  CHECK(w.tokens[12].segment == 2);  // segments i / 5 from make_trace
  CHECK(w.rounds.size() == 6);
  // Without recorded segments: fixed-size segments.
  t.segments.clear();
  const auto f = compare::to_workload(t, 2, 40, 16);
  CHECK(f.tokens[15].segment == 0);
  CHECK(f.tokens[16].segment == 1);
  CHECK(f.tokens[39].segment == 2);
  CHECK(has(error_of([&] { (void)compare::to_workload(t, 2, 41, 16); }), "--tokens = 41"));
  CHECK(has(error_of([&] { (void)compare::to_workload(t, 4, 10, 16); }), "layer = 4"));
  t.metadata["attention_scale"] = "-1";
  CHECK(has(error_of([&] { (void)compare::to_workload(t, 2, 10, 16); }), "attention_scale = -1"));
}
