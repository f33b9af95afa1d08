// infkv: compiler configuration shared by every header: INFKV_HOST_DEVICE marks the small
// accessors and conversions that CUDA kernels call as well as host code.
#pragma once

#if defined(__CUDACC__)
#define INFKV_HOST_DEVICE __host__ __device__
#else
#define INFKV_HOST_DEVICE
#endif

#include <type_traits>

namespace infkv::detail {
/// What a read-only view converts to: nothing usable (its conversion operator is declared for the
/// writable view only, so no compiler sees a conversion of a type to itself).
struct no_conversion {};
/// The read-only view `Const` a writable view (`IsConst` false) converts to.
template <bool IsConst, class Const>
using read_only_view = std::conditional_t<IsConst, no_conversion, Const>;
}  // namespace infkv::detail
