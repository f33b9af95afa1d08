// infkv tools: a llama.cpp session's time split as JSON (infkv-stream, infkv-engine-bench).
#pragma once

#include <nlohmann/json.hpp>

#include <infkv/llama_cpp/session.hpp>

namespace stream {

/// Seconds per part of the session's work and its counters (session_stats).
inline nlohmann::json to_json(const infkv::llama_cpp::session_stats& t) {
  return {{"decode", t.decode},
          {"capture", t.capture},
          {"append", t.append},
          {"h2o", t.h2o},
          {"score", t.score},
          {"seq_rm", t.seq_rm},
          {"seq_add", t.seq_add},
          {"host_evict", t.host_evict},
          {"rerotate", t.rerotate},
          {"archive", t.archive},
          {"recall", t.recall},
          {"proxy", t.proxy},
          {"reconstruct", t.reconstruct},
          {"gather", t.gather},
          {"gathered", t.gathered},
          {"decodes", t.decodes},
          {"decoded_tokens", t.decoded_tokens},
          {"evictions", t.evictions},
          {"observed", t.observed}};
}

}  // namespace stream
