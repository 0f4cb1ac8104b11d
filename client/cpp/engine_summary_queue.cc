#include "client/cpp/engine_summary_queue.h"

#include <cstdint>
#include <string>
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
  RETURN_IF_ERROR(gpu::SetDevice(device));
  void* counters = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&counters, 2 * sizeof(uint64_t)));
  q->done_ = static_cast<uint64_t*>(counters);
  q->skipped_ = reinterpret_cast<unsigned long long*>(q->done_ + 1);
  CUDA_RETURN_IF_ERROR(cudaMemset(counters, 0, 2 * sizeof(uint64_t)));
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&q->last_, cudaEventDisableTiming));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&q->read_, cudaStreamNonBlocking));
  // Load the stream-op kernels before any wait is queued (gpu/stream_ops.h).
  RETURN_IF_ERROR(gpu::PreloadStreamOps());
  return q;
}

SummaryQueue::~SummaryQueue() {
  // Failures here can only be ignored; each is cleared so that the engine thread's next
  // unrelated error check does not report it (gpu::ClearFailedCall).
  const auto quiet = [](cudaError_t e) {
    if (e != cudaSuccess) gpu::ClearFailedCall();
  };
  gpu::TrySetDevice(device_);
  if (last_ != nullptr) {
    if (submitted_) quiet(cudaEventSynchronize(last_));
    quiet(cudaEventDestroy(last_));
  }
  if (read_ != nullptr) quiet(cudaStreamDestroy(read_));
  if (done_ != nullptr) quiet(cudaFree(done_));
}

absl::StatusOr<unsigned long long> SummaryQueue::ReadSkipped() const {
  unsigned long long skipped = 0;
  RETURN_IF_ERROR(gpu::SetDevice(device_));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&skipped, skipped_, sizeof skipped, cudaMemcpyDeviceToHost, read_));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(read_));
  return skipped;
}

absl::Status SummaryQueue::Submit(std::vector<gpu::KeyAppend> appends, DType key_dtype,
                                  cudaStream_t stream, uint64_t step) {
  if (submitted_ && stream != stream_) {
    return absl::InvalidArgumentError(
        absl::StrCat("SummaryQueue: step ", step, " submitted on stream ",
                     absl::Hex(reinterpret_cast<uintptr_t>(stream)),
                     ", but this queue's submissions go on "
                     "stream ",
                     absl::Hex(reinterpret_cast<uintptr_t>(stream_)),
                     " (one stream per queue: Drain waits for that stream's work only)"));
  }
  RETURN_IF_ERROR(gpu::SetDevice(device_));
  const absl::Status applied = writer_->AppendAsync(appends, key_dtype, stream, skipped_);
  if (!applied.ok()) {
    std::lock_guard lock(mu_);
    ++refused_;
    last_error_ = absl::StrCat("step ", step, ": ", applied.ToString());
  }
  // Raised whatever happened: a waiting stream must never hang on a refused write. The
  // event is recorded even when the raise fails, so that Drain and the destructor still
  // wait for the appends queued before it.
  const absl::Status raised = gpu::StreamRaiseCounter(stream, done_, step);
  CUDA_RETURN_IF_ERROR(cudaEventRecord(last_, stream));
  submitted_ = true;
  stream_ = stream;
  RETURN_IF_ERROR(raised);
  if (!applied.ok()) {
    return absl::Status(applied.code(), absl::StrCat("step ", step,
                                                     " (the counter was raised, "
                                                     "nothing applied): ",
                                                     applied.message()));
  }
  return absl::OkStatus();
}

absl::Status SummaryQueue::WaitSummaries(cudaStream_t stream, uint64_t step) {
  return gpu::StreamWaitCounter(stream, done_, step);
}

namespace {

std::string SkippedMessage(unsigned long long skipped) {
  return absl::StrCat(
      skipped,
      " appends skipped on the device, each whole: a non-finite key, one beyond the binary16 "
      "range of the quest summary (|k| <= 65504), or keys that would take the record's sums "
      "out of the float range (d * sum of squared norms >= FLT_MAX); their records miss those "
      "keys (a group left at count 0 is never visited)");
}

}  // namespace

absl::Status SummaryQueue::Drain() {
  if (!submitted_) return absl::OkStatus();
  RETURN_IF_ERROR(gpu::SetDevice(device_));
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last_));
  ASSIGN_OR_RETURN(const unsigned long long skipped, ReadSkipped());
  std::lock_guard lock(mu_);
  if (skipped > reported_) {
    const unsigned long long fresh = skipped - reported_;
    reported_ = skipped;
    return absl::DataLossError(
        absl::StrCat("SummaryQueue: ", SkippedMessage(fresh), " (since the last Drain)"));
  }
  return absl::OkStatus();
}

uint64_t SummaryQueue::errors(std::string* last_error) const {
  const absl::StatusOr<unsigned long long> counted = ReadSkipped();
  const bool read = counted.ok();
  const unsigned long long skipped = read ? *counted : 0;
  std::lock_guard lock(mu_);
  if (last_error != nullptr) {
    *last_error = last_error_;
    if (skipped > 0 && last_error_.empty()) {
      *last_error = SkippedMessage(skipped);
    } else if (!read) {
      *last_error = "could not read the skipped-append counter back from the device";
    }
  }
  return refused_ + skipped;
}

}  // namespace eps::client
