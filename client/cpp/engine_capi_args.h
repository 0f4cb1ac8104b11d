// The C ABI's integer arguments (engine_capi.h) as what they name: a cudaStream_t handle
// (torch.cuda.Stream.cuda_stream), a device address. Shared by engine_capi.cc and
// engine_capi_summary.cc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace eps::capi {

inline cudaStream_t Stream(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

template <typename T>
T* Ptr(uint64_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace eps::capi
