// Device-memory buffers for eps-load --backend=cuda: client::DeviceBuffers (one
// cudaMalloc exported over CUDA IPC), filled from eps-load's host images.
#include <cuda_runtime.h>

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/cpp/device_buffers.h"
#include "client/cpp/selection_watchdog.h"
#include "core/status.h"
#include "gpu/device.h"
#include "gpu/step.h"
#include "load/buffer_set.h"

namespace eps::load {
namespace {

absl::Status NoCoarseLevel() {
  return absl::FailedPreconditionError("the layout has no coarse level (coarse_blocks=0)");
}

// The stream that stands for the engine's in --reply=async: created with the
// buffers, destroyed before them.
struct StreamDeleter {
  void operator()(CUstream_st* stream) const { cudaStreamDestroy(stream); }
};
using OwnedStream = std::unique_ptr<CUstream_st, StreamDeleter>;

// The feedback pattern's device copy (--feedback-share): freed with the set.
struct DeviceFree {
  void operator()(float* p) const { cudaFree(p); }
};
using DeviceFloats = std::unique_ptr<float, DeviceFree>;

absl::Status CudaError(const std::string& call, cudaError_t err) {
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(err)));
}

class DeviceBufferSet final : public BufferSet {
 public:
  DeviceBufferSet(std::shared_ptr<client::DeviceBuffers> buffers, OwnedStream stream,
                  std::unique_ptr<client::SelectionWatchdog> watchdog)
      : buffers_(std::move(buffers)), stream_(std::move(stream)), watchdog_(std::move(watchdog)) {}

  v1::SharedBuffers Descriptors() const override { return buffers_->Descriptors(); }
  v1::Backend backend() const override { return v1::BACKEND_CUDA; }
  int device() const override { return buffers_->device(); }
  std::string device_uuid() const override { return *buffers_->DeviceUuid(); }  // read at Create
  int64_t max_groups() const override { return buffers_->plan().max_groups; }
  int64_t max_blocks() const override { return buffers_->plan().max_blocks; }

  absl::Status WriteSummaryPool(std::span<const float> pool) override {
    return Copy("summary pool", buffers_->summary_pool(), pool,
                ElementsOf(SharedBuffer::kSummaryPool));
  }
  absl::Status WriteGroupTable(std::span<const int32_t> table) override {
    return Copy("group table", buffers_->group_table(), table,
                ElementsOf(SharedBuffer::kGroupTable));
  }
  absl::Status WriteBlockTable(std::span<const int32_t> table) override {
    return Copy("block table", buffers_->block_table(), table,
                ElementsOf(SharedBuffer::kBlockTable));
  }
  absl::Status WriteQueries(std::span<const float> queries) override {
    return Copy("queries", buffers_->queries(), queries, ElementsOf(SharedBuffer::kQueries));
  }
  int64_t max_coarse_groups() const override { return buffers_->plan().max_coarse_groups; }
  absl::Status WriteCoarsePool(std::span<const float> pool) override {
    if (buffers_->coarse_pool() == nullptr) return NoCoarseLevel();
    return Copy("coarse pool", buffers_->coarse_pool(), pool,
                ElementsOf(SharedBuffer::kCoarsePool));
  }
  absl::Status WriteCoarseTable(std::span<const int32_t> table) override {
    if (buffers_->coarse_table() == nullptr) return NoCoarseLevel();
    return Copy("coarse table", buffers_->coarse_table(), table,
                ElementsOf(SharedBuffer::kCoarseTable));
  }

