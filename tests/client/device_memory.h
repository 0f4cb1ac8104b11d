// Zeroed device allocations a test owns, freed with the test (engine_capi_test,
// one_queue_test).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace eps::testing {

class DeviceMemory {
 public:
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    for (void* p : owned_) cudaFree(p);
  }

  template <typename T>
  T* Alloc(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, n * sizeof(T)), cudaSuccess);
    owned_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  std::vector<void*> owned_;
};

}  // namespace eps::testing
