// infkv CPU backend: scoring, selection, compaction and RoPE re-rotation on the host.
#pragma once

#include <infkv/infkv.hpp>

#include "cpu/archive.hpp"
#include "cpu/attention.hpp"
#include "cpu/backend.hpp"
#include "cpu/compact.hpp"
#include "cpu/executor.hpp"
#include "cpu/expected.hpp"
#include "cpu/h2o.hpp"
#include "cpu/recall.hpp"
#include "cpu/recall_rule.hpp"
#include "cpu/rope.hpp"
#include "cpu/score.hpp"
#include "cpu/select.hpp"
#include "cpu/workspace.hpp"
