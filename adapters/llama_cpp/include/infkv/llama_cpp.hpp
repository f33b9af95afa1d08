// infkv llama.cpp adapter (target infkv::llama_cpp): infkv policies inside llama.cpp's decode
// loop, through the public llama.h API only.
//
//   infkv::llama_cpp::session s(model, {.window = 32});
//   llama_context_params cp = llama_context_default_params();
//   s.attach(cp);                                   // routes cb_eval to the session
//   llama_context* ctx = llama_init_from_model(model, cp);
//   s.bind(ctx);
//   s.decode(prompt_tokens);                        // bookkeeping grows only on success
//   s.evict(infkv::snapkv{}, {.capacity = 512, .sinks = 4});
//   prefill(s, chunks, infkv::keydiff{}, {.block = 256, .budget = 1024});  // text + image/video embeddings
#pragma once

#include "llama_cpp/capture.hpp"
#include "llama_cpp/handles.hpp"
#include "llama_cpp/model_info.hpp"
#include "llama_cpp/prefill.hpp"
#include "llama_cpp/session.hpp"
