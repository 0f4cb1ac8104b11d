#include "service/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/buffer_contract.h"
#include "core/status.h"
#include "gpu/device.h"
#include "gpu/ipc_mapping.h"
#include "gpu/live_streams.h"
#include "gpu/step.h"
#include "service/telemetry/nvtx.h"

namespace eps::service {
namespace {

class DeviceMemory final : public MappedMemory {
 public:
  explicit DeviceMemory(std::unique_ptr<gpu::IpcMapping> mapping)
      : mapping_(std::move(mapping)),
        name_(absl::StrCat("<cuda ipc, device ", mapping_->device(), ">")) {}
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
  CudaBackend(std::unique_ptr<gpu::GpuSelector> selector, int device,
              std::chrono::microseconds inputs_timeout, uint64_t strict_bytes)
      : selector_(std::move(selector)),
        device_(device),
        inputs_timeout_(inputs_timeout),
        strict_bytes_(strict_bytes) {}
  BackendKind kind() const override { return BackendKind::kCuda; }
  bool async_replies() const override { return true; }
  bool frees_device_memory() const override { return true; }
  // A wait older than --inputs-timeout-ms is one epsd would release at the session's
  // next call: its engine is late or dead.
  bool SafeToDestroy(std::chrono::steady_clock::duration deferred) const override {
    return selector_->SafeToFree(deferred, inputs_timeout_);
  }
  std::optional<std::chrono::steady_clock::time_point> AbandonedWorkSince() const override {
    return gpu::OldestAbandonment(device_);
  }

  void set_memory_budget(MemoryBudget* budget) override { budget_ = budget; }

  absl::Status Run(const BackendStep& call, StepOutcome* result) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    // Strict mode's upper bounds: a second device array as large as the scores, allocated
    // by the session's first strict step (gpu/step.cu), charged before it (it was not).
    if (call.policy.strict && budget_ != nullptr && strict_charge_.bytes() == 0) {
      absl::StatusOr<MemoryCharge> charge =
          budget_->Charge(strict_bytes_, "strict mode's upper bounds on the device");
      if (!charge.ok()) return charge.status();
      strict_charge_ = *std::move(charge);
    }
    const uint64_t step = call.step;
    const bool async = call.async;
    telemetry::NvtxRange step_range("eps.step");
    // An async step still queued finishes first: its statistics ride on this reply, or on
    // the session's next successful one (Session::KeepUndelivered).
    if (selector_->pending()) {
      telemetry::NvtxRange range("eps.finish_earlier");
      FinishedStep& f = result->earlier.emplace_back();
      f.step = selector_->pending_step();
      float us = 0;
      f.status = selector_->Finish(inputs_timeout_, &f.stats, &us);
      f.prepass_us = us;
    }
    uint64_t* const flags = call.flags;
    if (flags != nullptr && !done_floor_read_) {
      // Counters only grow: a step at or below the buffer's selection_done would be
      // neither awaited by the engine nor written here (a silent stale list), so a
      // session's first step reads it once and such steps are refused.
      ASSIGN_OR_RETURN(done_floor_, gpu::ReadCounter(device_, flags + 1));
      done_floor_read_ = true;
    }
    if (flags != nullptr && step <= done_floor_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", step, " is not after selection_done=", done_floor_,
          " in the flags buffer (the buffer's value at the session's first step, or a step "
          "sent since): step numbers must keep increasing for the buffer's lifetime"));
    }
    // From here on selection_done may reach `step` whatever the step's outcome (a step
    // that fails on the device releases it densely): its number is used. A resend of it
    // once passed these checks and returned OK with the failed step's -1 lists, the kernel
    // finding selection_done already there.
    if (flags != nullptr) done_floor_ = step;
    gpu::GpuSelector::StepFence fence;
    fence.step = step;
    if (flags != nullptr) {
      fence.selection_done = flags + 1;
      // A sync call's inputs are in place before the call (the RPC orders the
      // two sides); an async step waits for the engine's stream on the device.
      if (async) fence.inputs_ready = flags;
    } else if (async) {
      return absl::FailedPreconditionError(
          "reply_mode=REPLY_MODE_ASYNC needs a flags buffer (inputs_ready, selection_done) in "
          "Attach");
    }
    {
      telemetry::NvtxRange range("eps.enqueue");  // host checks, the inputs_ready wait, launches
      RETURN_IF_ERROR(selector_->Enqueue(call.inputs, call.policy, call.outputs, fence));
    }
    if (async || !selector_->pending()) {
      result->done = !async;
      return absl::OkStatus();
    }
    float gpu_us = 0.0f;
    telemetry::NvtxRange range("eps.prepass_wait");
    RETURN_IF_ERROR(selector_->Finish(std::chrono::microseconds::max(), &result->stats, &gpu_us));
    result->prepass_us = gpu_us;
    return absl::OkStatus();
  }

 protected:
  // A queued async step still writes its lists and selection_done once the engine's
  // inputs_ready reaches it. Waited for as the next step would wait (up to
  // --inputs-timeout-ms; not at all with `release_now`), then released by Finish: its
  // lists become -1 (attend densely) and the stream drains, so nothing is left queued
  // when the session ends.
  // Its status goes to the caller, which reports a lost device (session_service.cc).
  absl::Status FinishQueued(bool release_now) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    if (!selector_->pending()) return absl::OkStatus();
    StepStats stats;
    float us = 0;
    const std::chrono::microseconds wait =
        release_now ? std::chrono::microseconds(0) : inputs_timeout_;
    const uint64_t step = selector_->pending_step();
    absl::Status s = selector_->Finish(wait, &stats, &us);
    if (!s.ok()) {
      std::fprintf(stderr, "epsd: the queued step %llu of an ending session: %s\n",
                   static_cast<unsigned long long>(step), std::string(s.message()).c_str());
    }
    return s;
  }

 private:
  std::unique_ptr<gpu::GpuSelector> selector_;
  const int device_;
  const std::chrono::microseconds inputs_timeout_;
  const uint64_t strict_bytes_;
  MemoryBudget* budget_ = nullptr;
  MemoryCharge strict_charge_ ABSL_GUARDED_BY(step_mu_);
  bool done_floor_read_ ABSL_GUARDED_BY(step_mu_) = false;
  // selection_done at the first step, then the last step sent with the flags buffer.
  uint64_t done_floor_ ABSL_GUARDED_BY(step_mu_) = 0;
};

}  // namespace

