// infkv: compiler configuration shared by every header: INFKV_HOST_DEVICE marks the small
// accessors and conversions that CUDA kernels call as well as host code.
#pragma once

#if defined(__CUDACC__)
#define INFKV_HOST_DEVICE __host__ __device__
#else
#define INFKV_HOST_DEVICE
#endif
