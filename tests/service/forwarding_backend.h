// The stand-in backends of the service tests: the cpu backend, with a fault, a hold or a
// count of the test's around it (a step held until released, one that runs until
// cancelled, a lost device, a Retire that throws, ...).
#pragma once

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "service/backend.h"
#include "service/cpu_backend.h"
#include "service/session.h"

namespace eps::service {

// A backend whose steps another runs: Run runs them on `inner` unchanged, and the tests'
// stand-ins override it to do their part before or after RunInner.
class ForwardingBackend : public StepBackend {
 public:
  explicit ForwardingBackend(std::unique_ptr<StepBackend> inner) : inner_(std::move(inner)) {}
  BackendKind kind() const override { return inner_->kind(); }
  absl::Status Run(const BackendStep& step, StepOutcome* outcome) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    return RunInner(step, outcome);
  }

 protected:
  // The step on `inner`, under its own step lock (the caller holds only this backend's).
  absl::Status RunInner(const BackendStep& step, StepOutcome* outcome) {
    absl::MutexLock lock(&inner_->step_mu());
    return inner_->Run(step, outcome);
  }

 private:
  std::unique_ptr<StepBackend> inner_;
};

// A factory of sessions whose backend is `Wrapper(cpu, args...)`, over the cpu backend of
// the session's model; `args` (pointers to the test's state, mostly) are copied into it.
template <typename Wrapper, typename... Args>
BackendFactory WrapCpuBackend(Args... args) {
  return [args...](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
                   std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> cpu, MakeCpuBackend(spec.model));
    return std::unique_ptr<StepBackend>(std::make_unique<Wrapper>(std::move(cpu), args...));
  };
}

}  // namespace eps::service
