// The stub CUDA runtime's record (stub_runtime.cpp): what the no-sync test asks it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace stub {

/// One runtime call: its name, its stream (null for calls without one) and whether it waits
/// for the device, copies to or from host memory, or allocates.
struct call {
  std::string name;
  cudaStream_t stream;
  bool forbidden;
  std::string detail;
};

/// Memory "on the device": inside a range the host cannot read or write.
void* device_alloc(std::size_t bytes);
bool is_device(const void* p);

/// Every call recorded since the last clear(), in order.
std::vector<call> calls();
void clear();

/// cuBLAS handles created so far (never cleared).
int handles_created();

}  // namespace stub
