// Checked CUDA calls and an RAII device allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// Returns an INTERNAL status naming the call and CUDA's error when `expr` fails.
#define CUDA_RETURN_IF_ERROR(expr)                                         \
  do {                                                                     \
    const cudaError_t eps_cuda_err_ = (expr);                              \
    if (eps_cuda_err_ != cudaSuccess) {                                    \
      return ::absl::InternalError(                                        \
          ::absl::StrCat(#expr, ": ", cudaGetErrorString(eps_cuda_err_))); \
    }                                                                      \
  } while (false)

#define RETURN_IF_CUDA_ALLOC(buffer, count)                                       \
  do {                                                                            \
    if (::absl::Status eps_alloc_ = (buffer).Allocate(count); !eps_alloc_.ok()) { \
      return eps_alloc_;                                                          \
    }                                                                             \
  } while (false)

namespace eps::gpu {

// Owns `count` elements of device memory; freed in the destructor.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Allocate(int64_t count) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    const cudaError_t err =
        cudaMalloc(&ptr_, static_cast<size_t>(count > 0 ? count : 1) * sizeof(T));
    if (err != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMalloc(", count * sizeof(T), " bytes): ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
};

}  // namespace eps::gpu
