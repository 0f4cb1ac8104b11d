// The shared buffers of one engine session in device memory (docs/design.md §5): one
// cudaMalloc allocation, laid out by BufferPlan and exported to epsd with a
// legacy CUDA IPC handle. The library allocates it itself, never from the
// engine's own tensors (PyTorch's expandable segments and vLLM's cumem
// allocator break cudaIpcGetMemHandle); the engine copies its rows in.
//
// Cross-process ordering on the engine's stream, without a host round trip:
//   SignalInputsReady(stream, step)  after the step's queries are written
//   WaitSelection(stream, step)      before attention reads the visit lists
// and, when the step falls back (fail open), ReleaseDense(step, stream) sets
// every visit_count to -1 ("attend densely") and then selection_done = step on
// the engine's stream, ahead of its wait, so that stream never waits on a
// sidecar that is gone. With a feedback buffer it first NaN-fills it: no selection
// consumed the entries of the step before, and the released step's attention would
// combine its own masses with them. (ReleaseDense(step) does it on a stream of the
// library's own, as the watchdog must; that stream may share a hardware queue
// with the engine's waiting one: docs/design.md §6.)
//
// Ownership: a SelectionWatchdog made over the buffers shares them (Create takes a
// shared_ptr), so they are destroyed after it. The allocation is freed in the destructor (after the
// device is idle for it; a WaitSelection still waiting for a step the sidecar never finished is
// released densely first, as the watchdog would). Thread safety: ReleaseDense and ReadSelectionDone
// may run on another thread (the watchdog's) than the engine's; everything else is the engine
// thread's. ReleaseDense and ReadSelectionDone leave the calling thread's current device as they
// found it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/buffer_plan.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::client {

class DeviceBuffers {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceBuffers>> Create(const ModelLayout& model,
                                                               const BufferShape& shape,
                                                               int device);
  ~DeviceBuffers();
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  // Descriptors of every buffer (CudaIpcHandle), for AttachRequest.buffers.
  v1::SharedBuffers Descriptors() const;
  // Sets attach's buffers (Descriptors), device and device_uuid (DeviceUuid), as Python's
  // attach_request does for CudaBuffers: epsd finds the GPU by its UUID, so a rank started
  // with CUDA_VISIBLE_DEVICES (whose ordinals are not epsd's) attaches on the right one.
  void DescribeTo(v1::AttachRequest* attach) const;

  // Device pointers, laid out as docs/api-memory.md says.
  float* summary_pool() const { return At<float>(plan_.pool); }
  int32_t* group_table() const { return At<int32_t>(plan_.groups); }
  int32_t* block_table() const { return At<int32_t>(plan_.blocks); }
  float* queries() const { return At<float>(plan_.queries); }
  int32_t* visit_blocks() const { return At<int32_t>(plan_.visit); }
  int32_t* visit_count() const { return At<int32_t>(plan_.count); }
  uint64_t* flags() const { return At<uint64_t>(plan_.flags); }
  // The coarse level's pool and table; null without one (ModelLayout.coarse_blocks = 0).
  float* coarse_pool() const {
    return plan_.model.has_coarse_level() ? At<float>(plan_.coarse_pool) : nullptr;
  }
  int32_t* coarse_table() const {
    return plan_.model.has_coarse_level() ? At<int32_t>(plan_.coarse_table) : nullptr;
  }
  // Selection feedback [layers, max_seqs, q_heads, max_groups] float32, NaN from Create
  // on; null without BufferShape.with_feedback (docs/api-memory.md).
  float* feedback() const {
    return plan_.shape.with_feedback ? At<float>(plan_.feedback) : nullptr;
  }

  absl::Status SignalInputsReady(cudaStream_t stream, uint64_t step);
  absl::Status WaitSelection(cudaStream_t stream, uint64_t step);
  // Fail open on the device: visit_count = -1 everywhere, then
  // selection_done = step; queued on `stream` (the engine's, before its wait
  // for `step`) without a host wait.
  absl::Status ReleaseDense(uint64_t step, cudaStream_t stream);
  // The same on a stream of the library's own, waited for (the watchdog's form).
  absl::Status ReleaseDense(uint64_t step);
  absl::StatusOr<uint64_t> ReadSelectionDone();

  const BufferPlan& plan() const { return plan_; }
  int device() const { return device_; }
  // The 16 bytes of the device's cudaDeviceProp.uuid, for AttachRequest.device_uuid
  // (docs/api-memory.md §3.7: a rank whose ordinals are not epsd's names its GPU by it);
  // read once, in Create.
  absl::StatusOr<std::string> DeviceUuid() const { return uuid_; }

 private:
  DeviceBuffers(BufferPlan plan, int device) : plan_(std::move(plan)), device_(device) {}
  absl::Status ClearFeedback(cudaStream_t stream);
  template <typename T>
  T* At(uint64_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }

  const BufferPlan plan_;
  const int device_;
  std::byte* base_ = nullptr;
  std::string handle_;                  // the cudaIpcMemHandle_t bytes
  std::string uuid_;                    // the device's cudaDeviceProp.uuid, 16 bytes
  cudaStream_t side_stream_ = nullptr;  // ReleaseDense and ReadSelectionDone
  uint64_t* host_done_ = nullptr;       // pinned, for ReadSelectionDone
  uint64_t waited_ = 0;                 // the highest step WaitSelection queued a wait for
};

}  // namespace eps::client
