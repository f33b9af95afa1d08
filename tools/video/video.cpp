// infkv-video: a real video (or a folder of images, or one image) streamed frame by frame through
// llama.cpp's mtmd (vision projector + text model) into a KV cache bounded by an infkv policy:
// each frame is tokenized and encoded by mtmd, then prefilled by infkv::llama_cpp::prefill in
// frame-aligned blocks with a fixed budget. Text facts (the needle test's statements, several
// people per kind) are stated between the first frames; after N further frames every fact is
// asked back on a copy of the sequence (forced choice among the kind's values, and a greedy
// answer), so that the stream itself is never changed. Prints per frame what the cache holds by
// modality, what was evicted, memory and the time split; writes the records as CSV and JSON.
// See --help.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <infkv/llama_cpp/mtmd.hpp>
#include <infkv/version.hpp>

#include "ask.hpp"
#include "cli_util.hpp"
#include "needles.hpp"
#include "policy_options.hpp"
#include "runner.hpp"

namespace {

namespace lc = infkv::llama_cpp;
using infkv_tools::at_least;
using infkv_tools::fail;

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "infkv-video: error: " << msg << '\n';
  std::exit(2);
}

struct options {
  std::string model, mmproj, media, json, csv;
  std::vector<std::string> policy_names;
  stream::settings s;
  std::int64_t block = 0;  ///< 0: the largest frame's tokens + its text
  std::int64_t frames = 0, facts = 12, people = 3, gen = 8, progress = 10;
  std::vector<std::int64_t> ask_after{10, 50, 200};
  double fps = 4.0;
  std::uint64_t seed = 1;
  bool list = false;
};

void add_options(CLI::App& app, options& o) {
  const auto pos = at_least(1), nonneg = at_least(0);
  app.add_option("--model", o.model, "text model GGUF (e.g. Gemma 3 270M: scripts/model.sh gemma3)")
      ->check(CLI::ExistingFile);
  app.add_option("--mmproj", o.mmproj, "the vision projector GGUF for --model (e.g. scripts/mm_projector.py)")
      ->check(CLI::ExistingFile);
  app.add_option("--media", o.media,
                 "a video file (frames read by mtmd's helper through ffmpeg), a folder of images (in name order) "
                 "or one image")
      ->check(CLI::ExistingPath);
  app.add_option("--policy", o.policy_names,
                 "policies to run in turn, each on a fresh context (comma list; default keydiff; full: no "
                 "eviction, a context of the model's trained length; see --list-policies)")
      ->delimiter(',');
  stream::add_policy_options(app, o.s);
  app.add_option("--block", o.block,
                 "tokens decoded between two evictions (0: one frame with its text; must hold a frame)")
      ->check(nonneg);
  app.add_option("--frames", o.frames, "stop after this many frames (0: --facts + the largest --ask-after)")
      ->check(nonneg);
  app.add_option("--fps", o.fps, "frames taken per second of a video")->check(at_least(0.01, false, 1000));
  app.add_option("--facts", o.facts, "text facts stated between the first frames, one after each (0: none)")
      ->check(at_least(0, true, 16));
  app.add_option("--people", o.people, "facts of one kind, about different people with different values")
      ->check(at_least(1, true, stream::max_people_per_kind()));
  app.add_option("--ask-after", o.ask_after,
                 "ask every fact back after this many further frames (comma list; frames after the last fact)")
      ->delimiter(',')
      ->check(pos);
  app.add_option("--gen", o.gen, "answer tokens decoded greedily")->check(at_least(1, true, 256));
  app.add_option("--seed", o.seed, "draws the facts' people and values");
  app.add_option("--progress", o.progress, "a line per N frames (0: none; checkpoints and the summary always)")
      ->check(nonneg);
  app.add_option("--json", o.json, "write the per-frame records and answers as JSON to FILE")
      ->check(infkv_tools::writable_file());
  app.add_option("--csv", o.csv, "write the per-frame records as CSV to FILE")->check(infkv_tools::writable_file());
  app.add_flag("--list-policies", o.list, "list the policies and exit");
}

