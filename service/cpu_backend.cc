#include "service/cpu_backend.h"

#include <atomic>
#include <chrono>

#include "core/phi.h"
#include "core/status.h"
#include "core/step.h"

namespace eps::service {
namespace {

class CpuBackend final : public StepBackend {
 public:
  // `phi` is heap-allocated so the selector's pointer to it survives moves.
  CpuBackend(std::unique_ptr<PhiBank> phi, PageSelector selector)
      : phi_(std::move(phi)), selector_(std::move(selector)) {}

  BackendKind kind() const override { return BackendKind::kCpu; }

  absl::Status Run(const BackendStep& step, StepOutcome* outcome) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s =
        selector_.Select(step.inputs, step.policy, step.outputs, &outcome->stats, step.stop);
    if (s.ok() && step.flags != nullptr) {
      // flags = [inputs_ready, selection_done]; release orders the outputs before it.
      std::atomic_ref<uint64_t> done(step.flags[1]);
      done.store(step.step, std::memory_order_release);
    }
    outcome->prepass_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    return s;
  }

 private:
  const std::unique_ptr<PhiBank> phi_;
  const PageSelector selector_;  // reads *phi_
};

}  // namespace

absl::StatusOr<std::unique_ptr<StepBackend>> MakeCpuBackend(const ModelLayout& model) {
  ASSIGN_OR_RETURN(PhiBank phi,
                   PhiBank::Create(model.phi_seed, model.num_layers, model.num_kv_heads,
                                   model.head_dim, model.sketch_dim));
  auto bank = std::make_unique<PhiBank>(std::move(phi));
  ASSIGN_OR_RETURN(PageSelector selector, PageSelector::Create(model, *bank));
  return std::make_unique<CpuBackend>(std::move(bank), std::move(selector));
}

}  // namespace eps::service
