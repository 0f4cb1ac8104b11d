// A session's step backend: the CPU reference over host memory, or the CUDA
// pre-pass over device memory mapped from the engine (DESIGN §5).
#pragma once

#include <memory>
#include <span>

#include "absl/status/status.h"
#include "core/step.h"

namespace eps::service {

class Session;

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual const char* name() const = 0;
  // Runs one step (the caller holds session.step_mu), writes the visit lists
  // and then publishes selection_done = step when a flags buffer is attached.
  virtual absl::Status Run(Session& session, std::span<const StepRow> rows, uint64_t step,
                           const SelectPolicy& policy, StepStats* stats, double* prepass_us) = 0;
};

std::unique_ptr<StepBackend> MakeCpuBackend();

// True when this build has the CUDA backend (nvcc was found).
bool CudaBackendBuilt();

}  // namespace eps::service