std::vector<stream::policy_info> check(options& o) {
  if (o.model.empty()) usage_error("--model is required");
  if (o.mmproj.empty()) usage_error("--mmproj is required");
  if (o.media.empty()) usage_error("--media is required");
  if (const std::string why = infkv_tools::knobs_problem(o.s); !why.empty()) usage_error(why);
  if (o.s.archive_bits > 0 || o.s.recall_tokens > 0 || o.s.prefetch_tokens > 0)
    usage_error(
        fmt::format("--archive = {}, --recall = {}, --prefetch = {}: infkv-video does not archive yet "
                    "(infkv-stream does)",
                    o.s.archive_bits, o.s.recall_tokens, o.s.prefetch_tokens));
  std::sort(o.ask_after.begin(), o.ask_after.end());
  if (std::adjacent_find(o.ask_after.begin(), o.ask_after.end()) != o.ask_after.end())
    usage_error(fmt::format("--ask-after = {}: a count is listed twice", fmt::join(o.ask_after, ",")));
  if (o.facts == 0) o.ask_after.clear();
  if (o.frames == 0) o.frames = o.facts + (o.ask_after.empty() ? 10 : o.ask_after.back());
  if (o.facts > o.frames) usage_error(fmt::format("--facts = {}: more than --frames = {}", o.facts, o.frames));
  if (!o.ask_after.empty() && o.facts + o.ask_after.back() > o.frames)
    usage_error(fmt::format("--ask-after = {}: {} facts + {} frames exceed --frames = {}", fmt::join(o.ask_after, ","),
                            o.facts, o.ask_after.back(), o.frames));
  std::vector<stream::policy_info> chosen;
  std::set<std::string> seen;
  for (const auto& n : o.policy_names.empty() ? std::vector<std::string>{"keydiff"} : o.policy_names) {
    const auto p = stream::find_policy(n);
    if (!p || p->k == stream::kind::recompute || p->k == stream::kind::context_shift)
      usage_error("--policy = " + n + ": not a policy infkv-video runs (see --list-policies)");
    if (seen.insert(n).second) chosen.push_back(*p);
  }
  for (const auto& p : chosen)
    if (const std::string why = infkv_tools::budget_problem(p.k, o.s.budget, o.s); !why.empty()) usage_error(why);
  return chosen;
}

std::string version_line() { return fmt::format("infkv-video {} (llama.cpp {})", infkv::version, llama_version()); }

using lc::mtmd::bitmap_ptr;

/// mtmd's error messages since the last mtmd_errors().
std::string& mtmd_log() {
  static std::string log;
  return log;
}

