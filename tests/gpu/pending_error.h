// A non-sticky CUDA error left pending on the calling thread, as an engine's failed call
// leaves one (PyTorch's, say): a library call that checked its `<<<>>>` launch with
// cudaGetLastError reported it as its own and failed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "gtest/gtest.h"

namespace eps::testing {

// An allocation past any device's memory: cudaErrorMemoryAllocation, pending and not
// sticky. Call through ASSERT_NO_FATAL_FAILURE.
inline void LeaveErrorPending() {
  void* never = nullptr;
  ASSERT_EQ(cudaMalloc(&never, size_t{1} << 62), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaPeekAtLastError(), cudaErrorMemoryAllocation);
}

}  // namespace eps::testing
