// The CUDA devices of this process, by ordinal or by UUID (docs/api-memory.md §3.7).
// A tensor-parallel engine usually runs each rank with CUDA_VISIBLE_DEVICES
// naming one GPU, so a rank's ordinal 0 is not epsd's ordinal 0; the 16-byte
// device UUID is the same in every process of the host.
//
// Thread safety: the functions only query the runtime; safe from any thread.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace eps::gpu {

// The number of devices this process sees (0 when the runtime has none).
int DeviceCount();

// The 16 raw bytes of `device`'s UUID (cudaDeviceProp.uuid).
absl::StatusOr<std::string> DeviceUuid(int device);

// The ordinal of the device whose UUID is `uuid` (16 bytes); INVALID_ARGUMENT
// naming the UUID when no device of this process has it.
absl::StatusOr<int> DeviceWithUuid(std::string_view uuid);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it (any
// byte string of another length is printed as hex).
std::string UuidText(std::string_view uuid);

// True when a CUDA device is usable by this process: tests skip, and binaries
// refuse the cuda backend, without one.
bool DeviceAvailable();

// Whether `device`'s primary context exists (cuDevicePrimaryCtxGetState). A thread that
// never chose a device reads as device 0; making that current again would create GPU 0's
// context (hundreds of MiB) in a process that may not use GPU 0. False when unknown.
bool PrimaryContextActive(int device);

}  // namespace eps::gpu
