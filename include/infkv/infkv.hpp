// infkv core: views, token metadata, budgets, keep sets, scores, selection and every policy.
// CUDA-free and engine-free: compiles with plain g++ -std=c++20.
#pragma once

#include "allocation.hpp"
#include "archive.hpp"
#include "batch.hpp"
#include "bias.hpp"
#include "budget.hpp"
#include "config.hpp"
#include "dtype.hpp"
#include "error.hpp"
#include "keep_set.hpp"
#include "kv_view.hpp"
#include "pipeline.hpp"
#include "plan.hpp"
#include "policies/expected_attention.hpp"
#include "policies/h2o.hpp"
#include "policies/inf_mllm.hpp"
#include "policies/keydiff.hpp"
#include "policies/snapkv.hpp"
#include "policies/streaming_llm.hpp"
#include "policies/tova.hpp"
#include "policy.hpp"
#include "rope.hpp"
#include "schedule.hpp"
#include "scores.hpp"
#include "select.hpp"
#include "tokens.hpp"
#include "union.hpp"
#include "version.hpp"

#include <variant>

namespace infkv {

/// Every policy infkv ships, as one variant (plus `Extra` alternatives): the one list the Python
/// module and the tools take theirs from. A policy added here reaches both.
template <class... Extra>
using policy_variant = std::variant<streaming_llm, h2o, tova, snapkv, keydiff, inf_mllm, expected_attention, Extra...>;

}  // namespace infkv
