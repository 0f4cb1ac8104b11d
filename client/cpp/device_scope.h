// Makes a CUDA device current for a scope and gives the calling thread back its own
// device at the end: a thread's current device is the engine's (PyTorch's, say), and a
// library call that left it changed would send the engine's next allocation or launch to
// another GPU.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"

namespace eps::client {

// DeviceScope's constructor argument: restore the thread's current device at the end.
struct RestoreCurrentDevice {};

class DeviceScope {
 public:
  DeviceScope() = default;
  explicit DeviceScope(RestoreCurrentDevice) { Hold(); }
  // Gives the thread back its device, unless that device's context does not exist: a
  // thread that never chose a device reads as device 0, and setting 0 would create GPU 0's
  // context in a process that may never use it (as PyTorch's device guards avoid too).
  ~DeviceScope() {
    if (!restore_) return;
    int now = -1;
    const cudaError_t got = cudaGetDevice(&now);
    if (got == cudaSuccess && now == previous_) return;
    if (got != cudaSuccess) gpu::ClearFailedCall();  // its own failure only: a caller's stays
    if (!gpu::PrimaryContextActive(previous_)) return;
    if (cudaSetDevice(previous_) != cudaSuccess) gpu::ClearFailedCall();
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
  // Makes `device` current until the scope ends (the thread's device is restored then);
  // gpu::SetDevice's FAILED_PRECONDITION when it cannot be made current.
  absl::Status Enter(int device) {
    Hold();
    return gpu::SetDevice(device);
  }

 private:
  bool restore_ = false;
  int previous_ = 0;
};

}  // namespace eps::client
