// Device-memory buffers for eps-load --backend=cuda: client::DeviceBuffers (one
// cudaMalloc exported over CUDA IPC), filled from eps-load's host images.
#include <cuda_runtime.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "client/cpp/device_buffers.h"
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

class DeviceBufferSet final : public BufferSet {
 public:
  DeviceBufferSet(std::unique_ptr<client::DeviceBuffers> buffers, OwnedStream stream)
      : buffers_(std::move(buffers)), stream_(std::move(stream)) {}

  v1::SharedBuffers Descriptors() const override { return buffers_->Descriptors(); }
  v1::Backend backend() const override { return v1::BACKEND_CUDA; }
  int device() const override { return buffers_->device(); }
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

  bool supports_async() const override { return true; }
  absl::Status SignalInputsReady(uint64_t step) override {
    return buffers_->SignalInputsReady(stream_.get(), step);
  }
  absl::Status WaitSelection(uint64_t step) override {
    if (absl::Status s = buffers_->WaitSelection(stream_.get(), step); !s.ok()) return s;
    if (cudaError_t err = cudaStreamSynchronize(stream_.get()); err != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaStreamSynchronize(step ", step, "): ", cudaGetErrorString(err)));
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

  std::unique_ptr<client::DeviceBuffers> buffers_;
  OwnedStream stream_;  // declared after buffers_: destroyed first
};

}  // namespace

int DeviceCount() { return gpu::DeviceCount(); }

absl::StatusOr<std::unique_ptr<BufferSet>> CreateDeviceBufferSet(const ModelLayout& model,
                                                                 const BufferSetShape& shape,
                                                                 int device) {
  if (!gpu::DeviceAvailable()) {
    return absl::FailedPreconditionError("--backend=cuda: no CUDA device is visible to eps-load");
  }
  auto buffers = client::DeviceBuffers::Create(model, ClientShape(shape), device);
  if (!buffers.ok()) return buffers.status();
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(err)));
  }
  return std::unique_ptr<BufferSet>(
      std::make_unique<DeviceBufferSet>(std::move(*buffers), OwnedStream(stream)));
}

}  // namespace eps::load
