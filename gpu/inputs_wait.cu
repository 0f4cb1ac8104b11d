#include <thread>

#include "absl/strings/str_cat.h"
#include "gpu/inputs_wait.h"
#include "gpu/live_streams.h"
#include "gpu/stream_ops.h"

namespace eps::gpu {

InputsWait::~InputsWait() {
  if (release_stream_ != nullptr) cudaStreamDestroy(release_stream_);
}

absl::Status InputsWait::Init(std::chrono::microseconds drain_timeout) {
  drain_timeout_ = drain_timeout;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking));
  RETURN_IF_CUDA_ALLOC(released_, 1);
  CUDA_RETURN_IF_ERROR(cudaMemset(released_.get(), 0, sizeof(uint64_t)));
  return absl::OkStatus();
}

absl::Status InputsWait::Queue(cudaStream_t stream, uint64_t* inputs_ready, uint64_t step) {
  if (absl::Status s = StreamWaitCounter(stream, inputs_ready, step); !s.ok()) return s;
  queued_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count(),
                   std::memory_order_relaxed);
  counter_ = inputs_ready;  // steps increase: raising to this one releases every earlier wait
  step_ = step;
  return absl::OkStatus();
}

absl::Status InputsWait::ClearReleased() {
  // On the release stream, after its counter write and raise (no wait: bounded), and
  // not on the legacy default stream, whose work may order against other streams.
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(released_.get(), 0, sizeof(uint64_t), release_stream_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(release_stream_));
  return absl::OkStatus();
}

absl::Status InputsWait::Release(uint64_t launch) {
  if (counter_ == nullptr) return absl::OkStatus();
  if (absl::Status s = StreamWriteCounter(release_stream_, released_.get(), launch); !s.ok()) {
    return s;
  }
  return StreamRaiseCounter(release_stream_, counter_, step_);
}

absl::StatusOr<bool> InputsWait::DrainsBy(cudaStream_t stream,
                                          std::chrono::steady_clock::time_point deadline) {
  cudaError_t q;
  while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::yield();  // rather than spin a core on the driver
  }
  if (q != cudaSuccess) {
    return CudaFailure("step stream", q);
  }
  return true;
}

absl::Status InputsWait::Drain(cudaStream_t stream, std::chrono::microseconds timeout,
                               uint64_t launch, bool* released) {
  *released = false;
  if (absl::Status s = Usable(); !s.ok()) return s;
  if (counter_ == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  const auto now = std::chrono::steady_clock::now();
  const auto first = timeout == std::chrono::microseconds::max() ? drain_timeout_ : timeout;
  const absl::StatusOr<bool> first_drained = DrainsBy(stream, now + first);
  if (!first_drained.ok()) return first_drained.status();
  bool drained = *first_drained;
  if (!drained) {
    // The engine never wrote inputs_ready: release our own wait so the stream
    // drains. The step then runs on whatever queries are there, so its selection
    // first learns that this launch was released: every list says "attend
    // densely" (-1) and no feedback is consumed.
    if (absl::Status s = Release(launch); !s.ok()) return s;
    *released = true;
    const absl::StatusOr<bool> after_release =
        DrainsBy(stream, std::chrono::steady_clock::now() + drain_timeout_);
    if (!after_release.ok()) return after_release.status();
    drained = *after_release;
  }
  if (!drained) {
    poisoned_ = absl::StrCat(
        "the selector's stream did not drain within ", drain_timeout_.count(),
        " us after its wait for inputs_ready >= ", step_,
        " was released (the engine lowered the counter again, or the release queued behind a "
        "wait): the session's GPU selector is abandoned; detach and attach again");
    return Usable();
  }
  counter_ = nullptr;
  queued_ns_.store(0, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status InputsWait::Usable() const {
  if (poisoned_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(poisoned_);
}

void InputsWait::Abandon(int device, cudaStream_t stream) const {
  NoteAbandonedStream(device, stream);
  NoteAbandonedStream(device, release_stream_);
}

}  // namespace eps::gpu
