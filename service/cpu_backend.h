// The CPU backend: runs each step with the core/ reference selector over host
// memory, then publishes selection_done. It owns the session's Φ bank and
// core selector; a cuda session builds neither.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "service/backend.h"

namespace eps::service {

// Builds the Φ bank and the core selector for `model`.
absl::StatusOr<std::unique_ptr<StepBackend>> MakeCpuBackend(const ModelLayout& model);

}  // namespace eps::service
