// Makes a CUDA device current for a scope and gives the calling thread back its own
// device at the end: a thread's current device is the engine's (PyTorch's, say), and a
// library call that left it changed would send the engine's next allocation or launch to
// another GPU.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gpu/cuda_check.h"

namespace eps::client {

// DeviceScope's constructor argument: restore the thread's current device at the end.
struct RestoreCurrentDevice {};

class DeviceScope {
 public:
  DeviceScope() = default;
  explicit DeviceScope(RestoreCurrentDevice) { Hold(); }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

  // Restores the thread's current device when the scope ends, whatever the calls
  // inside it make current.
  void Hold() {
    if (restore_) return;
    restore_ = cudaGetDevice(&previous_) == cudaSuccess;
    if (!restore_) gpu::ClearFailedCall();
  }
  // Makes `device` current until the scope ends (the thread's device is restored then).
  absl::Status Enter(int device) {
    Hold();
    if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
      gpu::ClearFailedCall();
      return absl::FailedPreconditionError(
          absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }

 private:
  bool restore_ = false;
  int previous_ = 0;
};

}  // namespace eps::client
