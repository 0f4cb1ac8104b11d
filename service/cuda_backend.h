// The CUDA backend: CUDA IPC mappings of the engine's buffers and the gpu/
// pre-pass over them. Only built when nvcc is found (EPS_HAVE_CUDA).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "service/backend.h"
#include "service/descriptor.h"

namespace eps::service {

// Opens CUDA IPC handles on `device`, the session's (epsd's ordinal), as
// MappedMemory (device memory, checked extents).
CudaIpcOpener MakeCudaIpcOpener(int device);

// `inputs_timeout`: how long an async step may wait for the engine's
// inputs_ready before epsd releases the wait itself (the watchdog of docs/design.md §6).
// On a failure after device memory was allocated, `*remains` (when not null) is a
// backend that owns it, to be destroyed as an ended session's is (its SafeToDestroy):
// freeing at once could wait for another engine's queued step (session_janitor.h).
absl::StatusOr<std::unique_ptr<StepBackend>> MakeCudaBackend(
    const ModelLayout& model, int device, int64_t max_batch, int64_t max_groups,
    std::chrono::microseconds inputs_timeout, std::unique_ptr<StepBackend>* remains = nullptr);

// The device memory a cuda session's selector allocates (gpu::GpuSelector::DeviceBytes),
// what the session is charged for it; 0 in a build without CUDA (no cuda session exists).
uint64_t CudaBackendDeviceBytes(const ModelLayout& model, int64_t max_batch, int64_t max_groups,
                                int64_t max_coarse_groups);

// Whether memory of epsd's on `device` (a mapping of an engine's, an allocation) may be
// freed now without waiting for another engine's queued step, after putting it off for
// `deferred` (gpu/live_streams.h SafeToFreeOn; `stale`: --inputs-timeout-ms).
bool CudaSafeToFree(int device, std::chrono::steady_clock::duration deferred,
                    std::chrono::steady_clock::duration stale);

// When the oldest stream abandoned on `device` whose work may still run was abandoned, or
// none (gpu/live_streams.h OldestAbandonment); none in a build without CUDA.
std::optional<std::chrono::steady_clock::time_point> CudaAbandonedWorkSince(int device);

// True when this build has the CUDA backend (nvcc was found).
bool CudaBackendBuilt();

// Whether a CUDA device is visible to this process, and CUDA was not taken out of service
// (DisableCuda).
bool CudaDevicePresent();

// Takes CUDA out of service for the rest of the process: CudaDevicePresent() is false from
// now on, and a cuda Attach is refused FAILED_PRECONDITION naming `reason`. epsd
// --backend=auto calls it when the warm-up fails on a GPU it sees but cannot use (a build
// without code for its architecture, a driver too old), and goes on serving the cpu backend,
// so that the engine beside it falls back instead of waiting for an epsd that never starts.
void DisableCuda(std::string reason);

// Why no cuda session can start now: a build without CUDA, no visible device, or
// DisableCuda's reason.
std::string CudaUnavailableReason();

// Creates every visible device's context and loads the pre-pass kernels, so that
// a first Attach pays for neither (500 ms is the clients' default Attach deadline).
absl::Status WarmUpCuda();

// How many CUDA devices epsd sees (0 without CUDA).
int CudaDeviceCount();

// epsd's ordinal of the device whose 16-byte UUID is `uuid`; INVALID_ARGUMENT
// naming the UUID when no device has it.
absl::StatusOr<int> CudaDeviceWithUuid(std::string_view uuid);

}  // namespace eps::service
