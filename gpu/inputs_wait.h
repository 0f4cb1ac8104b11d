// The selector stream's waits on an engine's inputs_ready counter (docs/design.md
// §5-§6), and the host-side bounds around them: a stream whose progress engine
// memory controls is never waited on without a limit.
//
// A wait is queued at the head of an async step (Queue). It is released by
// raising the counter to the step on a second stream (Release; stream_ops.h's
// cyclic raise) when the engine never signals, when the step fails after the
// wait was queued, or when the selector ends. After a release the stream gets
// `drain_timeout` to finish; if it does not (the engine keeps lowering its
// counter, or the release sits in a hardware queue behind a wait), the waits are
// poisoned: every later use fails with FAILED_PRECONDITION naming why, and the
// owner abandons the stream instead of synchronising on it (Abandon).
//
// Thread safety: one caller at a time (the GpuSelector's).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/cuda_check.h"

namespace eps::gpu {

class InputsWait {
 public:
  InputsWait() = default;
  ~InputsWait();
  InputsWait(const InputsWait&) = delete;
  InputsWait& operator=(const InputsWait&) = delete;

  // The release stream and the `released` word (SelectArgs::released), zeroed.
  absl::Status Init(std::chrono::microseconds drain_timeout);

  // Queues on `stream` a wait until *inputs_ready >= step (cyclic, stream_ops.h)
  // and remembers it until the stream is seen drained.
  absl::Status Queue(cudaStream_t stream, uint64_t* inputs_ready, uint64_t step);

  // On the release stream: released = launch (the launch's selection writes
  // every list -1), then the remembered counter raised to its step. Nothing
  // when no wait is outstanding.
  absl::Status Release(uint64_t launch);

  // Waits for `stream` to drain. With a wait outstanding: up to `timeout`
  // (drain_timeout when it is microseconds::max()), then Release(launch) and up
  // to drain_timeout more, poisoning on expiry. Without one the stream's
  // progress is the kernels' own, and the wait is unbounded. Sets *released
  // when it released the wait.
  absl::Status Drain(cudaStream_t stream, std::chrono::microseconds timeout, uint64_t launch,
                     bool* released);

  // Releases any wait still queued (the engine may be gone, or the step failed)
  // and gives the stream drain_timeout to drain: Drain with no wait beyond it.
  // False when it did not drain, or the waits were already poisoned.
  bool Settle(cudaStream_t stream, uint64_t launch) {
    bool released = false;
    return !poisoned() && Drain(stream, std::chrono::microseconds(0), launch, &released).ok();
  }

  // OK, or the FAILED_PRECONDITION that poisoned the waits.
  absl::Status Usable() const;
  bool poisoned() const { return !poisoned_.empty(); }

  // Leaves `stream` (which never drained) to the driver: it is recorded so that
  // IPC mappings on `device` stay mapped while it may still run (IpcMapping).
  void Abandon(int device, cudaStream_t stream) const;

  uint64_t* released() const { return released_.get(); }
  // Zeroes `released` once the release stream's own writes have landed (a release
  // queued there may still be pending after the step stream drained): a launch
  // number that is reused must not read as released.
  absl::Status ClearReleased();

  // When the wait still queued was queued (steady clock, ns since its epoch), 0 when none.
  const std::atomic<int64_t>* queued_ns() const { return &queued_ns_; }

 private:
  // Polls `stream` until it drains (true) or `deadline` (false), yielding.
  static absl::StatusOr<bool> DrainsBy(cudaStream_t stream,
                                       std::chrono::steady_clock::time_point deadline);

  cudaStream_t release_stream_ = nullptr;
  DeviceBuffer<uint64_t> released_;
  std::chrono::microseconds drain_timeout_{0};
  uint64_t* counter_ = nullptr;  // the latest wait queued, until the stream drained
  uint64_t step_ = 0;
  // When that wait was queued (steady clock, ns), 0 once drained: read by other threads
  // through gpu/live_streams.h, so a plain store on the step path, no lock.
  std::atomic<int64_t> queued_ns_{0};
  std::string poisoned_;  // why, once a released stream failed to drain
};

}  // namespace eps::gpu
