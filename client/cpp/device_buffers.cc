#include "client/cpp/device_buffers.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/cpp/device_scope.h"
#include "client/cpp/selection_watchdog.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/stream_ops.h"

namespace eps::client {

absl::StatusOr<std::unique_ptr<DeviceBuffers>> DeviceBuffers::Create(const ModelLayout& model,
                                                                     const BufferShape& shape,
                                                                     int device) {
  ASSIGN_OR_RETURN(BufferPlan plan, BufferPlan::For(model, shape));
  auto b = std::unique_ptr<DeviceBuffers>(new DeviceBuffers(std::move(plan), device));
  DeviceScope scope;  // the caller's current device is its own again on return
  RETURN_IF_ERROR(scope.Enter(device));
  void* base = nullptr;
  const uint64_t bytes = RegionBytes(b->plan_.size);  // whole 2 MiB pages
  if (const cudaError_t err = cudaMalloc(&base, bytes); err != cudaSuccess) {
    gpu::ClearFailedCall();  // not left for a later launch check to report
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc(", bytes, " bytes): ", cudaGetErrorString(err)));
  }
  b->base_ = static_cast<std::byte*>(base);
  // Counters start at 0 and no list is valid until the first selection.
  CUDA_RETURN_IF_ERROR(cudaMemset(b->base_, 0, bytes));
  if (b->plan_.shape.with_feedback) {
    // Feedback starts NaN (no group visited): all-ones bytes are a float NaN.
    CUDA_RETURN_IF_ERROR(cudaMemset(b->base_ + b->plan_.feedback, 0xFF,
                                    b->plan_.ElementsOf(SharedBuffer::kFeedback) * sizeof(float)));
  }
  cudaIpcMemHandle_t handle;
  CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, b->base_));
  b->handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ASSIGN_OR_RETURN(b->uuid_, gpu::DeviceUuid(device));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->side_stream_, cudaStreamNonBlocking));
  RETURN_IF_ERROR(gpu::PreloadStreamOps());  // before any wait is queued (stream_ops.h)
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&b->host_done_, sizeof(uint64_t)));
  return b;
}

DeviceBuffers::~DeviceBuffers() {
  if (base_ == nullptr) return;
  DeviceScope scope;  // the destroying thread's current device is its own again on return
  (void)scope.Enter(device_);
  // A stream still waiting for a step's lists (an engine without a watchdog whose sidecar
  // is gone) would hold the synchronisation below for good: release it densely first.
  if (waited_ != 0) {
    const absl::StatusOr<uint64_t> done = ReadSelectionDone();
    if (!done.ok() || *done < waited_) (void)ReleaseDense(waited_);
  }
  cudaDeviceSynchronize();  // no stream of this process still reads or waits on it
  if (side_stream_ != nullptr) cudaStreamDestroy(side_stream_);
  if (host_done_ != nullptr) cudaFreeHost(host_done_);
  cudaFree(base_);
}

v1::SharedBuffers DeviceBuffers::Descriptors() const {
  v1::MemoryDescriptor memory;
  memory.mutable_cuda_ipc()->set_handle(handle_);
  memory.mutable_cuda_ipc()->set_device(device_);
  return plan_.Descriptors(memory);
}

void DeviceBuffers::DescribeTo(v1::AttachRequest* attach) const {
  *attach->mutable_buffers() = Descriptors();
  attach->set_device(device_);
  attach->set_device_uuid(uuid_);
}

absl::Status DeviceBuffers::SignalInputsReady(cudaStream_t stream, uint64_t step) {
  return gpu::StreamWriteCounter(stream, flags(), step);
}

absl::Status DeviceBuffers::WaitSelection(cudaStream_t stream, uint64_t step) {
  RETURN_IF_ERROR(gpu::StreamWaitCounter(stream, flags() + 1, step));
  waited_ = std::max(waited_, step);
  return absl::OkStatus();
}

absl::Status DeviceBuffers::ReleaseDense(uint64_t step, cudaStream_t stream) {
  DeviceScope scope;  // the calling thread keeps its own current device
  RETURN_IF_ERROR(scope.Enter(device_));
  RETURN_IF_ERROR(ClearFeedback(stream));
  const int64_t lists = int64_t{plan_.model.num_layers} * plan_.shape.max_batch * plan_.lists;
  return gpu::StreamReleaseDense(stream, visit_count(), lists, flags() + 1, step);
}

absl::Status DeviceBuffers::ReleaseDense(uint64_t step) {
  DeviceScope scope;
  RETURN_IF_ERROR(scope.Enter(device_));
  RETURN_IF_ERROR(ClearFeedback(side_stream_));
  const int64_t lists = int64_t{plan_.model.num_layers} * plan_.shape.max_batch * plan_.lists;
  RETURN_IF_ERROR(gpu::StreamReleaseDense(side_stream_, visit_count(), lists, flags() + 1, step));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_stream_));
  return absl::OkStatus();
}

// Feedback back to NaN, so that the released step's attention writes its own masses
// rather than combining them with those of the step before (which no selection consumed).
absl::Status DeviceBuffers::ClearFeedback(cudaStream_t stream) {
  if (feedback() == nullptr) return absl::OkStatus();
  return gpu::StreamClearFeedback(stream, feedback(), plan_.ElementsOf(SharedBuffer::kFeedback));
}

absl::StatusOr<uint64_t> DeviceBuffers::ReadSelectionDone() {
  DeviceScope scope;
  RETURN_IF_ERROR(scope.Enter(device_));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_done_, flags() + 1, sizeof(uint64_t),
                                       cudaMemcpyDeviceToHost, side_stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(side_stream_));
  return *host_done_;
}

// DeviceBuffers as a watchdog's device: its side stream reads and releases, so the
// engine's waiting stream is not in the way. Each function holds the buffers: the
// watchdog's Device lives as long as the watchdog, so the region does too.
absl::StatusOr<std::unique_ptr<SelectionWatchdog>> SelectionWatchdog::Create(
    std::shared_ptr<DeviceBuffers> buffers, std::chrono::microseconds timeout) {
  if (buffers == nullptr) {
    return absl::InvalidArgumentError("SelectionWatchdog: buffers is null");
  }
  return Create(
      Device{.read_done = [buffers] { return buffers->ReadSelectionDone(); },
             .release_dense = [buffers](uint64_t step) { return buffers->ReleaseDense(step); }},
      timeout);
}

}  // namespace eps::client
