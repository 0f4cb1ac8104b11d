// The device summary writer (gpu/summary.h) on the engine's own stream.
//
// Submit() queues one step's appends on the stream the engine passes (after
// the work that wrote the keys) and raises a device counter to the step behind
// them, on the same stream; it never waits for the device. WaitSummaries()
// enqueues a wait for that counter on any stream.
//
// Why one stream: a stream memory wait that blocks a hardware queue also blocks
// every later command in that queue, and CUDA may map several streams of a
// process onto one queue (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default). A wait
// for a counter that another stream of the same process raises later (the
// earlier design: a worker thread and its own stream) can therefore deadlock;
// seen on the H100 with CUDA_DEVICE_MAX_CONNECTIONS=1. Here the raise is always
// queued before any wait for it.
//
// A submission the host checks refuse (a malformed append) queues nothing but
// the counter raise, so no stream waits forever; it is counted in errors(),
// as are appends the device skipped (a non-finite key), which errors() reads
// back from the device: call it after Drain().
// Ownership: the queue shares the writer (a shared_ptr): whoever drops the writer first,
// it lives until the queue is gone too. Thread safety: one engine thread.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/summary.h"

namespace eps::client {

class SummaryQueue {
 public:
  // InvalidArgument for a null writer.
  static absl::StatusOr<std::unique_ptr<SummaryQueue>> Create(
      std::shared_ptr<gpu::DeviceSummaryWriter> writer, int device);
  ~SummaryQueue();
  SummaryQueue(const SummaryQueue&) = delete;
  SummaryQueue& operator=(const SummaryQueue&) = delete;

  // Queues the appends of `step` on `stream`, then summaries_done = step.
  absl::Status Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype, cudaStream_t stream,
                      uint64_t step);
  absl::Status WaitSummaries(cudaStream_t stream, uint64_t step);
  // Blocks until the newest submission, and all earlier work of its stream, is applied.
  absl::Status Drain();
  uint64_t errors(std::string* last_error) const;

 private:
  SummaryQueue(std::shared_ptr<gpu::DeviceSummaryWriter> writer, int device)
      : writer_(std::move(writer)), device_(device) {}

  const std::shared_ptr<gpu::DeviceSummaryWriter> writer_;
  const int device_;
  uint64_t* done_ = nullptr;               // device counter: the newest step applied
  unsigned long long* skipped_ = nullptr;  // device counter: appends the device skipped
  cudaEvent_t last_ = nullptr;             // after the newest submission
  bool submitted_ = false;
  mutable std::mutex mu_;
  uint64_t refused_ = 0;    // guarded by mu_: submissions the host checks refused
  std::string last_error_;  // guarded by mu_
};

}  // namespace eps::client
