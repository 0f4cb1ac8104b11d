// Checked CUDA calls and an RAII device allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status.h"

// Returns CudaFailure(#expr, error) when `expr` fails: the failed call's error is also
// cleared as the thread's last error.
#define CUDA_RETURN_IF_ERROR(expr)                          \
  do {                                                      \
    const cudaError_t eps_cuda_err_ = (expr);               \
    if (eps_cuda_err_ != cudaSuccess) {                     \
      return ::eps::gpu::CudaFailure(#expr, eps_cuda_err_); \
    }                                                       \
  } while (false)

#define RETURN_IF_CUDA_ALLOC(buffer, count)                                       \
  do {                                                                            \
    if (::absl::Status eps_alloc_ = (buffer).Allocate(count); !eps_alloc_.ok()) { \
      return eps_alloc_;                                                          \
    }                                                                             \
  } while (false)

namespace eps::gpu {

// Whether `error` leaves this process's CUDA context unusable: CUDA documents that
// every later call returns the same error and that only a new process can use the
// device again (a kernel's illegal address, trap or assertion, a launch timeout, an
// error the GPU contained, an uncorrectable ECC or NVLink error, a lost MPS server).
constexpr bool ContextLost(cudaError_t error) {
  switch (error) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

// An INTERNAL status naming `what` and CUDA's error, marked device-lost
// (core/status.h MarkDeviceLost) when the error is one of ContextLost's.
inline absl::Status CudaStatus(absl::string_view what, cudaError_t error) {
  absl::Status status = absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(error)));
  return ContextLost(error) ? MarkDeviceLost(std::move(status)) : status;
}

// Takes the error of a runtime call that just failed off the calling thread's last error.
// Every path that fails on a CUDA call calls this (or CudaFailure) once: the thread is the
// engine's, and a non-sticky error left there is reported, and cleared, by the next
// unrelated cudaGetLastError on it (PyTorch's launch check raising on one of its own ops,
// or another session's Attach in epsd failing on it). A sticky error (ContextLost) stays
// whatever is done: every later call returns it.
inline void ClearFailedCall() { (void)cudaGetLastError(); }

// CudaStatus(what, error) for a runtime call that just failed, its error cleared as the
// thread's last error (ClearFailedCall).
inline absl::Status CudaFailure(absl::string_view what, cudaError_t error) {
  ClearFailedCall();
  return CudaStatus(what, error);
}

// Makes `device` current on the calling thread. A device that cannot be made current (an
// ordinal past the last, no device, no driver) is FAILED_PRECONDITION naming the ordinal and
// CUDA's error, `cudaSetDevice(9999): invalid device ordinal`, whichever call asked for it: the
// caller named a device this process cannot use, which no retry changes and no bug of ours
// caused (libeps_engine's entry points all return this code for it, engine_capi.h, and so do
// epsd's selector and IPC mappings, gpu/step.h and gpu/ipc_mapping.h). An error
// that ends the context (ContextLost) stays CudaStatus's INTERNAL, marked device-lost, as every
// call's does. The failed call's error is cleared (ClearFailedCall).
inline absl::Status SetDevice(int device) {
  const cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string what = absl::StrCat("cudaSetDevice(", device, ")");
  if (ContextLost(err)) return CudaFailure(what, err);
  ClearFailedCall();
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// Makes `device` current where a failure can only be ignored (a destructor): false when it
// cannot be made current, the failed call's error cleared (ClearFailedCall), so that the
// thread's next unrelated error check does not report it (a later step of another session
// failing on a destructor's leftover).
inline bool TrySetDevice(int device) {
  if (cudaSetDevice(device) == cudaSuccess) return true;
  ClearFailedCall();
  return false;
}

// The driver API function `name` (CUDA 12 ABI) through the runtime's entry points, so that no
// binary links libcuda (absent where no driver is installed, as on CI); null when the driver
// lacks it. Cast it to its own type; look it up once (a function-local static).
inline void* DriverFunction(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess) {
    ClearFailedCall();
    return nullptr;
  }
  return found == cudaDriverEntryPointSuccess ? f : nullptr;
}

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
      const std::string what = absl::StrCat("cudaMalloc(", count * sizeof(T), " bytes)");
      if (ContextLost(err)) return CudaStatus(what, err);
      ClearFailedCall();
      return absl::ResourceExhaustedError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }
  T* get() const { return ptr_; }

 private:
  T* ptr_ = nullptr;
};

}  // namespace eps::gpu
