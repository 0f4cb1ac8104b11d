#include "service/backend.h"

#include "absl/strings/str_cat.h"

namespace eps::service {

absl::Status StepBackend::CheckStepOrder(uint64_t step) const {
  if (has_step_ && step <= last_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is not after the session's last step ", last_step_));
  }
  return absl::OkStatus();
}

void StepBackend::StepRan(uint64_t step) {
  has_step_ = true;
  last_step_ = step;
}

}  // namespace eps::service
