// A real image through llama.cpp's mtmd library into infkv's budgeted block-wise prefill:
// mtmd_init_from_file with a text model and a vision projector GGUF, the image read by mtmd's
// helper, mtmd_tokenize, mtmd_encode_chunk for every image chunk, then the text and image chunks
// prefilled by infkv::llama_cpp::prefill (keydiff) with a budget smaller than the input. After
// every block the session's bookkeeping is checked against llama_memory_seq_pos_min/max. On an
// M-RoPE model (Qwen2-VL) an image's rows get mtmd's decoder positions (t, y, x, z; one t for the
// whole image) and the session runs in keep mode: after every block each image must be held
// whole or not at all (llama_memory_seq_rm removes by t), and the cache at most the budget.
//
// Usage: infkv_mtmd_prefill_check TEXT_MODEL.gguf MMPROJ.gguf IMAGE [N_IMAGES]
// (random-weight projectors: scripts/mm_projector.py, for the Gemma 3 270M text model or, with
// --type qwen2vl, for make_tiny_llama.py --arch qwen2vl).
// Exit status 0 when every check holds; a bad argument fails with a message naming it.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <infkv/llama_cpp.hpp>
#include <infkv/llama_cpp/mtmd.hpp>

namespace lc = infkv::llama_cpp;

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

void require_file(const char* arg, const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) fail(std::string(arg) + " = " + path + ": no such file");
}

/// One decoded input chunk: token ids or a copy of the encoder's embedding rows.
struct owned_chunk {
  std::vector<llama_token> tokens;
  std::vector<float> embd;
  std::vector<llama_pos> positions;  // M-RoPE: 4 per row, section-major (t, y, x, z)
  std::int64_t n_tokens = 0, n_pos = 0;
  bool non_causal = false;
};

