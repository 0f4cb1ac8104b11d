#include "client/cpp/engine_summary_queue.h"

#include <utility>

#include "gpu/cuda_check.h"
#include "gpu/stream_ops.h"

namespace eps::client {

absl::StatusOr<std::unique_ptr<SummaryQueue>> SummaryQueue::Create(gpu::DeviceSummaryWriter& writer,
                                                                   int device) {
  auto q = std::unique_ptr<SummaryQueue>(new SummaryQueue(writer, device));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&q->stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&q->done_, sizeof(uint64_t)));
  CUDA_RETURN_IF_ERROR(cudaMemset(q->done_, 0, sizeof(uint64_t)));
  // Load the stream-op kernels before any wait is queued (gpu/stream_ops.h).
  if (absl::Status s = gpu::PreloadStreamOps(); !s.ok()) return s;
  q->worker_ = std::thread([raw = q.get()] { raw->Loop(); });
  return q;
}

SummaryQueue::~SummaryQueue() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  cudaSetDevice(device_);
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (done_ != nullptr) cudaFree(done_);
}

absl::Status SummaryQueue::Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype,
                                  cudaStream_t after, uint64_t step) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaEvent_t event = nullptr;
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  if (const cudaError_t err = cudaEventRecord(event, after); err != cudaSuccess) {
    cudaEventDestroy(event);
    return absl::InternalError(absl::StrCat("cudaEventRecord: ", cudaGetErrorString(err)));
  }
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(Job{std::move(appends), key_dtype, event, step});
    ++in_flight_;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status SummaryQueue::WaitSummaries(cudaStream_t stream, uint64_t step) {
  return gpu::StreamWaitCounter(stream, done_, step);
}

absl::Status SummaryQueue::Drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
  return absl::OkStatus();
}

uint64_t SummaryQueue::errors(std::string* last_error) const {
  std::lock_guard lock(mu_);
  if (last_error != nullptr) *last_error = last_error_;
  return errors_;
}

void SummaryQueue::Loop() {
  cudaSetDevice(device_);
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, nothing left
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    // Off the lock: the device work of one step, in order on the queue's stream.
    absl::Status status = absl::OkStatus();
    if (const cudaError_t err = cudaStreamWaitEvent(stream_, job.after, 0); err != cudaSuccess) {
      status = absl::InternalError(absl::StrCat("cudaStreamWaitEvent: ", cudaGetErrorString(err)));
    } else {
      status = writer_.Append(job.appends, job.dtype, stream_);
    }
    cudaEventDestroy(job.after);
    // Raised whatever happened: a waiting engine stream must never hang on a failed write.
    absl::Status raised = gpu::StreamRaiseCounter(stream_, done_, job.step);
    if (raised.ok() && cudaStreamSynchronize(stream_) != cudaSuccess) {
      raised = absl::InternalError("cudaStreamSynchronize after the summary counter");
    }
    lock.lock();
    if (!status.ok() || !raised.ok()) {
      ++errors_;
      last_error_ =
          absl::StrCat("step ", job.step, ": ", (!status.ok() ? status : raised).ToString());
    }
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace eps::client
