// infkv core: views, token metadata, budgets, keep sets, scores, selection and every policy.
// CUDA-free and engine-free: compiles with plain g++ -std=c++20.
#pragma once

#include "budget.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "keep_set.hpp"
#include "kv_view.hpp"
#include "policy.hpp"
#include "policies/allocation.hpp"
#include "policies/attention_bias.hpp"
#include "policies/h2o.hpp"
#include "policies/inf_mllm.hpp"
#include "policies/keydiff.hpp"
#include "policies/schedule.hpp"
#include "policies/snapkv.hpp"
#include "policies/streaming_llm.hpp"
#include "policies/tova.hpp"
#include "scores.hpp"
#include "select.hpp"
#include "tokens.hpp"
#include "version.hpp"
