// Runs the device summary writer (gpu/summary.h) off the engine's thread.
//
// gpu::DeviceSummaryWriter::Append waits for its kernel (it reads back which
// appends it skipped), so calling it on the engine's thread would stall the
// launches of the next step. Submit() instead records an event on the engine's
// stream and hands the appends to a worker thread, which makes its own stream
// wait for that event, applies them, and raises a device counter to the step;
// WaitSummaries() enqueues a wait for that counter on the engine's stream.
// Ordering is kept on the device; no host waits on the GPU in the engine thread.
//
// A failed submission (a non-finite key, a malformed append) still raises the
// counter, so no stream waits forever; it is counted in errors().
// Thread safety: Submit, WaitSummaries and Drain from one engine thread;
// errors() from any thread. The worker is joined in the destructor.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/summary.h"

namespace eps::client {

class SummaryQueue {
 public:
  static absl::StatusOr<std::unique_ptr<SummaryQueue>> Create(gpu::DeviceSummaryWriter& writer,
                                                              int device);
  ~SummaryQueue();
  SummaryQueue(const SummaryQueue&) = delete;
  SummaryQueue& operator=(const SummaryQueue&) = delete;

  absl::Status Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype, cudaStream_t after,
                      uint64_t step);
  absl::Status WaitSummaries(cudaStream_t stream, uint64_t step);
  absl::Status Drain();  // blocks until the worker has applied everything submitted
  uint64_t errors(std::string* last_error) const;

 private:
  struct Job {
    std::vector<gpu::KeyAppend> appends;
    DType dtype;
    cudaEvent_t after;
    uint64_t step;
  };
  SummaryQueue(gpu::DeviceSummaryWriter& writer, int device) : writer_(writer), device_(device) {}
  void Loop();

  gpu::DeviceSummaryWriter& writer_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  uint64_t* done_ = nullptr;  // device counter: the newest step applied
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;    // guarded by mu_
  int64_t in_flight_ = 0;   // guarded by mu_: submitted and not yet applied
  bool stop_ = false;       // guarded by mu_
  uint64_t errors_ = 0;     // guarded by mu_
  std::string last_error_;  // guarded by mu_
  std::thread worker_;
};

}  // namespace eps::client
