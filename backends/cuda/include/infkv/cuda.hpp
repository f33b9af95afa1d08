// infkv CUDA backend (target infkv::cuda, CMake option INFKV_WITH_CUDA): the pipeline's
// primitives on a CUDA stream, compaction of strided and paged device caches, RoPE re-rotation
// and H2O's accumulator on the device. Plain C++: include it from g++ code and link infkv::cuda.
#pragma once

#include <infkv/infkv.hpp>

#include "cuda/archive.hpp"
#include "cuda/backend.hpp"