int run(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    std::fprintf(stderr, "usage: %s TEXT_MODEL.gguf MMPROJ.gguf IMAGE [N_IMAGES]\n", argv[0]);
    return 2;
  }
  const std::string model_path = argv[1], mmproj_path = argv[2], image_path = argv[3];
  int n_images = 2;
  if (argc == 5) {
    try {
      n_images = std::stoi(argv[4]);
    } catch (const std::exception&) {
      fail(std::string("N_IMAGES = ") + argv[4] + ": not a number");
    }
    if (n_images < 1 || n_images > 16) fail(std::string("N_IMAGES = ") + argv[4] + ": must be in [1, 16]");
  }
  require_file("TEXT_MODEL", model_path);
  require_file("MMPROJ", mmproj_path);
  require_file("IMAGE", image_path);

  auto model = lc::load_model(model_path, "TEXT_MODEL");
  const int n_embd = llama_model_n_embd_inp(model.get());

  auto mp = mtmd_context_params_default();
  mp.use_gpu = false;
  mp.n_threads = 2;
  mp.print_timings = false;
  mp.warmup = false;
  lc::mtmd::context_ptr mctx(mtmd_init_from_file(mmproj_path.c_str(), model.get(), mp));
  if (!mctx)
    fail("MMPROJ = " + mmproj_path + ": mtmd_init_from_file refused it with TEXT_MODEL = " + model_path +
         " (llama.cpp's log above says why, e.g. a projection width other than the model's " + std::to_string(n_embd) +
         ")");
  if (!mtmd_support_vision(mctx.get())) fail("MMPROJ = " + mmproj_path + ": has no vision encoder");

  // The helper returns a video handle for a video file; an image gives just the bitmap.
  auto wrap = mtmd_helper_bitmap_init_from_file(mctx.get(), image_path.c_str(), false, mtmd_helper_init_opt_default());
  lc::mtmd::bitmap_ptr bitmap(wrap.bitmap);
  if (wrap.video_ctx != nullptr) {
    mtmd_helper_video_free(wrap.video_ctx);
    fail("IMAGE = " + image_path + ": mtmd reads it as a video; give an image");
  }
  if (!bitmap) fail("IMAGE = " + image_path + ": mtmd cannot read it as an image");
  std::printf("image: %u x %u\n", mtmd_bitmap_get_nx(bitmap.get()), mtmd_bitmap_get_ny(bitmap.get()));

  // The same image n_images times between pieces of text, one marker each.
  const std::string marker = mtmd_default_marker();
  const bool mrope = lc::pos_per_embd(model.get()) > 1;
  std::string prompt = mrope ? "Here are some pictures." : "<start_of_turn>user\nHere are some pictures.";
  for (int i = 0; i < n_images; ++i) prompt += "\nPicture " + std::to_string(i + 1) + ": " + marker;
  prompt += mrope ? "\nWhat do they show?" : "\nWhat do they show?<end_of_turn>\n<start_of_turn>model\n";
  std::vector<const mtmd_bitmap*> bitmaps(std::size_t(n_images), bitmap.get());
  const mtmd_input_text text{
      .text = prompt.c_str(), .text_len = prompt.size(), .add_special = true, .parse_special = true};
  lc::mtmd::chunks_ptr chunks(mtmd_input_chunks_init());
  if (const int rc = mtmd_tokenize(mctx.get(), chunks.get(), &text, bitmaps.data(), bitmaps.size()); rc != 0)
    fail("mtmd_tokenize returned " + std::to_string(rc));

  std::vector<owned_chunk> owned;
  std::int64_t image_tokens = 0;
  llama_pos n_past = 0;  // the stream position the next chunk starts at (mtmd's n_past)
  for (std::size_t i = 0; i < mtmd_input_chunks_size(chunks.get()); ++i) {
    const mtmd_input_chunk* c = mtmd_input_chunks_get(chunks.get(), i);
    owned_chunk o;
    switch (mtmd_input_chunk_get_type(c)) {
      case MTMD_INPUT_CHUNK_TYPE_TEXT: {
        std::size_t n = 0;
        const llama_token* t = mtmd_input_chunk_get_tokens_text(c, &n);
        o.tokens.assign(t, t + n);
        o.n_tokens = std::int64_t(n);
        n_past += llama_pos(n);
        std::printf("chunk %zu: text, %zu tokens\n", i, n);
        break;
      }
      case MTMD_INPUT_CHUNK_TYPE_IMAGE: {
        o.n_tokens = std::int64_t(mtmd_input_chunk_get_n_tokens(c));
        const llama_pos n_pos = mtmd_input_chunk_get_n_pos(c);
        if (const int rc = mtmd_encode_chunk(mctx.get(), c); rc != 0)
          fail("mtmd_encode_chunk (chunk " + std::to_string(i) + ") returned " + std::to_string(rc));
        const float* e = mtmd_get_output_embd(mctx.get());
        o.embd.assign(e, e + o.n_tokens * n_embd);
        o.non_causal = mtmd_decode_use_non_causal(mctx.get(), c);
        const auto [lo, hi] = std::minmax_element(o.embd.begin(), o.embd.end());
        std::printf("chunk %zu: image, %lld tokens x %d floats (n_pos %d, non-causal %s), values in [%.3f, %.3f]\n", i,
                    static_cast<long long>(o.n_tokens), n_embd, n_pos, o.non_causal ? "yes" : "no", *lo, *hi);
        if (mrope) {  // mtmd's decoder positions, laid out as llama_batch.pos wants them
          o.positions = lc::mtmd::image_positions(c, n_past);
          o.n_pos = n_pos;
          const auto n = std::size_t(o.n_tokens);  // section-major: t, y, x, z
          std::printf("  M-RoPE: rows at t = %d, x in [%d, %d], y in [%d, %d]\n", o.positions[0], o.positions[2 * n],
                      o.positions[3 * n - 1], o.positions[n], o.positions[2 * n - 1]);
        } else if (n_pos != o.n_tokens) {
          fail("chunk " + std::to_string(i) + ": n_pos != n_tokens on a model without M-RoPE");
        }
        n_past += n_pos;
        image_tokens += o.n_tokens;
        break;
      }
      default: fail("chunk " + std::to_string(i) + ": not text or image");
    }
    owned.push_back(std::move(o));
  }

  std::vector<lc::chunk> in;
  std::int64_t n_input = 0, largest_image = 0;
  for (const auto& o : owned) {
    if (o.embd.empty()) {
      in.push_back(lc::text_chunk(o.tokens));
    } else {
      auto c = lc::embd_chunk(o.embd, o.n_tokens, infkv::modality::image, o.positions, o.n_pos);
      c.non_causal = o.non_causal;
      in.push_back(c);
      largest_image = std::max(largest_image, o.n_tokens);
    }
    n_input += o.n_tokens;
  }
  std::vector<std::int64_t> start_of(in.size() + 1, 0);
  for (std::size_t c = 0; c < in.size(); ++c) start_of[c + 1] = start_of[c] + in[c].size();
  std::printf("input: %zu chunks, %lld tokens (%lld image tokens), text model n_embd_inp %d\n", in.size(),
              static_cast<long long>(n_input), static_cast<long long>(image_tokens), n_embd);

  // One block holds one whole image (non-causal chunks are never split); the budget is half the input.
  const infkv::block_prefill sched{.block = largest_image + 16, .budget = std::max<std::int64_t>(n_input / 2, 32)};
  if (sched.budget >= n_input) fail("the input (" + std::to_string(n_input) + " tokens) does not exceed the budget");
  lc::session s(model.get());
  auto cp = llama_context_default_params();
  cp.n_ctx = std::uint32_t(sched.peak() + 64);
  cp.n_batch = cp.n_ctx;
  cp.n_ubatch = std::uint32_t(sched.block);
  cp.n_threads = 2;
  cp.n_threads_batch = 2;
  cp.no_perf = true;
  s.attach(cp);
  lc::context_ptr ctx(llama_init_from_model(model.get(), cp));
  if (!ctx) fail("llama_init_from_model failed for TEXT_MODEL = " + model_path);
  s.bind(ctx.get());
  llama_memory_t mem = llama_get_memory(ctx.get());
  std::printf("prefill: block %lld, budget %lld, n_ctx %u, n_ubatch %u\n", static_cast<long long>(sched.block),
              static_cast<long long>(sched.budget), cp.n_ctx, cp.n_ubatch);

  int mismatches = 0;
  const auto res = lc::prefill(s, in, infkv::keydiff{}, sched,
                               {.sinks = 4, .on_block = [&](const lc::block_report& r) {
                                  const llama_pos lo = llama_memory_seq_pos_min(mem, 0);
                                  const llama_pos hi = llama_memory_seq_pos_max(mem, 0);
                                  const auto [tlo, thi] = std::minmax_element(
                                      s.tokens().begin(), s.tokens().end(),
                                      [](const infkv::token& a, const infkv::token& b) { return a.pos < b.pos; });
                                  const std::int64_t want_lo = tlo->pos, want_hi = thi->pos;
                                  const bool same = lo == want_lo && hi == want_hi;
                                  if (!same || s.size() > sched.budget) ++mismatches;
                                  // What is held of each image (chunk c is segment c of the empty session).
                                  std::vector<std::int64_t> held(in.size(), 0);
                                  for (const auto& t : s.tokens()) ++held[std::size_t(t.segment)];
                                  std::string images;
                                  for (std::size_t c = 0; c < in.size(); ++c) {
                                    if (!in[c].is_embd() || r.range.end < start_of[c + 1]) continue;
                                    const bool whole = held[c] == in[c].size(), none = held[c] == 0;
                                    // Plain RoPE evicts per token; on M-RoPE part of an image cannot be removed.
                                    images += whole ? " whole" : none ? " gone" : mrope ? " PARTIAL" : " part";
                                    if (mrope && !whole && !none) ++mismatches;
                                  }
                                  std::printf(
                                      "block %lld: input [%lld, %lld), held %lld after decode, evicted %lld, kept "
                                      "%lld; positions llama [%d, %d], session [%lld, %lld] %s; images decoded:%s\n",
                                      static_cast<long long>(r.index), static_cast<long long>(r.range.begin),
                                      static_cast<long long>(r.range.end), static_cast<long long>(r.decoded),
                                      static_cast<long long>(r.eviction.evicted), static_cast<long long>(s.size()), lo,
                                      hi, static_cast<long long>(want_lo), static_cast<long long>(want_hi),
                                      same ? "equal" : "DIFFERENT", images.c_str());
                                  s.verify();
                                }});
  if (!res.ok())
    fail("prefill stopped: llama_decode returned " + std::to_string(res.status) + " in block " +
         std::to_string(res.failed_block) + ", chunk " + std::to_string(res.failed_chunk));
  std::printf("prefill: %lld blocks, %lld tokens decoded, %lld evicted, peak %lld, kept %lld\n",
              static_cast<long long>(res.blocks_done), static_cast<long long>(res.decoded),
              static_cast<long long>(res.evicted), static_cast<long long>(res.peak), static_cast<long long>(s.size()));
  // Decoding goes on after the evictions: three more text tokens after the newest cached position.
  const std::vector<llama_token> more(
      owned.front().tokens.begin(), owned.front().tokens.begin() + std::min<std::ptrdiff_t>(3, owned.front().n_tokens));
  const std::int64_t before = s.size();
  const std::int32_t rc = s.decode(more);
  std::printf("decode after the prefill: %zu text tokens at positions from %lld: %s\n", more.size(),
              static_cast<long long>(s.tokens().back().pos) - std::int64_t(more.size()) + 1,
              rc == 0 ? "ok" : ("llama_decode returned " + std::to_string(rc)).c_str());
  // Plain RoPE keeps exactly the budget; M-RoPE at most (a whole image may not fit what is left).
  const bool kept_ok = mrope ? before <= sched.budget && before > 0 : before == sched.budget;
  if (mismatches != 0 || res.decoded != n_input || !kept_ok || res.peak > sched.peak() || rc != 0 ||
      s.size() != before + std::int64_t(more.size())) {
    std::printf("FAILED\n");
    return 1;
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "infkv_mtmd_prefill_check: %s\n", e.what());
    return 1;
  }
}
