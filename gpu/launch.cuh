// Kernel launches whose result is the launch's own.
//
// A `<<<>>>` launch reports its failure only through the thread's last error, and the
// cudaGetLastError that reads it also returns (and clears) any earlier failed call's
// error on the thread: an engine's (PyTorch's) reported as ours, or ours left for the
// engine's next launch check to raise on an unrelated op. cudaLaunchKernelExC returns
// this launch's error alone. Header-only and free of absl, so that libeps_attention
// (its own static cudart) uses it too.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace eps::gpu {

// kernel<<<grid, block, shared_bytes, stream>>>(args...), returning this launch's result.
// The arguments convert to the kernel's parameter types as in a `<<<>>>` launch.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                         cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "one argument per kernel parameter");
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace eps::gpu
