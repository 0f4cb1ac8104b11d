#include "client/cpp/engine_summary_queue.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/stream_ops.h"

namespace eps::client {

absl::StatusOr<std::unique_ptr<SummaryQueue>> SummaryQueue::Create(
    std::shared_ptr<gpu::DeviceSummaryWriter> writer, int device) {
  if (writer == nullptr) return absl::InvalidArgumentError("SummaryQueue: the writer is null");
  auto q = std::unique_ptr<SummaryQueue>(new SummaryQueue(std::move(writer), device));
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* counters = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&counters, 2 * sizeof(uint64_t)));
  q->done_ = static_cast<uint64_t*>(counters);
  q->skipped_ = reinterpret_cast<unsigned long long*>(q->done_ + 1);
  CUDA_RETURN_IF_ERROR(cudaMemset(counters, 0, 2 * sizeof(uint64_t)));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&q->last_, cudaEventDisableTiming));
  // Load the stream-op kernels before any wait is queued (gpu/stream_ops.h).
  RETURN_IF_ERROR(gpu::PreloadStreamOps());
  return q;
}

SummaryQueue::~SummaryQueue() {
  cudaSetDevice(device_);
  if (last_ != nullptr) {
    if (submitted_) cudaEventSynchronize(last_);
    cudaEventDestroy(last_);
  }
  if (done_ != nullptr) cudaFree(done_);
}

absl::Status SummaryQueue::Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype,
                                  cudaStream_t stream, uint64_t step) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const absl::Status applied = writer_->AppendAsync(appends, key_dtype, stream, skipped_);
  if (!applied.ok()) {
    std::lock_guard lock(mu_);
    ++refused_;
    last_error_ = absl::StrCat("step ", step, ": ", applied.ToString());
  }
  // Raised whatever happened: a waiting stream must never hang on a refused write.
  RETURN_IF_ERROR(gpu::StreamRaiseCounter(stream, done_, step));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(last_, stream));
  submitted_ = true;
  return absl::OkStatus();
}

absl::Status SummaryQueue::WaitSummaries(cudaStream_t stream, uint64_t step) {
  return gpu::StreamWaitCounter(stream, done_, step);
}

absl::Status SummaryQueue::Drain() {
  if (!submitted_) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last_));
  return absl::OkStatus();
}

uint64_t SummaryQueue::errors(std::string* last_error) const {
  unsigned long long skipped = 0;
  const bool read =
      cudaSetDevice(device_) == cudaSuccess &&
      cudaMemcpy(&skipped, skipped_, sizeof skipped, cudaMemcpyDeviceToHost) == cudaSuccess;
  std::lock_guard lock(mu_);
  if (last_error != nullptr) {
    *last_error = last_error_;
    if (skipped > 0 && last_error_.empty()) {
      *last_error = absl::StrCat(skipped,
                                 " appends skipped on the device: a non-finite key, or one beyond "
                                 "the binary16 range of the quest summary");
    } else if (!read) {
      *last_error = "could not read the skipped-append counter back from the device";
    }
  }
  return refused_ + skipped;
}

}  // namespace eps::client
