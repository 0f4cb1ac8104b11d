// What eps_gpu_bench's tables share (bench/gpu_select_bench.cc, bench/gpu_coarse_table.cc):
// the median of a sample, a host-to-device upload, and a step timed while held by a fence.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/select.h"
#include "core/step.h"
#include "gpu/cuda_check.h"
#include "gpu/step.h"

namespace eps::bench {

float Median(std::vector<float> v);

// Allocates `d` for `count` elements and copies them from `host`.
template <typename T>
absl::Status Upload(gpu::DeviceBuffer<T>& d, const T* host, int64_t count) {
  RETURN_IF_CUDA_ALLOC(d, count);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(d.get(), host, count * sizeof(T), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

// The step held on the selector's stream by an inputs_ready counter until its
// launch is queued, then released from another stream, as an engine's step
// fence holds it (docs/design.md §5): the p50 GPU µs of 50 steps (10 warm-up)
// without the host's launch inside it (Select's events bracket the host's graph
// launch on an idle GPU).
absl::StatusOr<double> MeasureQueued(gpu::GpuSelector& selector, const StepInputs& in,
                                     const SelectPolicy& policy, const StepOutputs& out);

}  // namespace eps::bench
