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
// One stream per queue: the first Submit fixes it and a Submit on another stream is
// refused (nothing queued, the counter not raised), so Drain() and the destructor,
// which wait for the newest submission, wait for every one of them.
//
// Failures are loud. A submission the host checks refuse (a malformed append) queues
// nothing but the counter raise, so no stream waits forever, and Submit returns the
// refusal. An append the device skips (a non-finite key, one beyond binary16 with quest
// on, keys whose squared norms would take the record's sums out of the float range) is
// skipped whole: its record misses every key of the run, and a group whose only run it
// was keeps count 0 and is never visited (docs/policy.md). The device counts them; the
// next Drain() reads the count back and returns DATA_LOSS naming how many were skipped
// since the last report, and errors() counts them all. An engine that sees it should
// reset the affected slots and re-append, or serve those sequences densely.
// Ownership: the queue shares the writer (a shared_ptr): whoever drops the writer first,
// it lives until the queue is gone too. Destroy the queue only after every stream that
// waits on its counter is past that wait (the counter is freed with it). Thread safety:
// one engine thread.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
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

  // Queues the appends of `step` on `stream`, then summaries_done = step. Refuses a stream
  // other than the first Submit's (InvalidArgument, nothing queued); returns the host
  // checks' refusal of the appends after queuing the counter raise.
  absl::Status Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype, cudaStream_t stream,
                      uint64_t step);
  absl::Status WaitSummaries(cudaStream_t stream, uint64_t step);
  // Blocks until the newest submission, and all earlier work of its stream, is applied;
  // DataLoss when the device skipped appends since the last Drain (each reported once).
  absl::Status Drain();
  uint64_t errors(std::string* last_error) const;

 private:
  // The device's skipped-append count, read on the queue's own non-blocking stream: a
  // copy on the legacy default stream would also wait for every blocking stream's work,
  // a counter wait the engine queued after its newest submission included.
  absl::StatusOr<unsigned long long> ReadSkipped() const;

  SummaryQueue(std::shared_ptr<gpu::DeviceSummaryWriter> writer, int device)
      : writer_(std::move(writer)), device_(device) {}

  const std::shared_ptr<gpu::DeviceSummaryWriter> writer_;
  const int device_;
  uint64_t* done_ = nullptr;               // device counter: the newest step applied
  unsigned long long* skipped_ = nullptr;  // device counter: appends the device skipped
  cudaEvent_t last_ = nullptr;             // after the newest submission
  cudaStream_t read_ = nullptr;            // non-blocking: ReadSkipped's copies
  bool submitted_ = false;
  cudaStream_t stream_ = nullptr;  // the first Submit's stream, when submitted_
  mutable std::mutex mu_;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;   // submissions the host checks refused
  uint64_t reported_ ABSL_GUARDED_BY(mu_) = 0;  // device skips Drain already reported
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::client
