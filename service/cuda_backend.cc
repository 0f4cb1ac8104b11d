#include "service/cuda_backend.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "gpu/ipc_mapping.h"
#include "gpu/step.h"
#include "service/session.h"

namespace eps::service {
namespace {

class DeviceMemory final : public MappedMemory {
 public:
  explicit DeviceMemory(std::unique_ptr<gpu::IpcMapping> mapping)
      : mapping_(std::move(mapping)), name_(absl::StrCat("<cuda ipc, device ", mapping_->device(), ">")) {}
  std::byte* data() const override { return mapping_->data(); }
  uint64_t size() const override { return mapping_->size(); }
  const std::string& name() const override { return name_; }
  bool is_device() const override { return true; }

 private:
  std::unique_ptr<gpu::IpcMapping> mapping_;
  std::string name_;
};

class CudaBackend final : public StepBackend {
 public:
  CudaBackend(std::unique_ptr<gpu::GpuSelector> selector, int device)
      : selector_(std::move(selector)), device_(device) {}
  const char* name() const override { return "cuda"; }

  absl::Status Run(Session& session, std::span<const StepRow> rows, uint64_t step,
                   const SelectPolicy& policy, StepStats* stats, double* prepass_us) override {
    const SessionBuffers& b = session.buffers;
    const StepInputs in = SessionStepInputs(session, rows);
    const StepOutputs out = SessionStepOutputs(session);
    float gpu_us = 0.0f;
    if (absl::Status s = selector_->Select(in, policy, out, stats, &gpu_us); !s.ok()) return s;
    *prepass_us = gpu_us;
    if (b.has_flags) {
      // Select synchronised its stream, so the outputs precede this write.
      return gpu::WriteCounter(device_, reinterpret_cast<uint64_t*>(b.flags.data) + 1, step);
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<gpu::GpuSelector> selector_;
  int device_;
};

}  // namespace

bool CudaBackendBuilt() { return true; }

bool CudaDevicePresent() { return gpu::DeviceAvailable(); }

CudaIpcOpener MakeCudaIpcOpener() {
  return [](const v1::CudaIpcHandle& h) -> absl::StatusOr<std::unique_ptr<MappedMemory>> {
    absl::StatusOr<std::unique_ptr<gpu::IpcMapping>> m = gpu::IpcMapping::Open(h.handle(), h.device());
    if (!m.ok()) return m.status();
    return std::unique_ptr<MappedMemory>(new DeviceMemory(std::move(*m)));
  };
}

absl::StatusOr<std::unique_ptr<StepBackend>> MakeCudaBackend(const ModelLayout& model, int device,
                                                             int64_t max_batch,
                                                             int64_t max_groups) {
  absl::StatusOr<std::unique_ptr<gpu::GpuSelector>> selector =
      gpu::GpuSelector::Create(model, device, max_batch, max_groups);
  if (!selector.ok()) return selector.status();
  return std::unique_ptr<StepBackend>(new CudaBackend(std::move(*selector), device));
}

}  // namespace eps::service