  absl::Status SetFeedbackPattern(std::span<const float> pattern) override {
    if (buffers_->feedback() == nullptr) return NoFeedbackBuffer();
    const int64_t want = ElementsOf(SharedBuffer::kFeedback);
    if (pattern.size() != static_cast<size_t>(want)) {
      return absl::InvalidArgumentError(
          absl::StrCat("feedback pattern has ", pattern.size(), " elements, want ", want));
    }
    if (cudaError_t err = cudaSetDevice(buffers_->device()); err != cudaSuccess) {
      return CudaError("cudaSetDevice", err);
    }
    float* device = nullptr;
    if (cudaError_t err = cudaMalloc(&device, pattern.size_bytes()); err != cudaSuccess) {
      return CudaError(absl::StrCat("cudaMalloc(feedback pattern, ", pattern.size_bytes(), ")"),
                       err);
    }
    feedback_pattern_.reset(device);
    return Copy("feedback pattern", device, pattern, want);
  }
  // One 3-D copy per row: x the row's first `groups` entries, y the q heads (pitch
  // max_groups), z the layers (slice pitch max_seqs · q_heads · max_groups), the same
  // strides in the pattern and the buffer. On this set's stream, then waited for: in a
  // sync call epsd reads the buffer as soon as the request arrives.
  absl::Status WriteFeedback(std::span<const FeedbackRows> rows) override {
    const client::BufferPlan& plan = buffers_->plan();
    RETURN_IF_ERROR(CheckFeedbackRows(rows, plan, feedback_pattern_ != nullptr));
    if (cudaError_t err = cudaSetDevice(buffers_->device()); err != cudaSuccess) {
      return CudaError("cudaSetDevice", err);
    }
    const ModelLayout& m = plan.model;
    const size_t pitch = plan.max_groups * sizeof(float);
    const size_t slice_rows = plan.shape.max_seqs * m.num_q_heads;
    for (const FeedbackRows& r : rows) {
      if (r.groups == 0) continue;
      const int64_t first = plan.FeedbackIndex(0, r.row, 0);
      cudaMemcpy3DParms copy{};
      copy.srcPtr =
          make_cudaPitchedPtr(feedback_pattern_.get() + first, pitch, plan.max_groups, slice_rows);
      copy.dstPtr =
          make_cudaPitchedPtr(buffers_->feedback() + first, pitch, plan.max_groups, slice_rows);
      copy.extent = make_cudaExtent(r.groups * sizeof(float), m.num_q_heads, m.num_layers);
      copy.kind = cudaMemcpyDeviceToDevice;
      if (cudaError_t err = cudaMemcpy3DAsync(&copy, stream_.get()); err != cudaSuccess) {
        return CudaError(absl::StrCat("cudaMemcpy3DAsync(feedback row ", r.row, ")"), err);
      }
    }
    if (cudaError_t err = cudaStreamSynchronize(stream_.get()); err != cudaSuccess) {
      return CudaError("cudaStreamSynchronize(feedback)", err);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<float> ReadFeedback(int layer, int64_t row, int q_head, int64_t group) override {
    ASSIGN_OR_RETURN(const int64_t at, FeedbackEntry(buffers_->plan(), layer, row, q_head, group));
    float value = 0;
    cudaError_t err = cudaSetDevice(buffers_->device());
    if (err == cudaSuccess) {
      err = cudaMemcpy(&value, buffers_->feedback() + at, sizeof(float), cudaMemcpyDeviceToHost);
    }
    if (err != cudaSuccess) return CudaError("cudaMemcpy(feedback entry)", err);
    return value;
  }

  bool supports_async() const override { return true; }
  absl::Status SignalInputsReady(uint64_t step) override {
    return buffers_->SignalInputsReady(stream_.get(), step);
  }
  absl::Status WaitSelection(uint64_t step) override {
    if (absl::Status s = buffers_->WaitSelection(stream_.get(), step); !s.ok()) return s;
    const uint64_t released = watchdog_->releases();
    if (absl::Status s = watchdog_->Arm(step); !s.ok()) return s;
    if (cudaError_t err = cudaStreamSynchronize(stream_.get()); err != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaStreamSynchronize(step ", step, "): ", cudaGetErrorString(err)));
    }
    if (watchdog_->releases() != released) {
      return absl::DeadlineExceededError(
          absl::StrCat("selection_done did not reach step ", step, " within ",
                       absl::FormatDuration(absl::FromChrono(watchdog_->timeout())),
                       " of the accepted reply: the watchdog released it densely"));
    }
    return absl::OkStatus();
  }
  absl::Status ReleaseDense(uint64_t step) override {
    return buffers_->ReleaseDense(step, stream_.get());
  }

 private:
  template <typename T>
  absl::Status Copy(const char* what, T* device, std::span<const T> host, int64_t want) const {
    if (host.size() != static_cast<size_t>(want)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has ", host.size(), " elements, want ", want));
    }
    cudaError_t err = cudaSetDevice(buffers_->device());  // a rank's buffers live on its GPU
    if (err == cudaSuccess) {
      err = cudaMemcpy(device, host.data(), host.size_bytes(), cudaMemcpyHostToDevice);
    }
    if (err != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaMemcpy(", what, "): ", cudaGetErrorString(err)));
    }
    return absl::OkStatus();
  }

  int64_t ElementsOf(SharedBuffer buffer) const { return buffers_->plan().ElementsOf(buffer); }

  std::shared_ptr<client::DeviceBuffers> buffers_;
  OwnedStream stream_;  // declared after buffers_: destroyed first
  // Declared after both: destroyed first, finishing the watch of a step still armed.
  std::unique_ptr<client::SelectionWatchdog> watchdog_;
  DeviceFloats feedback_pattern_;  // null until SetFeedbackPattern
};

}  // namespace

int DeviceCount() { return gpu::DeviceCount(); }

absl::StatusOr<std::unique_ptr<BufferSet>> CreateDeviceBufferSet(const ModelLayout& model,
                                                                 const BufferSetShape& shape,
                                                                 int device) {
  if (!gpu::DeviceAvailable()) {
    return absl::FailedPreconditionError("--backend=cuda: no CUDA device is visible to eps-load");
  }
  auto created = client::DeviceBuffers::Create(model, ClientShape(shape), device);
  if (!created.ok()) return created.status();
  std::shared_ptr<client::DeviceBuffers> buffers = std::move(*created);  // the watchdog's too
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(err)));
  }
  OwnedStream owned(stream);
  auto watchdog = client::SelectionWatchdog::Create(buffers, shape.selection_wait);
  if (!watchdog.ok()) return watchdog.status();
  return std::unique_ptr<BufferSet>(std::make_unique<DeviceBufferSet>(
      std::move(buffers), std::move(owned), std::move(*watchdog)));
}

}  // namespace eps::load