/// mtmd's error messages since the last call, on one line (empty when none), and forgets them.
std::string mtmd_errors() {
  std::string out;
  for (char c : std::exchange(mtmd_log(), {})) {
    if (c == '\n') {
      if (!out.empty() && out.back() != ' ') out += "; ";
    } else {
      out += c;
    }
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out.empty() ? out : " (mtmd: " + out + ")";
}

/// Frames of --media in order: a video's frames at --fps (with the helper's timestamp texts), the
/// images of a folder by name, or one image. Anything mtmd cannot read as an image or a video is
/// refused naming --media.
class media_reader {
 public:
  media_reader(mtmd_context* mctx, const std::string& path, double fps) : mctx_(mctx), path_(path), fps_(fps) {
    namespace fs = std::filesystem;
    if (fs::is_directory(path)) {
      for (const auto& e : fs::directory_iterator(path))
        if (e.is_regular_file()) files_.push_back(e.path().string());
      std::sort(files_.begin(), files_.end());
      if (files_.empty()) fail("--media = {}: the folder holds no files", path);
      kind_ = infkv::modality::image;
      return;
    }
    auto opt = mtmd_helper_init_opt_default();
    opt.video_params.fps_target = float(fps);
    auto w = mtmd_helper_bitmap_init_from_file(mctx_, path.c_str(), false, opt);
    bitmap_ptr b(w.bitmap);
    lc::mtmd::video_ptr lazy(w.video_ctx);
    if (!b)
      fail(
          "--media = {}: mtmd reads it neither as an image nor as a video (an unknown format, or a video without "
          "frames){}",
          path, mtmd_errors());
    if (mtmd_bitmap_is_audio(b.get())) fail("--media = {}: an audio file, not an image or a video", path);
    if (!lazy) {  // one image
      files_.push_back(path);
      kind_ = infkv::modality::image;
      return;
    }
    b.reset(), lazy.reset();  // a video: read it from the file (seekable) rather than from a copy in memory
    auto vp = mtmd_helper_video_init_params_default();
    vp.fps_target = float(fps);
    video_.reset(mtmd_helper_video_init(mctx_, path.c_str(), vp));
    if (!video_)
      fail("--media = {}: mtmd_helper_video_init failed (needs ffmpeg and ffprobe on PATH){}", path, mtmd_errors());
    kind_ = infkv::modality::video;
  }

  /// The next frame (and the text to put before it, e.g. a timestamp), or false at the end.
  bool next(bitmap_ptr& frame, std::string& text) {
    frame.reset(), text.clear();
    if (!video_) {
      if (at_ == files_.size()) return false;
      const std::string& f = files_[at_++];
      auto w = mtmd_helper_bitmap_init_from_file(mctx_, f.c_str(), false, mtmd_helper_init_opt_default());
      frame.reset(w.bitmap);
      if (w.video_ctx != nullptr) {
        frame.reset();
        mtmd_helper_video_free(w.video_ctx);
        fail("--media = {}: {} is a video; a folder must hold images", path_, f);
      }
      if (!frame || mtmd_bitmap_is_audio(frame.get()))
        fail("--media = {}: {} is not an image mtmd reads{}", path_, f, mtmd_errors());
      return true;
    }
    for (;;) {
      mtmd_bitmap* b = nullptr;
      char* t = nullptr;
      const std::int32_t rc = mtmd_helper_video_read_next(video_.get(), &b, &t);
      if (rc == -1) return false;
      if (rc != 0) {
        if (read_ == 0)
          fail("--media = {}: the video has no frame mtmd can read (mtmd_helper_video_read_next = {}){}", path_, rc,
               mtmd_errors());
        fail("--media = {}: reading frame {} failed (mtmd_helper_video_read_next = {}){}", path_, read_ + 1, rc,
             mtmd_errors());
      }
      if (t != nullptr) {
        text += t;
        std::free(t);
      }
      if (b != nullptr) {
        frame.reset(b);
        ++read_;
        return true;
      }
    }
  }
  infkv::modality kind() const { return kind_; }
  std::string describe() const {
    if (!video_) return fmt::format("{} image{}", files_.size(), files_.size() == 1 ? "" : "s");
    const auto i = mtmd_helper_video_get_info(video_.get());
    return fmt::format("video {} x {}, {:.2f} frames/s taken, {}", i.width, i.height, i.fps,
                       i.n_frames > 0 ? fmt::format("about {} frames", i.n_frames) : "frame count unknown");
  }

 private:
  mtmd_context* mctx_;
  std::string path_;
  double fps_;
  std::vector<std::string> files_;
  std::size_t at_ = 0;
  lc::mtmd::video_ptr video_;
  std::int64_t read_ = 0;
  infkv::modality kind_ = infkv::modality::image;
};

/// The input of one frame as owned chunks: mtmd's text and image chunks of the frame (its
/// timestamp text first), then the fact stated after it, if any.
struct frame_input {
  lc::mtmd::chunks_ptr mtmd;                    // what the chunks came from
  std::vector<const mtmd_input_chunk*> source;  // per chunk (null for the fact)
  std::vector<std::vector<llama_token>> tokens;
  std::vector<std::vector<float>> embd;
  std::vector<std::vector<llama_pos>> positions;  // place()
  std::vector<lc::chunk> chunks;
  std::int64_t n_tokens = 0, frame_tokens = 0;
  double encode_seconds = 0;
};

frame_input make_frame(mtmd_context* mctx, const llama_model* m, const mtmd_bitmap* frame, const std::string& before,
                       const std::vector<llama_token>& fact, infkv::modality kind) {
  frame_input f;
  const std::string text = before + mtmd_default_marker();
  const mtmd_input_text in{.text = text.c_str(), .text_len = text.size(), .add_special = false, .parse_special = true};
  f.mtmd.reset(mtmd_input_chunks_init());
  mtmd_input_chunks* chunks = f.mtmd.get();
  const mtmd_bitmap* bitmaps[] = {frame};
  if (const int rc = mtmd_tokenize(mctx, chunks, &in, bitmaps, 1); rc != 0)
    fail("mtmd_tokenize of a frame returned {}", rc);
  const std::int64_t n_embd = llama_model_n_embd_inp(m);
  const std::size_t n_chunks = mtmd_input_chunks_size(chunks) + 1;
  f.tokens.reserve(n_chunks), f.embd.reserve(n_chunks);  // the chunks point into them
  const bool mrope = lc::pos_per_embd(m) > 1;
  const auto add_text = [&](const llama_token* t, std::size_t n, const mtmd_input_chunk* c) {
    f.tokens.emplace_back(t, t + n);
    f.chunks.push_back(lc::text_chunk(f.tokens.back()));
    f.source.push_back(c);
  };
  for (std::size_t i = 0; i < mtmd_input_chunks_size(chunks); ++i) {
    const mtmd_input_chunk* c = mtmd_input_chunks_get(chunks, i);
    const auto type = mtmd_input_chunk_get_type(c);
    if (type == MTMD_INPUT_CHUNK_TYPE_TEXT) {
      std::size_t n = 0;
      const llama_token* t = mtmd_input_chunk_get_tokens_text(c, &n);
      if (n > 0) add_text(t, n, c);
      continue;
    }
    if (type != MTMD_INPUT_CHUNK_TYPE_IMAGE) fail("mtmd_tokenize gave a frame a chunk that is neither text nor image");
    const auto n = std::int64_t(mtmd_input_chunk_get_n_tokens(c));
    if (!mrope && mtmd_input_chunk_get_n_pos(c) != n)
      fail("--model: mtmd places an image's {} tokens at {} positions on a model without M-RoPE", n,
           mtmd_input_chunk_get_n_pos(c));
    {
      const auto t0 = std::chrono::steady_clock::now();
      if (const int rc = mtmd_encode_chunk(mctx, c); rc != 0) fail("mtmd_encode_chunk of a frame returned {}", rc);
      f.encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const float* e = mtmd_get_output_embd(mctx);
    f.embd.emplace_back(e, e + n * n_embd);
    auto ch = lc::embd_chunk(f.embd.back(), n, kind);
    ch.non_causal = mtmd_decode_use_non_causal(mctx, c);
    f.chunks.push_back(ch);
    f.source.push_back(c);
    f.frame_tokens += n;
  }
  if (f.frame_tokens == 0) fail("mtmd_tokenize gave a frame no image chunk");
  if (!fact.empty()) add_text(fact.data(), fact.size(), nullptr);
  for (const auto& c : f.chunks) f.n_tokens += c.size();
  return f;
}

/// On an M-RoPE model gives every chunk of `f` explicit positions from `n_past` on (the session's
/// next position): text one each, an image's rows mtmd's decoder positions (one t, a grid of x and
/// y: lc::mtmd::image_positions), the image taking
/// mtmd_input_chunk_get_n_pos stream positions. Other models need none.
void place(frame_input& f, const llama_model* m, std::int64_t n_past) {
  if (lc::pos_per_embd(m) == 1) return;
  f.positions.clear();
  f.positions.reserve(f.chunks.size());  // the chunks point into them
  for (std::size_t i = 0; i < f.chunks.size(); ++i) {
    auto& ch = f.chunks[i];
    auto& p = f.positions.emplace_back();
    if (!ch.is_embd()) {
      for (std::int64_t t = 0; t < ch.size(); ++t) p.push_back(llama_pos(n_past + t));
      n_past += ch.size();
    } else {
      p = lc::mtmd::image_positions(f.source[i], llama_pos(n_past));
      ch.n_pos = mtmd_input_chunk_get_n_pos(f.source[i]);
      n_past += ch.n_pos;
    }
    ch.positions = p;
  }
}

/// A fact and its question, planted as the needle test plants them.
struct fact {
  stream::needle_spec spec;
  stream::planted_needle<llama_token> planted;
  std::int32_t segment = -1;  ///< the segment its statement took in the stream
};

std::vector<fact> draw_facts(const llama_model* m, const options& o) {
  if (o.facts == 0) return {};
  std::mt19937_64 rng(o.seed * 1000003u + 4242u);
  std::vector<std::string> kinds;
  for (std::int64_t i = 0; i < stream::kinds_in_stream(o.facts, o.people); ++i)
    kinds.emplace_back(stream::needle_kinds[std::size_t(i)].name);
  const auto tok = [&](const std::string& x) { return stream::tokenize(m, x, false); };
  std::vector<fact> out;
  for (auto& s : stream::draw_needles(kinds, o.facts, o.people, rng))
    out.push_back({s, stream::plant_needle<llama_token>(tok, s, "Question: "), -1});
  return out;
}

/// One frame's record.
struct frame_record {
  std::int64_t frame = 0, input = 0, input_frames = 0, input_text = 0;  ///< tokens streamed so far (by modality)
  std::int64_t held = 0, held_frames = 0, held_text = 0, peak = 0, evicted = 0;
  std::int64_t frames_held = 0, frames_whole = 0;  ///< frames with some / all of their tokens cached
  std::int64_t facts_held = 0;                     ///< facts whose statement is cached whole
  std::int64_t kv_state_bytes = 0, host_bytes = 0, rss_bytes = 0;
  double encode = 0, decode = 0, score = 0, evict = 0;  ///< seconds so far
};

/// Calls f(name, value) for every field of `r`, in the order of the JSON and CSV records.
template <class F>
void for_each_field(const frame_record& r, F&& f) {
  f("frame", r.frame), f("input", r.input), f("input_frames", r.input_frames), f("input_text", r.input_text);
  f("held", r.held), f("held_frames", r.held_frames), f("held_text", r.held_text), f("peak", r.peak);
  f("evicted", r.evicted), f("frames_held", r.frames_held), f("frames_whole", r.frames_whole);
  f("facts_held", r.facts_held), f("kv_state_bytes", r.kv_state_bytes), f("host_bytes", r.host_bytes);
  f("rss_bytes", r.rss_bytes), f("encode_s", r.encode), f("decode_s", r.decode), f("score_s", r.score);
  f("evict_s", r.evict);
}

/// A fact asked back after `after` further frames.
struct asked {
  std::int64_t after = 0;
  std::size_t fact = 0;
  std::int64_t statement_cached = 0;
  std::string answer;
  std::vector<double> logprobs;
  bool forced = false, greedy = false;
};

struct policy_run {
  std::string policy, note;
  std::vector<frame_record> frames;
  std::vector<asked> answers;
  std::int64_t block = 0, n_ctx = 0;
  double seconds = 0;
};

/// The session's bookkeeping must equal llama.cpp's memory: the same smallest and largest
/// position of sequence 0 (an engine whose cache disagrees is an error, not a result).
void check_positions(const lc::session& s, llama_context* ctx, std::int64_t frame) {
  llama_memory_t mem = llama_get_memory(ctx);
  const llama_pos lo = llama_memory_seq_pos_min(mem, 0), hi = llama_memory_seq_pos_max(mem, 0);
  std::int64_t want_lo = -1, want_hi = -1;
  for (const auto& t : s.tokens()) {
    want_lo = want_lo < 0 ? t.pos : std::min(want_lo, t.pos);
    want_hi = std::max(want_hi, t.pos);
  }
  if (lo != want_lo || hi != want_hi)
    infkv_tools::engine_fail(
        "infkv-video: after frame {} llama.cpp holds positions [{}, {}] of sequence 0, the session [{}, {}]", frame, lo,
        hi, want_lo, want_hi);
}

policy_run run_policy(const options& o, const stream::policy_info& p, const llama_model* m, mtmd_context* mctx,
                      std::vector<fact>& facts) {
  const auto t_start = std::chrono::steady_clock::now();
  policy_run run;
  run.policy = std::string(p.name);
  media_reader media(mctx, o.media, o.fps);
  const bool full = p.k == stream::kind::full;
  const stream::model_shape sh(m);

  // The intro, then the first frame: it fixes the block (one frame with its text) and the context.
  const auto intro =
      stream::tokenize(m, "Here is a video. Notes about people are written between its frames; remember them.\n", true);
  bitmap_ptr bmp;
  std::string before;
  if (!media.next(bmp, before)) fail("--media = {}: no frames", o.media);
  const auto fact_of = [&](std::int64_t f) -> const std::vector<llama_token>& {
    static const std::vector<llama_token> none;
    return f < std::int64_t(facts.size()) ? facts[std::size_t(f)].planted.statement : none;
  };
  frame_input in = make_frame(mctx, m, bmp.get(), before, fact_of(0), media.kind());
  std::int64_t longest_fact = 0;
  for (const auto& f : facts) longest_fact = std::max(longest_fact, std::int64_t(f.planted.statement.size()));
  // Default: a frame with its text (frame 0's, without its fact) + the longest fact + 16 tokens of
  // slack for longer timestamp texts.
  const std::int64_t frame_text = in.n_tokens - std::int64_t(fact_of(0).size());
  const std::int64_t block = o.block > 0 ? o.block : frame_text + longest_fact + 16;
  if (block < in.frame_tokens)
    fail("--block = {}: a frame takes {} tokens, and a frame is never split", o.block, in.frame_tokens);
  std::int64_t ask_room = 0;
  for (const auto& f : facts)
    for (const auto& c : f.planted.choices)
      ask_room = std::max(ask_room, std::int64_t(f.planted.question.size() + c.size()) + o.gen);
  stream::settings s = o.s;
  s.ask_room = ask_room;
  const std::int64_t cells = full ? sh.n_ctx_train : std::max(s.budget + block, std::int64_t(intro.size()) + block);
  stream::check_cells(m, full ? "--policy full" : "--budget", full ? sh.n_ctx_train : s.budget, p.name,
                      double(cells + ask_room));
  auto cp = stream::runner_params(s, cells, block);
  cp.n_ubatch = cp.n_batch;  // a non-causal frame must fit one micro-batch
  const infkv::llama_cpp::session_options so =
      full ? infkv::llama_cpp::session_options{.capture = false, .executor = {s.threads}}
           : stream::session_options_for(p.k, s);
  lc::session session(m, so);
  session.attach(cp);
  lc::context_ptr ctx(llama_init_from_model(const_cast<llama_model*>(m), cp));
  if (!ctx) infkv_tools::engine_fail("infkv-video: cannot create a context of {} cells", cp.n_ctx);
  session.bind(ctx.get());
  run.block = block, run.n_ctx = cp.n_ctx;
  const infkv::block_prefill sched{.block = block, .budget = full ? cells - block : s.budget};
  const auto bud = full ? infkv::budget{.capacity = sched.budget} : *stream::policy_budget(p.k, s);
  const lc::prefill_options popt{.sinks = bud.sinks, .recent = bud.recent, .logits_last = false};
  const auto prefill = [&](std::span<const lc::chunk> chunks) {
    const auto r = full ? lc::prefill(session, chunks, infkv::streaming_llm{}, sched, popt)
                        : infkv_tools::with_policy(
                              p.k, s, [&](const auto& pol) { return lc::prefill(session, chunks, pol, sched, popt); });
    if (!r.ok())
      infkv_tools::engine_fail("infkv-video: llama_decode returned {} in block {} of a frame", r.status,
                               r.failed_block);
    return r;
  };
  const std::vector<lc::chunk> intro_chunk{lc::text_chunk(intro)};
  prefill(intro_chunk);

  frame_record rec;
  rec.input = rec.input_text = std::int64_t(intro.size());
  std::vector<std::int32_t> frame_segments;  // segment of each frame's image chunk
  std::vector<std::int64_t> frame_size;
  double encode = 0;
  stream::answer a;
  infkv::llama_cpp::session_stats ask_stats;
  const auto segment_counts = [&]() {
    std::vector<std::int64_t> held;  // per segment
    for (const auto& t : session.tokens()) {
      if (std::size_t(t.segment) >= held.size()) held.resize(std::size_t(t.segment) + 1, 0);
      ++held[std::size_t(t.segment)];
    }
    return held;
  };
  for (std::int64_t f = 0; f < o.frames; ++f) {
    if (f > 0) {
      if (!media.next(bmp, before)) {
        run.note = fmt::format("the media ended after {} frames", f);
        break;
      }
      in = make_frame(mctx, m, bmp.get(), before, fact_of(f), media.kind());
    }
    if (full && session.size() + in.n_tokens > sched.budget) {
      run.note = fmt::format("the full cache holds no more after frame {}: {} cells (the trained context)", f, cells);
      break;
    }
    encode += in.encode_seconds;
    place(in, m, session.next_pos());
    const auto r = prefill(in.chunks);
    std::int32_t seg = r.first_segment;
    for (const auto& c : in.chunks) {
      if (c.is_embd()) frame_segments.push_back(seg), frame_size.push_back(c.size());
      ++seg;
    }
    if (f < std::int64_t(facts.size())) facts[std::size_t(f)].segment = seg - 1;
    rec.frame = f + 1;
    rec.input += in.n_tokens, rec.input_frames += in.frame_tokens, rec.input_text += in.n_tokens - in.frame_tokens;
    rec.peak = std::max(rec.peak, r.peak);
    rec.evicted += r.evicted;
    rec.held = session.size();
    rec.held_frames = 0;
    for (const auto& t : session.tokens()) rec.held_frames += t.kind != infkv::modality::text;
    rec.held_text = rec.held - rec.held_frames;
    const auto held = segment_counts();
    const auto held_of = [&](std::int32_t sg) { return std::size_t(sg) < held.size() ? held[std::size_t(sg)] : 0; };
    rec.frames_held = rec.frames_whole = 0;
    for (std::size_t i = 0; i < frame_segments.size(); ++i) {
      rec.frames_held += held_of(frame_segments[i]) > 0;
      rec.frames_whole += held_of(frame_segments[i]) == frame_size[i];
    }
    rec.facts_held = 0;
    for (const auto& ft : facts)
      rec.facts_held += ft.segment >= 0 && held_of(ft.segment) == std::int64_t(ft.planted.statement.size());
    check_positions(session, ctx.get(), rec.frame);
    rec.kv_state_bytes = std::int64_t(llama_state_seq_get_size(ctx.get(), 0));
    rec.host_bytes = session.memory().total();
    rec.rss_bytes = stream::rss_bytes();
    const auto st = session.stats();
    rec.encode = encode, rec.decode = st.decode;
    rec.score = st.append + st.h2o + st.score;
    rec.evict = st.seq_rm + st.seq_add + st.host_evict + st.rerotate;
    run.frames.push_back(rec);
    if (o.progress > 0 && (rec.frame % o.progress == 0 || rec.frame == o.frames))
      fmt::print(stderr,
                 "[{}] frame {}: {} tokens in ({} of frames), held {} ({} of frames, {} text), peak {}, frames held "
                 "{} ({} whole), facts held {}, kv {:.2f} MiB, rss {:.0f} MiB\n",
                 run.policy, rec.frame, rec.input, rec.input_frames, rec.held, rec.held_frames, rec.held_text, rec.peak,
                 rec.frames_held, rec.frames_whole, rec.facts_held, double(rec.kv_state_bytes) / 1048576.0,
                 double(rec.rss_bytes) / 1048576.0);
    const std::int64_t after = rec.frame - std::int64_t(facts.size());
    if (after > 0 && std::binary_search(o.ask_after.begin(), o.ask_after.end(), after)) {
      std::int64_t forced = 0, greedy = 0;
      for (std::size_t i = 0; i < facts.size(); ++i) {
        const auto& pl = facts[i].planted;
        a = stream::ask_aside(ctx.get(), session.next_pos(), pl.question, pl.choices, o.gen, ask_stats);
        asked q{.after = after,
                .fact = i,
                .statement_cached = held_of(facts[i].segment),
                .answer = a.text,
                .logprobs = a.logprobs};
        q.forced = stream::forced_rank(q.logprobs, pl.truth) == 1;
        q.greedy = stream::answer_matches(q.answer, facts[i].spec.value);
        forced += q.forced, greedy += q.greedy;
        run.answers.push_back(q);
      }
      fmt::print(stderr, "[{}] after {} more frames: forced choice {}/{}, greedy {}/{}, facts cached whole {}\n",
                 run.policy, after, forced, facts.size(), greedy, facts.size(), rec.facts_held);
    }
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return run;
}

nlohmann::json to_json(const options& o, const llama_model* m, const std::vector<fact>& facts,
                       const std::vector<policy_run>& runs, const std::string& media) {
  char desc[256];
  llama_model_desc(m, desc, sizeof desc);
  nlohmann::json j{{"program", "infkv-video"},
                   {"version", version_line()},
                   {"needle_protocol", stream::needle_protocol},
                   {"model", o.model},
                   {"model_desc", desc},
                   {"mmproj", o.mmproj},
                   {"media", o.media},
                   {"media_desc", media},
                   {"settings",
                    {{"budget", o.s.budget},
                     {"sinks", o.s.sinks},
                     {"recent", o.s.recent},
                     {"window", o.s.window},
                     {"beta", o.s.beta},
                     {"threads", o.s.threads},
                     {"fps", o.fps},
                     {"frames", o.frames},
                     {"facts", o.facts},
                     {"people", o.people},
                     {"ask_after", o.ask_after},
                     {"gen", o.gen},
                     {"seed", o.seed}}},
                   {"load_average", stream::load_average()}};
  for (const auto& f : facts)
    j["facts"].push_back({{"kind", f.spec.kind},
                          {"person", f.spec.person},
                          {"value", f.spec.value},
                          {"candidates", f.spec.candidates},
                          {"statement_tokens", f.planted.statement.size()}});
  for (const auto& r : runs) {
    nlohmann::json pr{
        {"policy", r.policy}, {"note", r.note}, {"block", r.block}, {"n_ctx", r.n_ctx}, {"seconds", r.seconds}};
    for (const auto& f : r.frames)
      for_each_field(f, [&, &o = pr["frames"].emplace_back()](const char* k, auto v) { o[k] = v; });
    for (const auto& q : r.answers)
      pr["answers"].push_back({{"after", q.after},
                               {"fact", q.fact},
                               {"statement_cached", q.statement_cached},
                               {"answer", q.answer},
                               {"logprobs", q.logprobs},
                               {"forced_success", q.forced},
                               {"greedy_success", q.greedy}});
    j["runs"].push_back(pr);
  }
  return j;
}

std::string to_csv(const std::vector<policy_run>& runs) {
  std::ostringstream out;
  out << "policy";
  for_each_field(frame_record{}, [&](const char* k, auto) { out << ',' << k; });
  out << '\n';
  for (const auto& r : runs)
    for (const auto& f : r.frames) {
      out << r.policy;
      for_each_field(f, [&](const char*, auto v) {
        if constexpr (std::is_floating_point_v<decltype(v)>)
          out << fmt::format(",{:.6f}", v);
        else
          out << ',' << v;
      });
      out << '\n';
    }
  return out.str();
}

void print_summary(const std::vector<policy_run>& runs, const std::vector<fact>& facts,
                   const std::vector<std::int64_t>& ask_after) {
  fmt::print("{:<19} {:>6} {:>7} {:>6} {:>6} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8}", "policy", "frames", "input", "peak",
             "held", "kv MiB", "rss MiB", "encode s", "decode s", "score s", "evict s");
  for (const auto n : ask_after) fmt::print(" {:>10}", fmt::format("facts@{}", n));
  fmt::print("\n");
  for (const auto& r : runs) {
    if (r.frames.empty()) continue;
    const auto& f = r.frames.back();
    fmt::print("{:<19} {:>6} {:>7} {:>6} {:>6} {:>9.2f} {:>8.0f} {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f}", r.policy,
               f.frame, f.input, f.peak, f.held, double(f.kv_state_bytes) / 1048576.0, double(f.rss_bytes) / 1048576.0,
               f.encode, f.decode, f.score, f.evict);
    for (const auto n : ask_after) {
      std::int64_t ok = 0, asked_n = 0;
      for (const auto& q : r.answers)
        if (q.after == n) ok += q.forced, ++asked_n;
      fmt::print(" {:>10}", asked_n == 0 ? std::string("-") : fmt::format("{}/{}", ok, asked_n));
    }
    fmt::print("{}\n", r.note.empty() ? "" : "  (" + r.note + ")");
  }
  if (!facts.empty())
    fmt::print("facts@N: forced-choice successes of the {} facts after N further frames\n", facts.size());
}

int run(const options& o, const std::vector<stream::policy_info>& chosen) {
  const auto model = stream::load_model(o.model);
  const llama_model* m = model.get();
  // mtmd and its video helper log every frame: only their errors are kept, and given as the reason
  // of the error infkv-video raises (mtmd_errors).
  mtmd_helper_log_set(
      [](ggml_log_level level, const char* text, void*) {
        if (level == GGML_LOG_LEVEL_ERROR) mtmd_log() += text;
      },
      nullptr);
  auto mp = mtmd_context_params_default();
  mp.use_gpu = false;
  mp.n_threads = o.s.threads;
  mp.print_timings = false;
  mp.warmup = false;
  lc::mtmd::context_ptr mctx(mtmd_init_from_file(o.mmproj.c_str(), m, mp));
  if (!mctx)
    fail(
        "--mmproj = {}: mtmd_init_from_file refused it with --model = {} (e.g. a projection width other than the "
        "model's {}){}",
        o.mmproj, o.model, llama_model_n_embd_inp(m), mtmd_errors());
  if (!mtmd_support_vision(mctx.get())) fail("--mmproj = {}: has no vision encoder", o.mmproj);
  auto facts = draw_facts(m, o);
  std::string media;
  {
    media_reader probe(mctx.get(), o.media, o.fps);
    media = probe.describe();
  }
  const std::string asked = facts.empty() ? "no facts"
                                          : fmt::format("{} facts, questions after {} further frames", facts.size(),
                                                        fmt::join(o.ask_after, ","));
  fmt::print(stderr, "infkv-video: {} ({}); {}; budget {}, {} threads\n", o.media, media, asked, o.s.budget,
             o.s.threads);
  std::vector<policy_run> runs;
  for (const auto& p : chosen) runs.push_back(run_policy(o, p, m, mctx.get(), facts));
  print_summary(runs, facts, o.ask_after);
  if (!o.json.empty()) infkv_tools::write_json("--json", o.json, to_json(o, m, facts, runs, media));
  if (!o.csv.empty()) infkv_tools::write_file("--csv", o.csv, to_csv(runs));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "infkv-video: a video (or images) and text facts streamed through llama.cpp's mtmd into a KV cache bounded by "
      "an infkv policy, in frame-aligned blocks; the facts are asked back after further frames"};
  app.name("infkv-video");
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", version_line());
  options o;
  o.s.threads = int(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  if (o.list) {
    for (const auto& p : infkv_tools::policy_catalog)
      if (p.k != stream::kind::recompute && p.k != stream::kind::context_shift)
        fmt::print("{:<19} {}\n", p.name, p.about);
    return 0;
  }
  const auto chosen = check(o);
  try {
    return run(o, chosen);
  } catch (const std::exception& e) {
    std::cerr << "infkv-video: error: " << e.what() << '\n';
    return 1;
  }
}
