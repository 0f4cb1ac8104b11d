// A session's step backend: the CPU reference over host memory, or the CUDA
// pre-pass over device memory mapped from the engine (DESIGN §5).
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "core/step.h"

namespace eps::service {

class Session;

// A step that an async reply accepted and a later call found finished.
struct FinishedStep {
  uint64_t step = 0;
  absl::Status status;  // its device-side outcome (its lists are -1 when not ok)
  StepStats stats;
  double prepass_us = 0;
};

struct StepResult {
  bool done = true;  // false: queued (async), statistics come with a later reply
  StepStats stats;   // this step's, when done
  double prepass_us = 0;
  std::vector<FinishedStep> earlier;  // async steps finished since the last call
};

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual const char* name() const = 0;
  // Whether Run takes async = true (the cuda backend); the selector refuses
  // async requests for other backends before it takes the step lock.
  virtual bool async_replies() const { return false; }
  // Runs one step (the caller holds session.step_mu), writes the visit lists
  // and then publishes selection_done = step when a flags buffer is attached.
  // `async` (only where async_replies()): queue the step and return.
  virtual absl::Status Run(Session& session, std::span<const StepRow> rows, uint64_t step,
                           const SelectPolicy& policy, bool async, StepResult* result) = 0;
};

std::unique_ptr<StepBackend> MakeCpuBackend();

// True when this build has the CUDA backend (nvcc was found).
bool CudaBackendBuilt();

}  // namespace eps::service