uint64_t CudaBackendDeviceBytes(const ModelLayout& model, int64_t max_batch, int64_t max_groups,
                                int64_t max_coarse_groups) {
  return gpu::GpuSelector::DeviceBytes(model, max_batch, max_groups, max_coarse_groups);
}

bool CudaBackendBuilt() { return true; }

bool CudaSafeToFree(int device, std::chrono::steady_clock::duration deferred,
                    std::chrono::steady_clock::duration stale) {
  return gpu::SafeToFreeOn(device, nullptr, deferred, stale);
}

std::optional<std::chrono::steady_clock::time_point> CudaAbandonedWorkSince(int device) {
  return gpu::OldestAbandonment(device);
}

namespace {
// DisableCuda's reason, once called.
struct Disabled {
  absl::Mutex mu;
  std::optional<std::string> reason ABSL_GUARDED_BY(mu);
};
Disabled& disabled() {
  static Disabled d;
  return d;
}
}  // namespace

bool CudaDevicePresent() {
  {
    absl::MutexLock lock(&disabled().mu);
    if (disabled().reason.has_value()) return false;
  }
  return gpu::DeviceAvailable();
}

void DisableCuda(std::string reason) {
  absl::MutexLock lock(&disabled().mu);
  if (!disabled().reason.has_value()) disabled().reason = std::move(reason);
}

std::string CudaUnavailableReason() {
  absl::MutexLock lock(&disabled().mu);
  return disabled().reason.value_or("no CUDA device is visible to epsd");
}

int CudaDeviceCount() { return gpu::DeviceCount(); }

absl::Status WarmUpCuda() {
  for (int device = 0; device < gpu::DeviceCount(); ++device) {
    if (absl::Status s = gpu::GpuSelector::WarmUp(device); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("device ", device, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDeviceWithUuid(std::string_view uuid) { return gpu::DeviceWithUuid(uuid); }

CudaIpcOpener MakeCudaIpcOpener(int device) {
  // The session's device, not h.device(): with a device_uuid that is the engine's ordinal.
  return [device](const v1::CudaIpcHandle& h, std::unique_ptr<MappedMemory>* unusable)
             -> absl::StatusOr<std::unique_ptr<MappedMemory>> {
    std::unique_ptr<gpu::IpcMapping> opened;
    absl::StatusOr<std::unique_ptr<gpu::IpcMapping>> m =
        gpu::IpcMapping::Open(h.handle(), device, &opened);
    if (opened != nullptr) *unusable = std::make_unique<DeviceMemory>(std::move(opened));
    if (!m.ok()) return m.status();
    if ((*m)->size() % kRegionAlignment != 0) {
      // Served, but slowly: docs/design.md §5, "Allocate whole 2 MiB pages".
      std::fprintf(stderr,
                   "epsd: warning: a cuda_ipc allocation of %llu bytes is not a whole number of "
                   "2 MiB pages; the pre-pass reads such an allocation up to 2.4x slower (allocate "
                   "it rounded up, as client::DeviceBuffers does)\n",
                   static_cast<unsigned long long>((*m)->size()));
    }
    return std::unique_ptr<MappedMemory>(new DeviceMemory(std::move(*m)));
  };
}

absl::StatusOr<std::unique_ptr<StepBackend>> MakeCudaBackend(
    const ModelLayout& model, int device, int64_t max_batch, int64_t max_groups,
    std::chrono::microseconds inputs_timeout, std::unique_ptr<StepBackend>* remains) {
  // [max_batch, layers, q_heads, max_groups] floats (gpu/step.cu's `uppers`).
  const uint64_t strict_bytes = SaturatingProduct(
      {static_cast<uint64_t>(std::max<int64_t>(max_batch, 0)),
       static_cast<uint64_t>(model.num_layers), static_cast<uint64_t>(model.num_q_heads),
       static_cast<uint64_t>(std::max<int64_t>(max_groups, 0)), sizeof(float)});
  std::unique_ptr<gpu::GpuSelector> partial;
  absl::StatusOr<std::unique_ptr<gpu::GpuSelector>> selector =
      gpu::GpuSelector::Create(model, device, max_batch, max_groups, {}, &partial);
  if (!selector.ok()) {
    if (partial != nullptr && remains != nullptr) {
      *remains =
          std::make_unique<CudaBackend>(std::move(partial), device, inputs_timeout, strict_bytes);
    }
    return selector.status();
  }
  return std::unique_ptr<StepBackend>(
      new CudaBackend(std::move(*selector), device, inputs_timeout, strict_bytes));
}

}  // namespace eps::service
